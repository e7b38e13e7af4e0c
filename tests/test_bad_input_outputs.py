"""Nothing a user keeps is ever destroyed: exports replace only an earlier export (`--overwrite`), results
files only earlier results (`--results.overwrite`), checkpoints never land over another file, and the
scripts' outputs (`demo.outputs`) never replace an earlier run's silently. The data-safety test gives a
folder holding a model, checkpoints and a user's file as every output path of every command that writes."""

import errno
import json
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from transformers import AutoModelForCausalLM

from grpo_lightning.cli import build_cli
from grpo_lightning.cli import main as cli_main
from grpo_lightning.core.rewards.verifiable import reference_answer
from grpo_lightning.demo.curves import write_curves
from grpo_lightning.io import files as files_module
from grpo_lightning.io.export import EXPORT_MARKER, check_export_folder, export_policy
from grpo_lightning.io.models import LoraOptions
from grpo_lightning.training.callbacks.export_best import ExportBestCallback
from grpo_lightning.training.callbacks.interrupt_checkpoint import InterruptCheckpoint
from grpo_lightning.training.callbacks.results_writer import (
    ValidationResultsWriter,
    check_results_path,
    write_results,
)
from grpo_lightning.training.data import GSM8KDataModule
from grpo_lightning.training.module import GRPOModule
from tests.helpers import (
    cli_error,
    copy_model,
    digit_reward,
    files_of,
    one_error_line,
    quiet_trainer,
    tiny_module,
    write_rows,
)
from tests.test_heldout import load_script
from tests.test_interrupt import fit_args


# ------------------------------------------------------------------------------------------ exports
def test_export_replaces_only_an_earlier_export_whole_and_only_when_asked(tiny_model_dir, tmp_path):
    module = GRPOModule(tiny_model_dir)
    clean = export_policy(module, str(tmp_path / "clean"))
    assert json.load(open(os.path.join(clean, EXPORT_MARKER)))["files"] == sorted(
        set(os.listdir(clean)) - {EXPORT_MARKER}
    )
    out = str(tmp_path / "out")
    lora = GRPOModule(tiny_model_dir, lora=LoraOptions(r=2, alpha=4))
    export_policy(lora, out, merge_lora=False)  # an earlier export: an adapter
    earlier = files_of(out)
    with pytest.raises(
        ValueError, match=f"export folder '{out}' holds an earlier export: .*--overwrite true"
    ):
        export_policy(module, out)
    with open(os.path.join(out, "notes.txt"), "w") as f:
        f.write("mine")  # a user's file beside the earlier export: never replaced, even when asked
    with pytest.raises(ValueError, match=r"holds \['notes.txt'\], which its earlier export did not write"):
        export_policy(module, out, overwrite=True)
    assert files_of(out) == {**earlier, "notes.txt": b"mine"}

    os.remove(os.path.join(out, "notes.txt"))
    export_policy(module, out, overwrite=True)
    assert sorted(os.listdir(out)) == sorted(os.listdir(clean))  # whole: no stale adapter left
    assert sorted(os.listdir(tmp_path)) == ["clean", "out"]  # no staging folder left beside it
    ids = torch.tensor([[5, 6, 7]])
    logits = [AutoModelForCausalLM.from_pretrained(d)(ids).logits for d in (clean, out)]
    assert torch.equal(*logits)


def test_a_failed_export_leaves_the_folder_as_it_was(tiny_model_dir, tmp_path, monkeypatch):
    module = GRPOModule(tiny_model_dir)
    out = export_policy(module, str(tmp_path / "out"))
    before = files_of(out)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(module.tokenizer, "save_pretrained", disk_full)
    with pytest.raises(OSError, match="No space left"):
        export_policy(module, out, overwrite=True)
    assert files_of(out) == before
    assert os.listdir(tmp_path) == ["out"]


