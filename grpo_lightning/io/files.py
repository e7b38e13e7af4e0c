"""Files written whole or not at all, and one writer per output.

- `write_atomically`: a file's new bytes go to a temporary file beside it, flushed to disk, then renamed
  over it (a rename within one folder is atomic): a kill at any moment leaves the earlier file or the new
  one, never a part; a failed write (a full disk) removes the temporary file, keeps the earlier one and
  raises one `OSError` naming the file.
- `replace_folder`: the same for a folder (an export): written whole beside it, then swapped into its place
  (`renameat2(RENAME_EXCHANGE)` on Linux; elsewhere two renames, the earlier folder kept beside it between
  them), the earlier one removed only once the new one is in place. A folder that cannot be renamed over
  (a mount point) is filled in place instead, each file whole (`_fill_in_place`).
- `OutputLock`: `<path>.lock`, made exclusively and naming its holder (process, host, command, the
  process's start), held while a run may write `path`: a second writer to the same place is refused in one
  line, never mixed with the first or written over it. A lock whose holder is gone is taken over, said in
  one warning: its process no longer runs on this host (or its id now belongs to another process, this
  one included: a requeued job), or the lock names no holder (its writing failed, a full disk) and is
  older than a few seconds. Holding it, a writer removes what a killed writer of the same path left beside
  it (`remove_leftovers`: a temporary file, an export's staging folder; an earlier export moved aside is
  put back).

Used for checkpoints (`checkpoints.AtomicCheckpointIO`), exports (`export.export_policy`), validation results
(`ValidationResultsWriter`) and the scripts' JSON files (`grpo_lightning.demo.outputs`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import shutil
import socket
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import IO

__all__ = ["OutputLock", "remove_leftovers", "replace_folder", "write_atomically"]

PARTIAL = ".partial"  # in the names of what `write_atomically` and `replace_folder` write beside a path


def write_atomically(path: str, content: bytes | str | Callable[[IO[bytes]], object], what: str = "") -> None:
    """Write `content` (bytes, text as UTF-8, or a function writing to a binary file) to `path` whole: see
    the module's docstring. `what` names the file in the error (`the checkpoint`, `the results file`)."""
    folder = os.path.dirname(os.path.abspath(path))
    temporary = None
    try:
        os.makedirs(folder, exist_ok=True)
        fd, temporary = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=PARTIAL, dir=folder)
        os.close(fd)
        with open(temporary, "wb") as f:
            if callable(content):
                content(f)
            else:
                f.write(content.encode("utf-8") if isinstance(content, str) else content)
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(OSError):  # mkstemp's private 0600: as `open` would make the file
            os.chmod(temporary, 0o666 & ~_umask())
        os.replace(temporary, path)
    except BaseException as err:
        if temporary is not None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(temporary)
        if isinstance(err, OSError):
            kept = "the earlier file is kept" if os.path.exists(path) else "no partial file left"
            name = f"{what} {path}" if what else path
            raise OSError(err.errno, f"could not write {name} ({err.strerror or err}); {kept}") from err
        raise


def replace_folder(out_dir: str, write: Callable[[str], object], what: str = "") -> None:
    """`write(folder)` into a new folder beside `out_dir`, then put it in `out_dir`'s place: see the
    module's docstring. A failed write leaves `out_dir` as it was and raises one `OSError` naming it."""
    out_dir = os.path.realpath(out_dir)  # through a link: the folder it points to is replaced, not the link
    parent, name = os.path.split(out_dir)
    staging = None
    try:
        os.makedirs(parent, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=f".{name}{PARTIAL}-", dir=parent)
        os.chmod(staging, 0o777 & ~_umask())  # a folder as `mkdir` makes it (0755), not mkdtemp's 0700
        write(staging)
    except BaseException as err:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        if isinstance(err, OSError):
            kept = "the earlier folder is kept" if os.path.exists(out_dir) else "nothing left behind"
            where = f"{what} {out_dir}" if what else out_dir
            raise OSError(err.errno, f"could not write {where} ({err.strerror or err}); {kept}") from err
        raise
    try:
        _swap_in(staging, out_dir)
    except OSError as err:
        try:
            if err.errno not in UNMOVABLE or not os.path.isdir(out_dir):
                raise
            _fill_in_place(staging, out_dir)  # a mount point: filled, as it cannot be replaced
        except OSError as final:
            kept = "the earlier folder is kept" if os.path.exists(out_dir) else "nothing left behind"
            where = f"{what} {out_dir}" if what else out_dir
            raise OSError(
                final.errno, f"could not write {where} ({final.strerror or final}); {kept}"
            ) from err
        finally:
            shutil.rmtree(staging, ignore_errors=True)


# What renaming a folder that is a mount point (an empty volume mounted for the output) raises.
UNMOVABLE = (errno.EBUSY, errno.EXDEV)


