"""A resumed run keeps the README's promise: data options that change what is trained on (source, sizes,
batch size, seed, columns, prompt, the data module's class) are refused by `cli.py fit`, naming them, unless
`--new_data true` asks to continue the weights on this data from its beginning; from Python they are
warned about. What the user typed counts, also at an option's default, and the options that leave the
training stream alone (the pre-flight, logging, validation) change on resume."""

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
from grpo_lightning.cli.resume import is_typed, typed_options
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


def test_data_options_left_out_on_resume_are_the_checkpoints(tiny_model_dir, checkpoint, tmp_path, capsys):
    """Left out, a data option is the checkpoint's (its source, prompt, batch size, held-out rows), not its
    default; given, also at its default, it is the user's, compared with the checkpoint's."""
    args = fit_args(tiny_model_dir, str(tmp_path), 2, f"--ckpt_path={checkpoint}")
    args = [a for a in args if not a.startswith("--data.")]
    err = cli_error([*args, "--data.val_size=64"], capsys)  # the default; the checkpoint's is 2
    assert one_error_line(err).startswith(
        f"error: --ckpt_path {checkpoint} was trained on other data (data.val_size: checkpoint 2, this run "
        "64). A resumed run"
    )
    cli = build_cli(args)
    data = cli.datamodule.hparams
    assert (data.source, data.system_prompt, data.batch_size, data.val_size) == ("arithmetic", None, 2, 2)
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


# The checkpoint's max_completion_length is 6; 256 is the option's default.
TYPED_AT_THE_DEFAULT = {
    "flat name": ["--model.grpo.max_completion_length=256"],
    "section key, value apart": ["--model.grpo.sampling.max_completion_length", "256"],
    "section as a mapping": ["--model.grpo.sampling={max_completion_length: 256}"],
    "config file, flat": ["--config", "model: {grpo: {max_completion_length: 256}}"],
    "config file, sectioned": ["--config", "model: {grpo: {sampling: {max_completion_length: 256}}}"],
}


@pytest.mark.parametrize("typed", TYPED_AT_THE_DEFAULT.values(), ids=TYPED_AT_THE_DEFAULT)
@pytest.mark.usefixtures("no_weights")
def test_an_option_typed_at_its_default_is_typed_on_resume(
    tiny_model_dir, checkpoint, tmp_path, capsys, typed
):
    """What the user typed counts, on the command line or in a config file, even where it equals the
    option's default: `fit` refuses it when it is not the checkpoint's, before any weights load."""
    if typed[0] == "--config":
        (tmp_path / "typed.yaml").write_text(typed[1])
        typed = ["--config", str(tmp_path / "typed.yaml")]
    args = [
        a
        for a in fit_args(tiny_model_dir, str(tmp_path), 2, f"--ckpt_path={checkpoint}")
        if "length" not in a
    ]
    err = cli_error([*args, *typed], capsys)
    assert one_error_line(err).startswith(
        f"error: --ckpt_path {checkpoint} was trained with other options (model.grpo.sampling."
        "max_completion_length: checkpoint 6, this run 256). A checkpoint's options win on resume"
    )
    assert not os.path.exists(tmp_path / "lightning_logs")


def test_options_that_leave_the_training_stream_alone_change_on_resume(tiny_model_dir, checkpoint, tmp_path):
    """The pre-flight, the completions panels and the validation's samples per problem change nothing the
    run trains on: a resumed `fit` takes them as typed (the pre-flight's `true` is its default, the
    checkpoint's `false`), and says so; an option left out still takes the checkpoint's value."""
    kept = fit_args(tiny_model_dir, str(tmp_path), 2, f"--ckpt_path={checkpoint}")
    kept = [a for a in kept if "preflight" not in a and "num_generations=" not in a]
    typed = [
        "--model.grpo.preflight=true",
        "--model.grpo.run.log_completions_every=1",
        "--model.num_generations_eval=2",
    ]
    wins = "model.grpo.run.log_completions_every=1 from this run's config wins over the checkpoint's 50"
    with pytest.warns(UserWarning, match=wins) as caught:
        cli = build_cli([*kept, *typed])
    said = " ".join(str(w.message) for w in caught)
    assert "model.grpo.run.preflight=True from this run's config wins over the checkpoint's False" in said
    assert "model.num_generations_eval=2 from this run's config wins over the checkpoint's 1" in said
    run = cli.model.grpo.run
    assert (run.preflight, run.log_completions_every, cli.model.validation.num_generations) == (True, 1, 2)
    assert cli.model.grpo.sampling.num_generations == 2  # left out: the checkpoint's, not the default 8
    callbacks = {type(c).__name__: c for c in cli.trainer.callbacks}
    assert "Preflight" in callbacks and callbacks["CompletionsPanel"].every_n_steps == 1
    assert cli.trainer.global_step == 2