@pytest.fixture(scope="module")
def an_export(tiny_model_dir, tmp_path_factory) -> str:
    return export_policy(GRPOModule(tiny_model_dir), str(tmp_path_factory.mktemp("export") / "export"))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    kept=st.sets(
        st.sampled_from(["a model", "a user's file", "a checkpoint", "an empty folder"]), min_size=1
    ),
    earlier_export=st.booleans(),
    target=st.sampled_from(["root", "model", "above", "notes.txt", "export", "new"]),
    overwrite=st.booleans(),
)
def test_overwrite_never_replaces_what_an_export_did_not_write(
    tiny_model_dir, an_export, tmp_path_factory, monkeypatch, kept, earlier_export, target, overwrite
):
    """Whatever a folder holds beside an earlier export (a model, a user's file, a checkpoint, a folder),
    an export may replace only a path that does not exist yet (and is not the policy's), or the earlier
    export itself when asked."""
    root = tmp_path_factory.mktemp("kept")
    make = {
        "a model": lambda: copy_model(tiny_model_dir, root / "model"),
        "a user's file": lambda: (root / "notes.txt").write_text("mine"),
        "a checkpoint": lambda: (root / "run.ckpt").write_bytes(b"ckpt"),
        "an empty folder": lambda: (root / "empty").mkdir(),
    }
    for what in kept:
        make[what]()
    if earlier_export:
        shutil.copytree(an_export, root / "export")
    monkeypatch.chdir(root)  # the working directory is never replaced either
    out = {"root": root, "above": root.parent}.get(target, root / target)
    before = files_of(root)
    protected = {"the folder the policy was loaded from": str(root / "model")}
    try:
        check_export_folder(str(out), overwrite, protected)
    except ValueError as err:
        assert str(err).startswith(f"export folder '{out}' ")
        accepted = False
    else:
        accepted = True
    # The policy's folder is refused even where it is not made yet (as a run's checkpoints to come are).
    assert accepted == ((not out.exists() and target != "model") or (target == "export" and overwrite))
    assert files_of(root) == before


def test_export_into_the_policy_folder_is_refused_even_with_overwrite(tiny_model_dir, tmp_path):
    folder = copy_model(tiny_model_dir, tmp_path / "policy")
    before = files_of(folder)
    with pytest.raises(ValueError, match="is the folder the policy was loaded from"):
        export_policy(GRPOModule(folder), folder + "/", overwrite=True)
    assert files_of(folder) == before


def test_cli_export_refuses_a_folder_no_export_wrote_and_names_a_model_folder_given_as_checkpoint(
    tiny_model_dir, good_checkpoint, tmp_path, capsys
):
    ckpt = tmp_path / "run.ckpt"
    ckpt.write_bytes(good_checkpoint)
    out = tmp_path / "export"
    out.mkdir()
    (out / "adapter_config.json").write_text("{}")
    args = ["export", *fit_args(tiny_model_dir, str(tmp_path), 1)[1:], f"--out={out}"]
    err = cli_error([*args, f"--ckpt_path={ckpt}", "--overwrite=true"], capsys)
    assert one_error_line(err) == (
        f"error: export folder '{out}' holds ['adapter_config.json'] and no earlier export wrote it (it has "
        f"no {EXPORT_MARKER}): choose another folder; --overwrite replaces only an earlier export"
    )
    assert os.listdir(out) == ["adapter_config.json"]
    err = cli_error([*args, f"--ckpt_path={out}", "--overwrite=true"], capsys)
    assert f"error: checkpoint '{out}' is a model folder (save_pretrained, as export writes), not a " in err


def test_export_best_callback_checks_its_folder_before_training(tiny_model_dir, tmp_path):
    out = tmp_path / "export"
    out.mkdir()
    (out / "model.safetensors").write_text("an earlier run's, not marked as an export")
    trainer = quiet_trainer(default_root_dir=str(tmp_path / "run"))
    module = GRPOModule(copy_model(tiny_model_dir, tmp_path / "base" / "policy"))
    for overwrite in (False, True):
        with pytest.raises(ValueError, match=f"export folder '{out}' holds .* no earlier export wrote it"):
            ExportBestCallback(str(out), overwrite=overwrite).setup(trainer, module, "fit")
    # The policy's own folder, the folder above it, this run's checkpoints: named, before any weights load.
    for folder, what in [
        (tmp_path / "base" / "policy", "is the folder the policy was loaded from"),
        (tmp_path / "base", "holds the folder the policy was loaded from"),
        (tmp_path / "run", "holds this run's checkpoints"),  # to come: the folder does not exist yet
    ]:
        with pytest.raises(ValueError, match=f"export folder '{folder}' {what}"):
            ExportBestCallback(str(folder), overwrite=True).setup(trainer, module, "fit")
    assert module.policy is None
    ExportBestCallback(str(tmp_path / "new")).setup(trainer, module, "fit")


