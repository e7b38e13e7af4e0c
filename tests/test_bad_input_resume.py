"""A resumed run keeps the README's promise: data options that change what is trained on (source, sizes,
batch size, seed, columns, prompt, the data module's class) are refused by `cli.py fit`, naming them, unless
`--new_data true` asks to continue the weights on this data from its beginning; from Python they are
warned about."""

import os
import shutil
import socket
import subprocess
import warnings
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from grpo_lightning.cli import build_cli
from grpo_lightning.core.config import FLAT_NAMES, GRPOConfig
from grpo_lightning.training.data import GSM8KDataModule
from grpo_lightning.training.resume import ResumableSampler
from grpo_lightning.training.training_state import (
    DATA_OPTIONS_FREE_ON_RESUME,
    changed_data_options,
    free_on_resume,
    warn_changed_options,
)
from tests.helpers import cli_error, digit_reward, one_error_line, quiet_trainer, tiny_module
from tests.test_interrupt import FirstBatch, fit_args

SAVED = {
    "_class_path": "grpo_lightning.GSM8KDataModule",
    "source": "arithmetic",
    "system_prompt": None,
    "batch_size": 2,
    "val_size": 2,
    "val_split": "holdout",
    "val_batch_size": 16,
    "train_size": None,
    "arithmetic_size": 2000,
    "question_field": "question",
    "answer_field": "answer",
    "seed": 0,
    "num_workers": 0,
    "config_name": None,
}
OTHER_VALUES = {
    "_class_path": "grpo_lightning.training.data.PromptDataModule",
    "source": "data/gsm8k",
    "system_prompt": "Be brief.",
    "batch_size": 4,
    "val_size": 8,
    "val_split": "test",
    "val_batch_size": 4,
    "train_size": 100,
    "arithmetic_size": 500,
    "question_field": "problem",
    "answer_field": "solution",
    "seed": 1,
    "num_workers": 2,
    "config_name": "main",
}


@given(st.sets(st.sampled_from(sorted(OTHER_VALUES))))
def test_every_data_option_that_changes_the_training_stream_is_named(changed):
    current = {**SAVED, **{key: OTHER_VALUES[key] for key in changed}}
    named = {key for key, _, _ in changed_data_options(SAVED, current)}
    holdout = current["val_split"] == "holdout" or SAVED["val_split"] == "holdout"
    free = set(DATA_OPTIONS_FREE_ON_RESUME) | (set() if holdout else {"val_size"})
    expected = {"data.class_path" if key == "_class_path" else f"data.{key}" for key in changed - free}
    assert named == expected


@pytest.fixture(scope="module")
def checkpoint(tiny_model_dir, tmp_path_factory) -> str:
    """A checkpoint after one step on the arithmetic task, 2 prompts per batch."""
    root = tmp_path_factory.mktemp("run")
    build_cli(fit_args(tiny_model_dir, str(root), 1, "--trainer.logger=false"))
    return str(root / "checkpoints" / "version_0" / "epoch=0-step=1.ckpt")


def test_resuming_on_other_data_is_refused_by_the_cli_unless_asked(
    tiny_model_dir, checkpoint, tmp_path, capsys
):
    args = fit_args(tiny_model_dir, str(tmp_path), 2, f"--ckpt_path={checkpoint}", "--data.batch_size=4")
    err = cli_error([*args, "--data.seed=3"], capsys)
    assert one_error_line(err).startswith(
        f"error: --ckpt_path {checkpoint} was trained on other data (data.batch_size: checkpoint 2, this run "
        "4; data.seed: checkpoint 0, this run 3). A resumed run continues the checkpoint's data where it "
    )
    assert "add --new_data true" in err and not os.path.exists(tmp_path / "lightning_logs")

    # Asked for: the weights and optimizer go on, on this data from its beginning (the epoch's first batch).
    cli = build_cli([*args, "--new_data=true", "--trainer.callbacks+=tests.test_interrupt.FirstBatch"])
    first = next(c for c in cli.trainer.callbacks if isinstance(c, FirstBatch))
    rows = cli.datamodule.train_rows
    order = ResumableSampler(len(rows), seed=0).share(cli.trainer.current_epoch)
    assert first.questions == [rows[i]["question"] for i in order[:4]]
    assert cli.trainer.global_step == 2


