"""Nothing a user keeps is lost when a write is cut short: a kill at any moment of a checkpoint, an export or
a results file leaves every earlier file whole (the next writer removes what the killed one left, and puts
back an earlier export a killed swap moved aside); a second writer to one place is refused naming the first
(a lock whose holder is gone is taken over); a full disk is one line and keeps the earlier files."""

import errno
import os
import shutil
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo_lightning.io.export import export_policy
from grpo_lightning.io.files import OutputLock, remove_leftovers
from grpo_lightning.training.callbacks.results_writer import (
    ValidationResultsWriter,
    write_results,
)
from tests.helpers import (
    files_of,
    quiet_trainer,
)
from tests.test_interrupt import REPO


def write_earlier_and_new(kind: str, root: str, model_dir: str):
    """The earlier files of `kind` in `<root>/folder` (and a file beside them that no write touches), and
    the write that replaces one of them: a checkpoint, an export or a results file."""
    from grpo_lightning.io.checkpoints import AtomicCheckpointIO
    from grpo_lightning.training.callbacks.results_writer import write_results

    folder = os.path.join(root, "folder")
    os.makedirs(folder)  # and `root`
    with open(os.path.join(folder, "notes.txt"), "w") as f:
        f.write("a user's file beside the outputs\n")
    if kind == "checkpoint":
        io = AtomicCheckpointIO()
        io.save_checkpoint({"state_dict": {"w": torch.zeros(4096)}, "global_step": 1}, f"{folder}/last.ckpt")
        io.save_checkpoint({"state_dict": {"w": torch.ones(8)}, "global_step": 0}, f"{folder}/epoch=0.ckpt")
        new = {"state_dict": {"w": torch.full((4096,), 2.0)}, "global_step": 2}
        return lambda: io.save_checkpoint(new, f"{folder}/last.ckpt")
    if kind == "export":
        from transformers import AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(model_dir)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        export_policy(model, f"{folder}/export", tokenizer=tokenizer)
        with torch.no_grad():
            model.lm_head.weight.add_(1.0)  # the new export's weights differ from the earlier one's
        return lambda: export_policy(model, f"{folder}/export", tokenizer=tokenizer, overwrite=True)
    write_results(f"{folder}/val.jsonl", [{"set": None, "sample": 0, "completion": "4", "correct": True}])
    new = [{"set": None, "sample": i, "completion": str(i), "correct": False} for i in range(500)]
    return lambda: write_results(f"{folder}/val.jsonl", new)


def kill_at_every_step(kind: str, root: str, model_dir: str) -> None:
    """Run in a process of its own (`python -c`): for k = 1, 2, ... a forked child does the write of
    `write_earlier_and_new` and is killed (SIGKILL) just before its k-th file operation in the folder (a file
    opened for writing, a rename, a removal, a folder made); what it left is copied to `<root>/killed_<k>`,
    and the earlier files are put back. Ends with the write done whole (`<root>/whole`); the earlier files
    are in `<root>/earlier`."""
    import signal
    import sys

    torch.set_num_threads(1)  # no OpenMP pool to inherit across fork
    write = write_earlier_and_new(kind, root, model_dir)
    folder = os.path.join(root, "folder")
    shutil.copytree(folder, os.path.join(root, "earlier"))
    operations = {"open", "os.rename", "os.replace", "os.remove", "os.rmdir", "shutil.rmtree", "os.mkdir"}
    for k in range(1, 200):
        child = os.fork()
        if child == 0:
            seen = 0

            def kill_at_k(event: str, args: tuple, k: int = k) -> None:
                nonlocal seen
                if event not in operations or not isinstance(args[0], str | bytes):
                    return
                if event == "open" and args[1] is not None and not any(c in args[1] for c in "wax+"):
                    return  # a read
                if event == "open" and args[1] is None and not args[2] & (os.O_WRONLY | os.O_RDWR):
                    return
                if os.path.abspath(os.fsdecode(args[0])).startswith(root):
                    seen += 1
                    if seen == k:
                        os.kill(os.getpid(), signal.SIGKILL)

            sys.addaudithook(kill_at_k)
            write()
            os._exit(0)
        _, status = os.waitpid(child, 0)
        if not os.WIFSIGNALED(status):  # the write had fewer operations than k: it ran whole
            os.rename(folder, os.path.join(root, "whole"))
            return
        shutil.copytree(folder, os.path.join(root, f"killed_{k}"))
        shutil.rmtree(folder)
        shutil.copytree(os.path.join(root, "earlier"), folder)
    raise AssertionError("the write never ended")


def outputs_of(folder) -> dict[str, bytes]:
    """`files_of` without what a killed writer may leave beside the outputs: its hidden temporary file or
    folder (`.<name>.*partial*`) and its lock, which the next writer takes over."""
    return {
        path: content
        for path, content in files_of(folder).items()
        if not any(part.startswith(".") and "partial" in part for part in path.split(os.sep))
        and not path.endswith(".lock")
    }