# ------------------------------------------------------------------------------------------ results files
def test_results_path_is_checked_before_validation_and_replaces_only_earlier_results(tmp_path):
    trainer = quiet_trainer()
    user_file = tmp_path / "notes.jsonl"
    user_file.write_text('{"mine": 1}\n')
    earlier = tmp_path / "val.jsonl"
    earlier.write_text('{"set": null, "sample": 0, "completion": "4", "extracted": "4", "correct": true}\n')
    refused = {
        str(tmp_path): "is a folder",
        str(user_file / "val.jsonl"): f"{user_file} is a file, not a folder",
        str(user_file): "holds a file that is not a validation results file",
        str(earlier): "holds the results of an earlier validation: .* --results.overwrite true",
    }
    for path, why in refused.items():
        with pytest.raises(ValueError, match=f"results.path='{path}'.*{why}"):
            ValidationResultsWriter(path).setup(trainer, None, "validate")
    with pytest.raises(ValueError, match="not a validation results file"):
        ValidationResultsWriter(str(user_file), overwrite=True).setup(trainer, None, "validate")
    ValidationResultsWriter(str(earlier), overwrite=True).setup(trainer, None, "validate")
    assert user_file.read_text() == '{"mine": 1}\n'


def test_validate_results_work_for_trl_format_columns(tiny_model_dir, tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"{n} + 1?"}], "answer": n + 1} for n in range(6)]
    source = write_rows(tmp_path / "rows.jsonl", rows)
    results = tmp_path / "val.jsonl"
    args = fit_args(tiny_model_dir, str(tmp_path), 1, "--data=grpo_lightning.training.data.PromptDataModule")
    build_cli(
        [
            "validate",
            *args[1:],
            f"--data.source={source}",
            "--data.val_size=3",
            "--trainer.limit_val_batches=1.0",
            f"--results.path={results}",
        ]
    )
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    assert len(lines) == 3
    for line in lines:
        assert set(line) == {"set", "prompt", "sample", "completion", "extracted", "answer", "correct"}
        assert line["set"] is None  # the data module's own rows
        assert line["answer"] == reference_answer(int(line["prompt"][0]["content"].split()[0]) + 1)
        assert line["correct"] == (line["extracted"] == line["answer"])


def test_results_never_replace_the_data_they_came_from_and_keep_its_columns(
    tiny_model_dir, tmp_path, capsys, caplog, monkeypatch
):
    """Rows that look like results (their own `completion`, `sample`, `set`): the data file is never
    replaced, whatever path names it; the columns are kept as `data.<name>` beside the model's; a link is
    written through, a stream as it is."""
    chat = [{"role": "user", "content": "2 + 3?"}]
    rows = [
        {"prompt": chat, "answer": 5, "set": "a", "sample": n, "completion": f"#### {n}"} for n in range(6)
    ]
    source = write_rows(tmp_path / "rows.jsonl", rows)
    data = open(source, "rb").read()
    args = fit_args(tiny_model_dir, str(tmp_path), 1, "--data=grpo_lightning.training.data.PromptDataModule")
    args = [*args[1:], f"--data.source={source}", "--data.val_size=2", "--trainer.limit_val_batches=1.0"]
    with monkeypatch.context() as patch:  # refused before any weights load
        patch.setattr("grpo_lightning.training.module.load_model", lambda *a, **k: 1 / 0)
        for command in ("validate", "predict"):
            err = cli_error([command, *args, f"--results.path={source}", "--results.overwrite=true"], capsys)
            assert one_error_line(err) == (
                f"error: results.path='{source}' is the data source ({source}): the results would replace "
                "it; choose another path"
            )
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    os.symlink(source, "link.jsonl")
    os.link(source, "hard.jsonl")
    (tmp_path / "folder").mkdir()
    shutil.copy(source, tmp_path / "folder" / "train.jsonl")
    inputs = {"the data source": "rows.jsonl", "validation set 'math''s source": str(tmp_path / "folder")}
    for path, why in [
        ("link.jsonl", "is the data source"),
        ("hard.jsonl", "is the data source"),
        ("sub/../rows.jsonl", "is the data source"),
        ("folder/val.jsonl", "lies inside validation set 'math''s source"),
    ]:
        with pytest.raises(ValueError, match=f"results.path='{path}' {why}"):
            check_results_path(path, True, inputs)
    with pytest.raises(ValueError, match="holds a file that is not a validation results file"):
        check_results_path("folder/train.jsonl", True)  # not an input here: rows all the same, not results
    assert open(source, "rb").read() == data and os.path.islink("link.jsonl")

    results = tmp_path / "val.jsonl"
    for _ in range(2):  # the second replaces the first's results
        build_cli(["validate", *args, f"--results.path={results}", "--results.overwrite=true"])
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    assert (
        "the data's 'set' as 'data.set'; the data's 'sample' as 'data.sample'; the data's 'completion' as"
        in (caplog.text)
    )
    assert len(lines) == 2
    for line in lines:
        assert line["set"] is None and line["sample"] == 0 and line["data.set"] == "a"
        assert line["data.completion"] == f"#### {line['data.sample']}"  # the data's, beside the model's
    assert open(source, "rb").read() == data

    # Through a link: the file it points to is replaced, the link kept; a stream is written as it is.
    earlier = results.read_text()
    os.symlink(results, "to_results.jsonl")
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    os.symlink("/dev/null", "to_null.jsonl")
    record = [{"set": None, "sample": 0, "completion": "4", "extracted": "4", "correct": None}]
    for path in ("to_results.jsonl", "to_null.jsonl", str(fifo)):
        writer = ValidationResultsWriter(path, overwrite=True)
        writer.setup(quiet_trainer(), None, "validate")
        read = subprocess.Popen(["cat", str(fifo)], stdout=subprocess.PIPE) if path == str(fifo) else None
        write_results(path, record)
        writer.teardown(quiet_trainer(), None, "validate")
        if read is not None:
            assert json.loads(read.communicate(timeout=10)[0]) == record[0]
    assert os.path.islink("to_results.jsonl") and os.path.islink("to_null.jsonl")
    assert json.loads(results.read_text()) == record[0] and earlier != results.read_text()
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and not os.path.exists("/dev/null.lock")


