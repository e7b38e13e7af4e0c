"""Pushing an exported folder to the Hugging Face Hub with `huggingface_hub`: the model repo is created
where it is missing, and the folder uploaded to it as one commit.

The token and the endpoint are huggingface_hub's own: `HF_TOKEN`, else the cached login (`hf auth login`);
`HF_ENDPOINT`, else huggingface.co. huggingface_hub's HTTP client waits for ever by default; the push gives
every request `TIMEOUT_SECONDS` to connect, to send each piece and to get each piece of the answer, so that
a server that accepts and never answers ends the push with its error instead of holding it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

__all__ = ["check_repo_id", "push_folder"]

TIMEOUT_SECONDS = 120.0  # per request and per piece of it: the Hub answers a commit in seconds


@contextlib.contextmanager
def _bounded_requests(seconds: float) -> Iterator[None]:
    """huggingface_hub's shared HTTP client, for the length of the block, with `seconds` as every timeout
    (connect, read, write, pool); the client it had is put back after."""
    from huggingface_hub.utils import _http, set_client_factory

    previous = _http._GLOBAL_CLIENT_FACTORY  # the default, or a factory the user set

    def bounded() -> object:
        client = previous()
        client.timeout = type(client.timeout)(seconds)  # the client's own Timeout class (httpx's API)
        return client

    set_client_factory(bounded)
    try:
        yield
    finally:
        set_client_factory(previous)


def check_repo_id(repo_id: str) -> None:
    """Refuse a name that is no Hub repo id ("name" or "org/name"), before anything is exported."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise ValueError(
            f"--push-to-hub {repo_id!r} is not a Hub repo id (name or org/name): {_one_line(err)}"
        ) from None


def push_folder(folder: str, repo_id: str, private: bool = False) -> str:
    """Create the model repo `repo_id` if missing (private with `private`, else the Hub's default) and
    upload every file of `folder` to it in one commit; returns the commit's URL.

    Raises RuntimeError, one line naming the repo and the Hub's answer, when the Hub refuses (no token, no
    write access), cannot be reached or does not answer within `TIMEOUT_SECONDS`; `folder` is left as it
    is, to push again.
    """
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        with _bounded_requests(TIMEOUT_SECONDS):
            api.create_repo(repo_id, private=private or None, exist_ok=True)
            commit = api.upload_folder(
                repo_id=repo_id,
                folder_path=folder,
                commit_message=f"Upload {os.path.basename(os.path.normpath(folder))} (grpo-lightning export)",
            )
    except Exception as err:  # HTTP errors, the HTTP client's connection errors and timeouts, a missing token
        raise RuntimeError(
            f"cannot push {folder!r} to the Hub repo {repo_id!r} at {api.endpoint}: {type(err).__name__}: "
            f"{_one_line(err)}; the export stays in {folder!r}: log in (hf auth login, or set HF_TOKEN) and "
            f"push it with `hf upload {repo_id} {folder}`"
        ) from err
    return commit.commit_url


def _one_line(err: Exception) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else repr(err)
