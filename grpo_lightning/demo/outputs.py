"""What the demo and benchmark scripts write, and how they fail: never over an earlier run's file, and bad
input as one `error:` line.

- `claim_output`: the file a script will write, checked before any work: not a folder, not a path through
  a file; an existing file is refused unless `overwrite` is given, and then only when the script itself wrote
  it (its `written_by` mark), never a user's file.
- `unused_paths`: `summary.json`, else `summary-1.json`, `summary-2.json`, ...: the first names not taken,
  one number for all of a run's files.
- `write_json`: the record with its mark, written whole (beside the target, then renamed over it).
- `run_script`: a script's `main`, its bad input (the errors `cli.py` reports so: a bad option, file, row or
  reward function) printed as one `error:` line with exit status 2; `GRPO_DEBUG=1` shows the traceback.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable

from lightning.pytorch.utilities.exceptions import MisconfigurationException

from grpo_lightning.io.files import write_atomically

MARK = "written_by"
# As `cli.INPUT_ERRORS`: what bad input raises, each with a message naming the culprit.
INPUT_ERRORS = (ValueError, OSError, RuntimeError, FloatingPointError, MisconfigurationException)


def _blocking_file(path: str) -> str | None:
    """A file standing where one of `path`'s folders should be, or None."""
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    return None if os.path.isdir(folder) else folder


def written_by(path: str) -> str | None:
    """The mark of a JSON file a script wrote (`{"written_by": ...}`), or None for any other file."""
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record.get(MARK) if isinstance(record, dict) else None


def claim_output(path: str, option: str, writer: str, overwrite: bool = False) -> None:
    """Refuse `path` as the output of `writer` (a script's name) unless the run may write it: see the
    module's docstring. `option` names the path in messages (`--out`)."""
    if os.path.isdir(path):
        raise ValueError(f"{option} {path} is a folder: name the file to write, e.g. {path}/results.json")
    blocking = _blocking_file(path)
    if blocking is not None:
        raise ValueError(f"{option} {path}: {blocking} is a file, not a folder")
    if not os.path.exists(path):
        return
    if written_by(path) != writer:
        raise ValueError(f"{option} {path} holds a file that {writer} did not write: choose another {option}")
    if not overwrite:
        raise ValueError(
            f"{option} {path} holds an earlier run's results: choose another {option}, or replace them with "
            "--overwrite"
        )


def unused_paths(folder: str, names: list[str]) -> list[str]:
    """`names` in `folder` if none is there, else the first of `<stem>-1<suffix>`, `<stem>-2<suffix>`, ...
    free for all of them: the files of one run keep one number."""

    def numbered(name: str, n: int) -> str:
        stem, suffix = os.path.splitext(name)
        return os.path.join(folder, f"{stem}-{n}{suffix}" if n else name)

    n = 0
    while any(os.path.exists(numbered(name, n)) for name in names):
        n += 1
    return [numbered(name, n) for name in names]


def write_json(path: str, record: dict, writer: str) -> None:
    """Write `record`, marked as `writer`'s, to `path` whole (`files.write_atomically`): a kill or a full
    disk mid-write leaves the earlier content."""
    write_atomically(path, json.dumps({MARK: writer, **record}, indent=2), "the results file")


def run_script(main: Callable[[list[str]], None], argv: list[str]) -> None:
    """Run a script's `main(argv)`; bad input ends in one `error:` line and exit status 2."""
    try:
        main(argv)
    except INPUT_ERRORS as err:
        if os.environ.get("GRPO_DEBUG") == "1":
            raise
        print(f"error: {' '.join(str(err).split())}\n(GRPO_DEBUG=1 shows the traceback)", file=sys.stderr)
        raise SystemExit(2) from None