# ------------------------------------------------------------------------------------------ checkpoints
def test_two_runs_without_a_logger_keep_their_own_checkpoints(tiny_model_dir, tmp_path):
    args = [a for a in fit_args(tiny_model_dir, str(tmp_path), 1) if not a.startswith("--trainer.logger")]
    for _ in range(2):
        build_cli([*args, "--trainer.logger=false"])
    folders = sorted(os.listdir(tmp_path / "checkpoints"))
    assert folders == ["version_0", "version_1"]
    for folder in folders:
        files = sorted(os.listdir(tmp_path / "checkpoints" / folder))
        assert files == ["config.yaml", "epoch=0-step=1.ckpt"]


def test_interrupted_checkpoint_goes_where_the_readme_says_and_never_over_a_file(tmp_path):
    callback = InterruptCheckpoint()
    with_logger = quiet_trainer(default_root_dir=str(tmp_path), logger=CSVLogger(str(tmp_path / "logs")))
    assert callback.path(with_logger) == str(
        tmp_path / "logs" / "lightning_logs" / "version_0" / "checkpoints" / "interrupted.ckpt"
    )
    without = quiet_trainer(default_root_dir=str(tmp_path))
    assert callback.path(without) == str(tmp_path / "checkpoints" / "interrupted.ckpt")
    own = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"))
    assert callback.path(quiet_trainer(callbacks=[own], enable_checkpointing=True)) == str(
        tmp_path / "ckpt" / "interrupted.ckpt"
    )
    (tmp_path / "checkpoints").mkdir()
    for taken in ("interrupted.ckpt", "interrupted-v1.ckpt"):
        (tmp_path / "checkpoints" / taken).write_text("another run's")
    assert callback.path(without) == str(tmp_path / "checkpoints" / "interrupted-v2.ckpt")


# ------------------------------------------------------------------------------------------ data safety
@pytest.fixture
def kept_folder(tiny_model_dir, good_checkpoint, tmp_path):
    """A folder holding a model, two checkpoints and a user's file (named as the demo's summary), and its
    files' bytes."""
    folder = tmp_path / "kept"
    copy_model(tiny_model_dir, folder)
    (folder / "last.ckpt").write_bytes(good_checkpoint)
    (folder / "interrupted.ckpt").write_bytes(good_checkpoint)
    (folder / "summary.json").write_text('{"my": "notes"}')
    return folder, files_of(folder)


def survived(kept) -> bool:
    folder, before = kept
    after = files_of(folder)
    return all(after.get(name) == content for name, content in before.items())


class FailsAtStep2:
    """A reward that raises on the second batch it scores: the run stops on an error and writes
    `interrupted.ckpt`."""

    calls = 0

    def __call__(self, completions, **kwargs) -> list[float]:
        FailsAtStep2.calls += 1
        if FailsAtStep2.calls == 2:
            raise ZeroDivisionError("division by zero")
        return [0.0] * len(completions)