def _swap_in(staging: str, out_dir: str) -> None:
    if not os.path.exists(out_dir):
        os.rename(staging, out_dir)
    elif _exchange(staging, out_dir):
        shutil.rmtree(staging, ignore_errors=True)  # now the earlier folder
    else:
        retired = staging + RETIRED  # the earlier folder, whole, until the new one is in place
        os.rename(out_dir, retired)
        try:
            os.rename(staging, out_dir)
        except OSError:
            os.rename(retired, out_dir)
            raise
        shutil.rmtree(retired, ignore_errors=True)


def _fill_in_place(staging: str, out_dir: str) -> None:
    """Put `staging`'s entries in `out_dir`, a folder that cannot be renamed (a mount point): each copied
    beside its place inside `out_dir` and renamed into it, so that every file is whole; the entries of an
    earlier folder that the new one lacks are removed. Not one atomic step as a rename is: a kill part-way
    leaves some files of each (`remove_leftovers` removes the copies in flight)."""
    new = sorted(os.listdir(staging))
    for entry in os.listdir(out_dir):
        if entry not in new:
            gone = os.path.join(out_dir, entry)
            shutil.rmtree(gone) if os.path.isdir(gone) and not os.path.islink(gone) else os.remove(gone)
    for entry in new:
        source, target = os.path.join(staging, entry), os.path.join(out_dir, entry)
        copy = os.path.join(out_dir, f".{entry}.{os.getpid()}{PARTIAL}")
        try:
            if os.path.isdir(source) and not os.path.islink(source):
                shutil.copytree(source, copy, symlinks=True)
                if os.path.isdir(target) and not os.path.islink(target):
                    shutil.rmtree(target)
            else:
                shutil.copy2(source, copy, follow_symlinks=False)
            os.replace(copy, target)
        except BaseException:
            shutil.rmtree(copy, ignore_errors=True) if os.path.isdir(copy) else _remove_quietly(copy)
            raise


def _remove_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


RETIRED = ".replaced"  # the earlier folder's name beside the new one, between `replace_folder`'s two renames


def remove_leftovers(path: str) -> list[str]:
    """Remove what a killed writer of `path` left beside it, and return it: `write_atomically`'s temporary
    files, `replace_folder`'s staging folders (a whole model, for an export). An earlier folder moved aside
    by `replace_folder` is put back where `path` is missing (killed between its two renames), else removed.
    Only for the holder of `path`'s `OutputLock`: another writer's files in flight are not leftovers."""
    path = os.path.realpath(path)
    parent, name = os.path.split(path)
    try:
        entries = os.listdir(parent)
    except OSError:  # no folder yet: nothing left there
        return []
    removed = []
    # `.<name>.<random>.partial` (a file) and `.<name>.partial-<random>[.replaced]` (a folder): not those of
    # another output whose name starts with this one's (`val` and `val.jsonl`).
    ours = re.compile(rf"\.{re.escape(name)}\.(?:\w+{PARTIAL}|{PARTIAL[1:]}-\w+(?:{re.escape(RETIRED)})?)")
    for entry in sorted(e for e in entries if ours.fullmatch(e)):
        leftover = os.path.join(parent, entry)
        if entry.endswith(RETIRED) and os.path.isdir(leftover) and not os.path.lexists(path):
            os.rename(leftover, path)  # the earlier folder, whole: the new one never took its place
            continue
        if os.path.isdir(leftover) and not os.path.islink(leftover):
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.remove(leftover)
        removed.append(leftover)
    return removed


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


RENAME_EXCHANGE = 2  # linux/fs.h


