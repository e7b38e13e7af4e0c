"""Pushing an exported folder to the Hugging Face Hub with `huggingface_hub`: the model repo is created
where it is missing, and the folder uploaded to it as one commit.

The token and the endpoint are huggingface_hub's own: `HF_TOKEN`, else the cached login (`hf auth login`);
`HF_ENDPOINT`, else huggingface.co.
"""

from __future__ import annotations

import os

__all__ = ["check_repo_id", "push_folder"]


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
    write access) or cannot be reached; `folder` is left as it is, to push again.
    """
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        api.create_repo(repo_id, private=private or None, exist_ok=True)
        commit = api.upload_folder(
            repo_id=repo_id,
            folder_path=folder,
            commit_message=f"Upload {os.path.basename(os.path.normpath(folder))} (grpo-lightning export)",
        )
    except Exception as err:  # HTTP errors, the HTTP client's connection errors, a missing token: said alike
        raise RuntimeError(
            f"cannot push {folder!r} to the Hub repo {repo_id!r} at {api.endpoint}: {type(err).__name__}: "
            f"{_one_line(err)}; the export stays in {folder!r}: log in (hf auth login, or set HF_TOKEN) and "
            f"push it with `hf upload {repo_id} {folder}`"
        ) from err
    return commit.commit_url


def _one_line(err: Exception) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else repr(err)