KILLED_WRITES = ("checkpoint", "export", "results")


@pytest.fixture(scope="module")
def killed_writes(tiny_model_dir, tmp_path_factory) -> str:
    """`kill_at_every_step` for each of `KILLED_WRITES` (all written through `io.files`), in one process (its
    imports cost more than the writes): the folder holding each one's `<kind>/` folder."""
    root = str(tmp_path_factory.mktemp("killed"))
    code = (
        "import sys; from tests.test_bad_input_kills import KILLED_WRITES, kill_at_every_step as k; "
        "[k(kind, f'{sys.argv[1]}/{kind}', sys.argv[2]) for kind in KILLED_WRITES]"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, root, tiny_model_dir],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return root


@pytest.mark.parametrize("kind", KILLED_WRITES)
def test_a_kill_at_any_moment_leaves_every_earlier_file_whole(killed_writes, kind):
    tmp_path = Path(killed_writes) / kind
    earlier, whole = files_of(tmp_path / "earlier"), files_of(tmp_path / "whole")
    changed = {path for path in earlier.keys() | whole.keys() if earlier.get(path) != whole.get(path)}
    assert changed and "notes.txt" not in changed
    kills = sorted(tmp_path.glob("killed_*"))
    assert len(kills) >= 2  # at least the temporary file's writing and its rename
    for killed in kills:  # each file as it was, or the write's whole result: never a part, never a mix
        assert outputs_of(killed) in (earlier, whole), f"{killed.name}: {sorted(outputs_of(killed))}"