def _exchange(a: str, b: str) -> bool:
    """Swap two paths in one atomic step (Linux `renameat2`); False where the system or filesystem has no
    such call."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):  # a C library without it (glibc < 2.28, musl)
        return False
    at_cwd = -100  # AT_FDCWD
    if renameat2(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # a filesystem that cannot swap
        return False
    raise OSError(code, os.strerror(code), a, None, b)


# A lock that names no holder is taken over once older than this: the moment between making it and writing
# its holder is far shorter; a failed write (a full disk) leaves it empty for good.
UNNAMED_LOCK_SECONDS = 10.0


class OutputLock:
    """`<path>.lock` while this process may write `path`: see the module's docstring. Re-entrant within a
    process (a callback holding it calls `export_policy`, which takes it too); `release` as often as
    `acquire`. `option` names `path` in the refusal (`results.path`, `export folder`)."""

    _held: dict[str, int] = {}  # lock file -> how many times this process holds it

    def __init__(self, path: str, option: str) -> None:
        # Beside the real path: a run writing through a link and one writing the file itself share one lock.
        self.lock_path = os.path.realpath(path) + ".lock"
        self.option, self.path = option, path
        self._made: list[str] = []

    def acquire(self) -> None:
        if self._held.get(self.lock_path):
            self._held[self.lock_path] += 1
            return
        folder, self._made = os.path.dirname(self.lock_path), []
        while not os.path.exists(folder):  # the folders made for the lock, removed with it while empty
            self._made.append(folder)
            folder = os.path.dirname(folder)
        try:
            os.makedirs(os.path.dirname(self.lock_path), exist_ok=True)
        except OSError as err:
            raise ValueError(f"{self.option} {self.path}: cannot make its folder ({err.strerror})") from None
        for _ in range(2):  # once more after taking over a lock whose holder is gone
            try:
                fd = os.open(self.lock_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except PermissionError as err:  # a read-only folder: nothing can be written there
                where = os.path.dirname(self.lock_path)
                raise ValueError(
                    f"{self.option} {self.path}: cannot write in {where} ({err.strerror})"
                ) from None
            except FileExistsError:
                self._take_over()
                continue
            self._write_holder(fd)
            self._held[self.lock_path] = 1
            for leftover in remove_leftovers(self.path):
                warnings.warn(
                    f"{self.option} {self.path}: removed {leftover}, left by a killed run", stacklevel=3
                )
            return

    def _write_holder(self, fd: int) -> None:
        """This process as the lock's holder; a failed write (a full disk) removes the lock it leaves."""
        started = _started(os.getpid())
        holder = f"process {os.getpid()} on {socket.gethostname()}: {' '.join(sys.argv)[:200]}\n"
        holder += f"started {started}\n" if started else ""
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(holder)
                f.flush()
                os.fsync(f.fileno())
        except OSError as err:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.lock_path)
            raise ValueError(
                f"{self.option} {self.path}: cannot write its lock {self.lock_path} ({err.strerror or err}); "
                "nothing written: free some space and run again"
            ) from None

    def _take_over(self) -> None:
        """Remove the lock file of a holder that is gone, said in one warning; refuse one held by another
        run (or that nothing here can tell is gone) in one line."""
        try:
            with open(self.lock_path, encoding="utf-8", errors="replace") as f:
                content = f.read().replace("\x00", "")  # a lost write may leave zeros
            age = time.time() - os.path.getmtime(self.lock_path)
        except FileNotFoundError:
            return  # let go meanwhile
        lines = content.strip().splitlines()
        first = lines[0] if lines else ""
        words = first.split()
        named = len(words) >= 4 and words[0] == "process" and words[1].isdigit() and words[2] == "on"
        if named:
            host = words[3].rstrip(":")
            if host != socket.gethostname():
                raise ValueError(
                    f"{self.option} {self.path} is being written by another run ({first}; lock "
                    f"{self.lock_path}): wait for it to end, or choose another path; if it no longer runs "
                    "on that host, remove the lock"
                )
            started = lines[1].removeprefix("started ").strip() if len(lines) > 1 else None
            gone = _gone(int(words[1]), started)
            if gone is None:
                raise ValueError(
                    f"{self.option} {self.path} is being written by another run ({first}; lock "
                    f"{self.lock_path}): wait for it to end, or choose another path"
                )
            why = f"its holder, {first}, {gone}"
        elif "process ".startswith(first[:8]) and age >= UNNAMED_LOCK_SECONDS:
            why = f"it names no holder ({first[:40]!r}: its writing failed, e.g. on a full disk)"  # ours, cut
        elif "process ".startswith(first[:8]):
            raise ValueError(
                f"{self.option} {self.path} is being written by another run (its lock {self.lock_path} was "
                "made a moment ago): wait for it to end, or choose another path"
            )
        else:
            raise ValueError(
                f"{self.option} {self.path}: its lock {self.lock_path} holds {first[:60]!r}, not a lock that "
                "grpo-lightning writes: remove it if no run writes there, or choose another path"
            )
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.lock_path)
        warnings.warn(f"{self.option} {self.path}: took over its lock {self.lock_path}: {why}", stacklevel=4)

    def release(self) -> None:
        count = self._held.get(self.lock_path, 0)
        if count > 1:
            self._held[self.lock_path] = count - 1
            return
        if count == 1:
            del self._held[self.lock_path]
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.lock_path)
            for folder in self._made:  # innermost first; one that now holds something stays
                try:
                    os.rmdir(folder)
                except OSError:
                    break

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _gone(pid: int, started: str | None) -> str | None:
    """Why the process that wrote a lock on this host is gone, or None while it may still run: no process
    has its id, or the one that has it started at another time (the id was reused), or it is this process,
    which does not hold the lock (an earlier run given the same id: a requeued job's)."""
    if pid == os.getpid():
        return "is gone: its process id is this process's, which did not write the lock"
    if not _running(pid):
        return "no longer runs"
    now = _started(pid)
    if started and now and now != started:
        return f"is gone: process {pid} is another process now (started {now}, not {started})"
    return None


def _started(pid: int) -> str | None:
    """When process `pid` started, in clock ticks since boot (Linux's `/proc/<pid>/stat`), or None where
    it cannot be read: with the id, it tells a process from a later one given the same id."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            fields = f.read().rpartition(")")[2].split()  # after the command's name, which may hold spaces
    except OSError:
        return None
    return fields[19] if len(fields) > 19 else None


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
