"""Where outputs land when the path is unusual: through a symbolic link, in a read-only folder, in a Hugging
Face cache. `io.files` writes whole or not at all, `io.export` refuses a folder the model came from, and
`demo.outputs` names the scripts' files; each refusal is one line and leaves every earlier file as it was."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from grpo_lightning.demo.outputs import claim_output, unused_paths, write_json
from grpo_lightning.io.export import export_policy
from grpo_lightning.io.files import OutputLock, replace_folder, write_atomically
from grpo_lightning.training.callbacks.output_lock import HoldsOutputLock
from grpo_lightning.training.module import GRPOModule
from tests.helpers import copy_model
from tests.test_bad_input_outputs import files_of


def test_a_folder_replaced_through_a_link_keeps_the_link_and_replaces_what_it_points_to(tmp_path):
    target = tmp_path / "exports" / "v1"
    target.mkdir(parents=True)
    (target / "old.bin").write_bytes(b"old")
    link = tmp_path / "latest"
    link.symlink_to(target, target_is_directory=True)
    replace_folder(str(link), lambda folder: Path(folder, "new.bin").write_bytes(b"new"))
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert files_of(target) == {"new.bin": b"new"}
    assert sorted(os.listdir(target.parent)) == ["v1"]  # nothing staged left beside it


def test_an_export_through_a_link_to_the_policy_folder_is_refused(tiny_model_dir, tmp_path):
    policy = copy_model(tiny_model_dir, tmp_path / "policy")
    link = tmp_path / "export"
    link.symlink_to(policy, target_is_directory=True)
    before = files_of(policy)
    with pytest.raises(ValueError, match="is the folder the policy was loaded from"):
        export_policy(GRPOModule(str(link.parent / "policy")), str(link), overwrite=True)
    assert files_of(policy) == before and link.is_symlink()


def hub_cache(tiny_model_dir: str, root: Path) -> Path:
    """A model as the Hub's cache holds it: `models--<org>--<name>/snapshots/<revision>/` of links into
    `blobs/`."""
    repo = root / "hub" / "models--org--tiny"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "0123abc"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, name in enumerate(sorted(os.listdir(tiny_model_dir))):
        shutil.copyfile(os.path.join(tiny_model_dir, name), blobs / f"blob{i}")
        (snapshot / name).symlink_to(Path("..", "..", "blobs", f"blob{i}"))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abc")
    return snapshot


def test_an_export_into_the_hub_cache_never_touches_the_cached_model(tiny_model_dir, tmp_path):
    snapshot = hub_cache(tiny_model_dir, tmp_path)
    repo = snapshot.parent.parent
    before = files_of(repo)
    module = GRPOModule(str(snapshot))
    with pytest.raises(ValueError, match="is the folder the policy was loaded from"):
        export_policy(module, str(snapshot), overwrite=True)
    for folder in (repo, snapshot.parent):
        with pytest.raises(ValueError, match="holds the folder the policy was loaded from"):
            export_policy(module, str(folder), overwrite=True)
    with pytest.raises(ValueError, match="holds .* and no earlier export wrote it"):
        export_policy(module, str(repo / "blobs"), overwrite=True)
    assert files_of(repo) == before
    assert all((snapshot / name).is_symlink() for name in os.listdir(snapshot))
    # A new folder inside the cache is a folder like any other: written whole, loadable.
    written = export_policy(module, str(repo.parent / "exported"))
    assert GRPOModule(written).tokenizer.vocab_size == module.tokenizer.vocab_size


@pytest.fixture
def read_only_folder(tmp_path):
    """A folder holding an earlier results file and export, that nothing can write into: its mode 0555,
    and for root, which writes past modes, the immutable attribute (`chattr +i`) as well."""
    folder = tmp_path / "read-only"
    (folder / "export").mkdir(parents=True)
    (folder / "export" / "model.safetensors").write_bytes(b"weights")
    (folder / "results.json").write_text('{"earlier": 1}')
    folder.chmod(0o555)
    immutable = os.geteuid() == 0
    if immutable:
        subprocess.run(["chattr", "+i", str(folder)], check=True)
    try:
        with pytest.raises(PermissionError):
            (folder / "probe").write_text("")
        yield folder
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(folder)], check=True)
        folder.chmod(0o755)


def test_a_read_only_folder_is_one_line_per_write_and_keeps_what_it_holds(read_only_folder):
    folder, denied = read_only_folder, "(Permission denied|Operation not permitted)"
    before = files_of(folder)
    with pytest.raises(
        ValueError, match=f"^export folder {folder}/export: cannot write in {folder} \\({denied}\\)$"
    ):
        OutputLock(str(folder / "export"), "export folder").acquire()
    with pytest.raises(
        OSError,
        match=f"could not write the results file {folder}/results.json \\({denied}\\); the "
        "earlier file is kept$",
    ):
        write_atomically(str(folder / "results.json"), "{}", "the results file")
    with pytest.raises(
        OSError,
        match=f"could not write the export {folder}/export \\({denied}\\); the earlier folder is kept$",
    ):
        replace_folder(str(folder / "export"), lambda staging: None, "the export")
    assert files_of(folder) == before


def test_a_lock_is_let_go_as_often_as_it_is_taken_and_its_folders_go_with_it(tmp_path):
    path = tmp_path / "new" / "deeper" / "results.jsonl"
    lock = OutputLock(str(path), "results.path")
    with lock:
        with OutputLock(str(path), "results.path"):  # the same process again: a callback, then its export
            assert Path(f"{path}.lock").is_file()
        assert Path(f"{path}.lock").is_file()  # still held by the outer one
    assert os.listdir(tmp_path) == []  # the folders made for the lock went with it


def test_the_scripts_number_their_files_together_and_refuse_a_users_file(tmp_path):
    (tmp_path / "summary.json").write_text("{}")
    assert unused_paths(str(tmp_path), ["summary.json", "curves.png"]) == [
        str(tmp_path / "summary-1.json"),
        str(tmp_path / "curves-1.png"),
    ]
    mine = tmp_path / "mine.json"
    write_json(str(mine), {"steps": 3}, "scripts/demo.py")
    claim_output(str(mine), "--out", "scripts/demo.py", overwrite=True)  # its own earlier results
    with pytest.raises(ValueError, match="holds an earlier run's results: choose another --out, or replace"):
        claim_output(str(mine), "--out", "scripts/demo.py")
    with pytest.raises(ValueError, match="holds a file that scripts/demo.py did not write"):
        claim_output(str(tmp_path / "summary.json"), "--out", "scripts/demo.py", overwrite=True)
    write_atomically(str(tmp_path / "summary.json"), b"kept")
    with pytest.raises(ValueError, match=f"{tmp_path / 'summary.json'} is a file, not a folder"):
        claim_output(str(tmp_path / "summary.json" / "out.json"), "--out", "scripts/demo.py")


def test_a_callback_holds_its_lock_until_the_run_ends_or_fails(tmp_path):
    path = str(tmp_path / "val.jsonl")
    for end in ("teardown", "on_exception"):
        callback = HoldsOutputLock()
        callback.hold_lock(path, "results.path")
        assert os.path.isfile(f"{path}.lock")
        getattr(callback, end)(None, None, None)
        assert not os.path.exists(f"{path}.lock"), end

    def refuse() -> None:
        raise ValueError("already there")

    with pytest.raises(ValueError, match="already there"):  # a failed check lets the lock go
        HoldsOutputLock().hold_lock(path, "results.path", check=refuse)
    assert os.listdir(tmp_path) == []