def test_a_second_writer_to_one_place_is_refused_naming_the_first(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    other = subprocess.Popen(["sleep", "60"])  # another run, alive on this host, holding both outputs
    try:
        results, out = tmp_path / "val.jsonl", tmp_path / "export"
        for path in (results, out):
            Path(f"{path}.lock").write_text(
                f"process {other.pid} on {socket.gethostname()}: cli.py validate\n"
            )
        with pytest.raises(ValueError) as error:
            ValidationResultsWriter(str(results)).setup(quiet_trainer(), None, "validate")
        assert str(error.value) == (
            f"results.path {results} is being written by another run (process {other.pid} on "
            f"{socket.gethostname()}: cli.py validate; lock {results}.lock): wait for it to end, or choose "
            "another path"
        )
        model, tokenizer = (
            AutoModelForCausalLM.from_pretrained(tiny_model_dir),
            AutoTokenizer.from_pretrained(tiny_model_dir),
        )
        with pytest.raises(
            ValueError, match=f"export folder {out} is being written by another run \\(process"
        ):
            export_policy(model, str(out), tokenizer=tokenizer)
        assert sorted(os.listdir(tmp_path)) == ["export.lock", "val.jsonl.lock"]  # nothing written
    finally:
        other.kill()
        other.wait()
    # Its holder gone (a killed run): the lock is taken over, and let go after the write.
    writer = ValidationResultsWriter(str(results))
    writer.setup(quiet_trainer(), None, "validate")
    assert Path(f"{results}.lock").read_text().startswith(f"process {os.getpid()} on ")
    writer.teardown(quiet_trainer(), None, "validate")
    export_policy(model, str(out), tokenizer=tokenizer)
    assert sorted(os.listdir(tmp_path)) == ["export"]


def test_a_lock_whose_holder_is_gone_is_taken_over_in_one_line_and_a_live_ones_refused(tmp_path, monkeypatch):
    """A full disk while taking the lock leaves none; a lock that names no holder (an earlier full disk),
    names a process gone or this process's id (a requeued job), or an id now another process's, is taken
    over with one warning; a live holder, one on another host and a file no run wrote are refused."""
    results = tmp_path / "val.jsonl"
    lock = Path(f"{results}.lock")

    def take() -> None:
        writer = ValidationResultsWriter(str(results))
        writer.setup(quiet_trainer(), None, "validate")
        assert lock.read_text().startswith(f"process {os.getpid()} on {socket.gethostname()}: ")
        writer.teardown(quiet_trainer(), None, "validate")
        assert not lock.exists()

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as patch:
        patch.setattr(os, "fsync", no_space)
        with pytest.raises(ValueError) as error:
            ValidationResultsWriter(str(results)).setup(quiet_trainer(), None, "validate")
    assert str(error.value) == (
        f"results.path {results}: cannot write its lock {lock} (No space left on device); nothing written: "
        "free some space and run again"
    )
    assert os.listdir(tmp_path) == []

    host = socket.gethostname()
    dead = subprocess.Popen(["true"])
    dead.wait()
    live = subprocess.Popen(["sleep", "60"])
    try:
        with open(f"/proc/{live.pid}/stat") as f:
            live_start = f.read().rpartition(")")[2].split()[19]
        old = 1_000_000_000  # a lock written long ago
        gone = {
            "": ("names no holder \\('': its writing failed", old),
            "\x00" * 64: ("names no holder", old),
            "process 12": ("names no holder \\('process 12'", old),
            f"process {dead.pid} on {host}: cli.py validate\n": (
                f"process {dead.pid} on {host}: .* no longer runs",
                None,
            ),
            f"process {os.getpid()} on {host}: cli.py validate\n": ("its process id is this process's", None),
            f"process {live.pid} on {host}: cli.py validate\nstarted 1\n": (
                f"process {live.pid} is another process",
                None,
            ),
        }
        for content, (why, mtime) in gone.items():
            lock.write_text(content)
            if mtime:
                os.utime(lock, (mtime, mtime))
            with pytest.warns(
                UserWarning, match=f"^results.path {results}: took over its lock {lock}: .*{why}"
            ) as said:
                take()
            assert len([w for w in said if "took over" in str(w.message)]) == 1
        refused = "is being written by another run"
        held = {
            f"process {live.pid} on {host}: cli.py validate\nstarted {live_start}\n": refused,
            f"process {live.pid} on {host}: cli.py validate\n": refused,
            "": f"{refused} \\(its lock .* was made a moment ago\\)",
            f"process 1 on other-{host}: fit\n": f"{refused} .*if it no longer runs on that host, remove",
            "my notes\n": f"its lock {lock} holds 'my notes', not a lock that grpo-lightning writes: remove",
        }
        for content, why in held.items():
            lock.write_text(content)
            with pytest.raises(ValueError, match=f"results.path {results}:? {why}"):
                ValidationResultsWriter(str(results)).setup(quiet_trainer(), None, "validate")
            assert lock.read_text() == content  # left as it was
    finally:
        live.kill()
        live.wait()
    lock.unlink()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("kind", ["export", "results"])
def test_the_next_writer_removes_what_a_killed_one_left(killed_writes, tmp_path, kind):
    """Each moment a kill can leave (a staging folder holding a whole model, a temporary file, a lock): the
    next writer of that path takes its lock over, removes the rest, said, and finds the outputs whole."""
    target = {"export": "export", "results": "val.jsonl"}[kind]
    kills = sorted((Path(killed_writes) / kind).glob("killed_*"))
    left = 0
    for killed in kills:
        folder = tmp_path / killed.name
        shutil.copytree(killed, folder)
        lock = folder / f"{target}.lock"
        if lock.exists():
            os.utime(lock, (1, 1))  # its holder, the killed child, is gone; an empty lock is old
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            with OutputLock(str(folder / target), "export folder" if kind == "export" else "results.path"):
                pass
        left += any("left by a killed run" in str(w.message) for w in said)
        assert files_of(folder) == outputs_of(killed), killed.name  # nothing partial left, nothing else gone
    assert left >= 1  # some kill left a staging folder or a temporary file, and it went


def test_an_earlier_export_moved_aside_by_a_killed_swap_is_put_back(tmp_path):
    """Where folders cannot be swapped in one step, `replace_folder` moves the earlier one aside first: a
    kill between its two renames leaves it there, and the next writer puts it back."""
    aside = tmp_path / ".export.partial-abc123.replaced"
    aside.mkdir()
    (aside / "model.safetensors").write_text("the earlier export")
    (tmp_path / ".export.partial-abc123").mkdir()  # the new one, not swapped in
    (tmp_path / ".export.jsonl.x1.partial").write_text("another output's, not this one's")
    assert remove_leftovers(str(tmp_path / "export")) == [str(tmp_path / ".export.partial-abc123")]
    assert sorted(os.listdir(tmp_path)) == [".export.jsonl.x1.partial", "export"]
    assert (tmp_path / "export" / "model.safetensors").read_text() == "the earlier export"


def test_a_full_disk_is_one_line_and_keeps_the_earlier_export_and_results(
    tiny_model_dir, tmp_path, monkeypatch
):
    from transformers import AutoTokenizer

    model, tokenizer = (
        AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        AutoTokenizer.from_pretrained(tiny_model_dir),
    )
    out, results = tmp_path / "export", tmp_path / "val.jsonl"
    export_policy(model, str(out), tokenizer=tokenizer)
    write_results(str(results), [{"set": None, "sample": 0, "completion": "4", "correct": True}])
    earlier = files_of(tmp_path)

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(type(tokenizer), "save_pretrained", no_space)  # the export's second half
    with pytest.raises(OSError) as error:
        export_policy(model, str(out), tokenizer=tokenizer, overwrite=True)
    assert error.value.errno == errno.ENOSPC
    assert str(error.value) == (
        f"[Errno 28] could not write the export {out} (No space left on device); the earlier folder is kept"
    )
    monkeypatch.setattr(os, "fsync", no_space)  # the results file written, not yet on disk
    with pytest.raises(OSError) as error:
        write_results(str(results), [{"set": None, "sample": 1, "completion": "5", "correct": False}])
    assert str(error.value) == (
        f"[Errno 28] could not write the results file {results} (No space left on device); the earlier file "
        "is kept"
    )
    assert files_of(tmp_path) == earlier  # byte for byte, and no temporary file or folder left