def test_fit_writes_beside_what_its_output_folders_hold(kept_folder, capsys):
    folder = str(kept_folder[0])
    FailsAtStep2.calls = 0
    args = fit_args(
        folder,  # the policy: the folder's own model
        folder,  # default_root_dir and the logger's save_dir
        3,
        "--model.reward_funcs=[tests.test_bad_input_outputs.FailsAtStep2]",
        "--trainer.callbacks+=ModelCheckpoint",
        f"--trainer.callbacks.dirpath={folder}",
        "--trainer.callbacks.save_last=true",
        "--trainer.callbacks.every_n_train_steps=1",
    )
    cli_error(args, capsys)  # the reward's error, after step 1's checkpoints and the interrupt checkpoint
    assert survived(kept_folder)
    written = set(os.listdir(folder)) - set(kept_folder[1])
    assert {"last-v1.ckpt", "interrupted-v1.ckpt", "epoch=0-step=1.ckpt"} <= written
    # The folder as the export's or the results file's target: refused before any weights load.
    for callbacks in (
        [ExportBestCallback(folder, overwrite=True)],
        [ValidationResultsWriter(folder)],
        [ValidationResultsWriter(os.path.join(folder, "summary.json"), overwrite=True)],
    ):
        module = tiny_module(folder, reward_funcs=[digit_reward])
        trainer = quiet_trainer(max_steps=1, callbacks=callbacks, default_root_dir=folder)
        with pytest.raises(ValueError, match="export folder|results.path"):
            trainer.fit(module, GSM8KDataModule("arithmetic", None, batch_size=2, val_size=2))
        assert module.policy is None
    assert survived(kept_folder)


def test_validate_and_export_write_beside_what_their_output_paths_hold(kept_folder, capsys):
    folder = str(kept_folder[0])
    args = fit_args(folder, folder, 1, "--trainer.limit_val_batches=1.0")[1:]
    build_cli(["validate", *args, f"--results.path={os.path.join(folder, 'val.jsonl')}"])
    err = cli_error(["validate", *args, f"--results.path={folder}", "--results.overwrite=true"], capsys)
    assert f"error: results.path='{folder}' is a folder" in one_error_line(err)
    for results in (os.path.join(folder, "summary.json"), os.path.join(folder, "config.json")):
        with pytest.raises(ValueError, match="is not a validation results file"):
            ValidationResultsWriter(results, overwrite=True).setup(quiet_trainer(), None, "validate")
    ckpt = os.path.join(folder, "last.ckpt")
    err = cli_error(["export", *args, f"--ckpt_path={ckpt}", f"--out={folder}", "--overwrite=true"], capsys)
    assert one_error_line(err).startswith(f"error: export folder '{folder}' holds the checkpoint exported")
    for out in (os.path.join(folder, "summary.json"), os.path.dirname(folder)):
        with pytest.raises(ValueError, match=f"export folder '{out}' "):
            export_policy(GRPOModule(folder), out, ckpt_path=ckpt, overwrite=True)
    assert survived(kept_folder)


def test_the_scripts_write_beside_what_their_output_paths_hold(kept_folder, tmp_path, capsys):
    folder = str(kept_folder[0])
    demo = load_script("demo", "scripts/demo.py")
    demo.main([*fit_args(folder, folder, 1)[1:], "--threads", str(torch.get_num_threads())])
    summary = json.load(open(os.path.join(folder, "summary-1.json")))  # beside the user's summary.json
    assert summary["written_by"] == "scripts/demo.py" and summary["steps"] == 1
    compare = load_script("compare_options", "benchmarks/compare_options.py")
    config = tmp_path / "config.yaml"
    config.write_text(f"model:\n  policy: {folder}\ndata:\n  source: arithmetic\n")
    for out in (folder, os.path.join(folder, "summary.json"), os.path.join(folder, "last.ckpt")):
        with pytest.raises(ValueError, match=f"--out {out} (is a folder|holds a file that .* did not write)"):
            compare.main(["--config", str(config), "--out", out, "--overwrite", "--variants", "baseline"])
    assert survived(kept_folder)