def test_validate_takes_an_evaluation_option_typed_at_its_default(tiny_model_dir, checkpoint, tmp_path):
    """`validate --model.grpo.max_completion_length 256` (the default) evaluates 256 tokens, not the
    checkpoint's 6."""
    args = ["validate", *fit_args(tiny_model_dir, str(tmp_path), 1)[1:], f"--ckpt_path={checkpoint}"]
    args = [a.replace("limit_val_batches=0", "limit_val_batches=1") for a in args if "length" not in a]
    with pytest.warns(
        UserWarning, match="max_completion_length=256 from this run's config wins over the checkpoint's 6"
    ):
        cli = build_cli([*args, "--model.grpo.max_completion_length", "256"])
    assert cli.model.grpo.sampling.max_completion_length == 256
    assert "val/accuracy" in cli.trainer.callback_metrics


def test_only_the_options_declared_so_are_free_to_change_on_resume():
    """`RunOptions` declares that it leaves the training stream alone; every other section changes it. From
    Python, the module's options win on resume, said for those that change the run alone."""
    free = {entry.key for entry in FLAT_NAMES.values() if free_on_resume(f"grpo.{entry.key}")}
    assert free == {"run.cpu_offload", "run.log_completions_every", "run.logging_first_step", "run.preflight"}
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


def test_a_run_resumes_from_its_own_saved_config(checkpoint, tmp_path, recwarn):
    """The config a run saved gives every option, each the checkpoint's: nothing refused, nothing said."""
    saved = Path(checkpoint).parent / "config.yaml"
    args = ["fit", "--config", str(saved), f"--ckpt_path={checkpoint}", "--trainer.max_steps=2"]
    cli = build_cli([*args, f"--trainer.default_root_dir={tmp_path}"])
    assert cli.trainer.global_step == 2
    said = [str(w.message) for w in recwarn]
    assert not [m for m in said if "wins over the checkpoint" in m or "trained with other options" in m]


def test_typed_options_name_each_value_given_and_a_section_given_empty():
    """`cli_resume.typed_options` of a config parsed without defaults: every value typed (at its default
    too), a section given empty (on with its defaults) by its own name; `is_typed` sees an option inside."""
    given = {"grpo": {"run": {"preflight": True}, "dynamic_sampling": {}}, "lora": None, "_private": 1}
    typed = typed_options(given)
    assert typed == {"grpo.run.preflight", "grpo.dynamic_sampling", "lora"}
    assert is_typed("grpo.run", typed) and is_typed("grpo.dynamic_sampling", typed)
    assert not is_typed("grpo.kl", typed) and not is_typed("grpo.run.log_completions_every", typed)


@pytest.mark.parametrize(
    "functions",
    [
        "--model.tools=[grpo_lightning.core.tools.calculator.calculator]",
        "--model.environment_factory=tests.test_tool_rollouts.Bank",
    ],
)
def test_a_multi_turn_run_resumes_from_its_saved_config(tiny_model_dir, tmp_path, functions, recwarn):
    """A run made with tools (or an environment class) resumes by the documented command, `fit --config
    <run>/config.yaml --ckpt_path last`: the checkpoint stores each by its import path, the config parses
    it to the function itself, and the two are compared as what they name."""
    build_cli(fit_args(tiny_model_dir, str(tmp_path), 1, functions, "--trainer.logger.version=tools"))
    saved = tmp_path / "lightning_logs" / "tools" / "config.yaml"
    cli = build_cli(["fit", "--config", str(saved), "--ckpt_path=last", "--trainer.max_steps=2"])
    assert cli.trainer.global_step == 2 and cli.model.rollouts.multi_turn is not None
    said = [str(w.message) for w in recwarn]
    assert not [m for m in said if "wins over the checkpoint" in m or "trained with other options" in m]