def test_resuming_on_other_data_from_python_is_said(tiny_model_dir, checkpoint, tmp_path):
    module = tiny_module(tiny_model_dir, reward_funcs=[digit_reward], max_completion_length=6)
    first = FirstBatch()
    trainer = quiet_trainer(
        max_steps=2, limit_val_batches=0, default_root_dir=str(tmp_path), callbacks=[first]
    )
    data = GSM8KDataModule("arithmetic", None, batch_size=3, val_size=2)
    with pytest.warns(
        UserWarning, match=r"resuming on other data \(data.batch_size: checkpoint 2, this run 3\)"
    ):
        trainer.fit(module, data, ckpt_path=checkpoint, weights_only=True)
    # One step more, on the batch after the checkpoint's one in its data (at this data's batch size).
    order = ResumableSampler(len(data.train_rows), seed=0).share(trainer.current_epoch)
    assert trainer.global_step == 2
    assert first.questions == [data.train_rows[i]["question"] for i in order[3:6]]


def test_only_the_options_declared_so_are_free_to_change_on_resume():
    """`RunOptions` declares that it leaves the training stream alone; every other section changes it. From
    Python, the module's options win on resume, said for those that change the run alone."""
    free = {entry.key for entry in FLAT_NAMES.values() if free_on_resume(f"grpo.{entry.key}")}
    assert free == {"run.cpu_offload", "run.log_completions_every", "run.preflight"}
    assert free_on_resume("grpo.run") and free_on_resume("num_generations_eval")
    assert not free_on_resume("grpo") and not free_on_resume("grpo.sampling") and not free_on_resume("lora")

    saved = {"grpo": asdict(GRPOConfig(num_generations=2)), "num_generations_eval": 1}
    own = GRPOConfig(num_generations=2, preflight=False, log_completions_every=0, cpu_offload=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_changed_options(saved, {"grpo": asdict(own), "num_generations_eval": 4})
    own = replace(own, sampling=replace(own.sampling, num_generations=4))
    with pytest.warns(UserWarning, match="other options, this module's apply") as caught:
        warn_changed_options(saved, {"grpo": asdict(own), "num_generations_eval": 4})
    (message,) = [str(w.message) for w in caught]
    assert message.endswith("apply: grpo.sampling.num_generations: checkpoint 2, this module 4")


def test_a_requeued_run_resumes_its_own_folder_after_a_kill(tiny_model_dir, tmp_path, capsys):
    """A scheduler requeues a killed job with its command unchanged: the logger's version fixed,
    `--ckpt_path last`. Its lock names a process gone (or, in a container, this process's id) and is taken
    over, said; its folder's config is its own. A run that resumes nothing there is still another run."""
    fixed = "--trainer.logger.version=job_7"
    build_cli(fit_args(tiny_model_dir, str(tmp_path), 1, fixed))
    config = tmp_path / "lightning_logs" / "job_7" / "config.yaml"
    lock = Path(f"{config}.lock")
    dead = subprocess.Popen(["true"])
    dead.wait()
    for steps, pid in [(2, dead.pid), (3, os.getpid())]:
        lock.write_text(f"process {pid} on {socket.gethostname()}: cli.py fit {fixed}\n")  # SIGKILL's
        with pytest.warns(UserWarning, match=f"the run's config {config}: took over its lock {lock}: "):
            cli = build_cli(fit_args(tiny_model_dir, str(tmp_path), steps, fixed, "--ckpt_path=last"))
        assert cli.trainer.global_step == steps and not lock.exists()
        assert yaml.safe_load(config.read_text())["trainer"]["max_steps"] == steps
    assert sorted(os.listdir(tmp_path / "lightning_logs")) == ["job_7"]

    before = config.read_text()
    elsewhere = tmp_path / "elsewhere.ckpt"
    shutil.copy(tmp_path / "lightning_logs" / "job_7" / "checkpoints" / "epoch=0-step=3.ckpt", elsewhere)
    for resumed in ([], [f"--ckpt_path={elsewhere}"]):
        err = cli_error(fit_args(tiny_model_dir, str(tmp_path), 4, fixed, *resumed), capsys)
        assert one_error_line(err).startswith(
            f"error: {config} exists: that folder holds another run's config"
        )
    assert config.read_text() == before