def test_the_demo_picture_draws_the_evaluations_it_ran_not_a_line_between_them(tmp_path):
    """Two held-out evaluations, at steps 0 and 20, drawn as points with their standard errors: the accuracy
    panel between them stays blank (a line there would read as a measured trajectory)."""
    pytest.importorskip("matplotlib")  # the `[plot]` extra; the suite installs it
    import matplotlib.image

    reward = [(step, 0.5) for step in range(1, 21)]
    run = {"seed": 0, "reward": reward, "accuracy": [(0, 0.2, 0.04), (20, 0.6, 0.05)]}
    path = write_curves(str(tmp_path / "curves.png"), [run])
    assert json.loads((tmp_path / "curves.json").read_text())["runs"][0]["accuracy"][1] == [20, 0.6, 0.05]
    image = matplotlib.image.imread(path)[..., :3]
    bottom = image[image.shape[0] // 2 :]
    red = bottom[..., 0] - bottom[..., 2] > 0.2
    columns = red.any(axis=0).nonzero()[0]
    width = image.shape[1]
    middle = red[:, int(0.35 * width) : int(0.65 * width)]
    assert not middle.any(), "a line joins the two evaluations"
    assert columns.min() < 0.3 * width and columns.max() > 0.7 * width  # both evaluations drawn
    rows = red.any(axis=1).nonzero()[0]
    assert rows.max() - rows.min() > 0.2 * bottom.shape[0]  # 20% to 60% with their error bars


def test_from_trl_never_writes_over_its_recipe_nor_shows_its_token(tmp_path, capsys, monkeypatch):
    """`from-trl --out` naming the recipe itself, by its path, another spelling of it or a link to it, is
    refused even with `--overwrite`, the recipe kept; a `hub_token` is neither printed in the table nor
    written into the config's header."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model_name_or_path: Qwen/Qwen2-0.5B\npush_to_hub: true\nhub_token: hf_SeCrEt42\n")
    before = recipe.read_text()
    (tmp_path / "link.yaml").symlink_to(recipe)
    monkeypatch.chdir(tmp_path)
    for out in (str(recipe), "./recipe.yaml", f"../{tmp_path.name}/recipe.yaml", "link.yaml"):
        err = cli_error(["from-trl", "recipe.yaml", "--out", out, "--overwrite"], capsys)
        assert one_error_line(err) == (
            f"error: from-trl --out {out} is the recipe itself: give the converted config another file"
        )
        assert recipe.read_text() == before
    cli_main(["from-trl", "recipe.yaml", "--out", "config.yaml"])
    printed = capsys.readouterr()
    written = (tmp_path / "config.yaml").read_text()
    assert "hub_token" in printed.out and "hub_token" in written  # its row, its line in the header
    assert "SeCrEt" not in printed.out + printed.err + written


def bind_mounted(target: Path) -> bool:
    """Mount an empty folder of its own at `target` (an empty folder), as a volume mounted for the output;
    False where this process may not mount."""
    source = target.parent / f"{target.name}-volume"
    source.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    return subprocess.run(["mount", "--bind", str(source), str(target)], capture_output=True).returncode == 0


@pytest.mark.parametrize("mount", ["renames refused (EBUSY)", "bind mount"])
def test_an_export_into_an_empty_mount_point_fills_it_and_leaves_no_staging_folder(
    tiny_model_dir, tmp_path, monkeypatch, mount
):
    """An export's folder that cannot be renamed over (an empty mount point: renaming it fails with EBUSY,
    or EXDEV from another filesystem) is filled in place, each file whole; no staging folder is left beside
    it, and a second export (with `overwrite`) replaces the first there."""
    module = GRPOModule(tiny_model_dir)
    clean = export_policy(module, str(tmp_path / "clean"))
    out = tmp_path / "volume"
    out.mkdir()
    mounted = False
    if mount == "bind mount":
        mounted = bind_mounted(out)
        if not mounted:
            pytest.skip("this process may not mount (needs root and mount(8))")
    else:
        rename, moved = os.rename, str(out)

        def refused(source, target, *args, **kwargs):
            if moved in (os.fspath(source), os.fspath(target)):
                raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), source)
            return rename(source, target, *args, **kwargs)

        monkeypatch.setattr(os, "rename", refused)
        monkeypatch.setattr(files_module, "_exchange", lambda a, b: refused(a, b))
    try:
        for overwrite in (False, True):
            export_policy(module, str(out), overwrite=overwrite)
            assert files_of(str(out)) == files_of(clean)
            assert sorted(os.listdir(tmp_path)) == sorted(["clean", "volume", *(["volume-volume"] * mounted)])
    finally:
        if mounted:
            subprocess.run(["umount", str(out)], check=True)
