"""Everything that can be checked before the first step is: the folders a fit writes, the metrics its
callbacks monitor, the schedule's length, and the benchmark's flags and runs' options, before any weights
load (a refused run trains nothing and writes nothing)."""

import os
import signal
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.demo.outputs import run_script
from grpo_lightning.training.callbacks.fit_checks import FitChecks
from grpo_lightning.training.data import GSM8KDataModule
from grpo_lightning.training.run_checks import check_monitors, check_run_length, logged_metric_names
from tests.helpers import cli_error, digit_reward, one_error_line, quiet_trainer, tiny_module
from tests.test_heldout import load_script
from tests.test_interrupt import fit_args

COMPARE = load_script("compare_options", "benchmarks/compare_options.py")
DEMO = load_script("demo", "scripts/demo.py")


def fit_refused(module_dir: str, root, callbacks=(), match: str = "", **trainer) -> tuple[bool, int]:
    """A fit with these callbacks and Trainer options stops saying `match`; returns whether the policy's
    weights were loaded and the trainer's step then (a check before the work leaves both untouched)."""
    module = tiny_module(module_dir, reward_funcs=[digit_reward], **trainer.pop("grpo", {}))
    trainer = quiet_trainer(
        default_root_dir=str(root), callbacks=list(callbacks), **{"max_steps": 1, **trainer}
    )
    with pytest.raises(ValueError, match=match):
        trainer.fit(module, GSM8KDataModule("arithmetic", None, batch_size=2, val_size=2))
    return module.policy is not None, trainer.global_step


def test_a_fit_checks_its_folders_monitors_and_length_before_any_weights_load(
    tiny_model_dir, tmp_path, no_weights
):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    assert fit_refused(
        tiny_model_dir,
        tmp_path,
        [ModelCheckpoint(dirpath=str(a_file / "ckpt"))],
        match=rf"ModelCheckpoint\(dirpath='{a_file}/ckpt'\): {a_file} is a file, not a folder",
        enable_checkpointing=True,
    ) == (False, 0)
    assert fit_refused(
        tiny_model_dir,
        tmp_path,
        [ModelCheckpoint(monitor="val/acuracy")],
        match=r"ModelCheckpoint\(monitor='val/acuracy'\): GRPOModule never logs 'val/acuracy'; did you mean "
        r"'val/accuracy'\? it logs val/accuracy, val/accuracy_strict, ",
        enable_checkpointing=True,
    ) == (False, 0)
    assert fit_refused(
        tiny_model_dir, tmp_path, [EarlyStopping("val_accuracy")], match="did you mean 'val/accuracy'"
    ) == (False, 0)
    assert fit_refused(
        tiny_model_dir,
        tmp_path,
        match=r"model.grpo.optimizer.lr_scheduler_type='linear' decays over the run, whose length is unknown",
        max_steps=-1,
        max_epochs=-1,
        grpo={"lr_scheduler_type": "linear"},
    ) == (False, 0)


def test_a_trainers_own_fit_checks_refuse_as_the_modules_do(tiny_model_dir, tmp_path, no_weights):
    """`FitChecks`, one of the module's default callbacks, given to the Trainer instead (the module then adds
    none of its own): the Trainer's refuses the fit before any weights load."""
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    own = [FitChecks(), ModelCheckpoint(dirpath=str(a_file / "ckpt"))]
    refused = fit_refused(
        tiny_model_dir, tmp_path, own, match="is a file, not a folder", enable_checkpointing=True
    )
    assert refused == (False, 0)


def test_runs_that_cannot_do_what_was_asked_are_refused_or_warned_before_any_weights_load(
    tiny_model_dir, tmp_path, capsys, no_weights
):
    with pytest.raises(
        ValueError, match=r"^GRPOConfig.optimizer.learning_rate=0: must be > 0 \(at 0 no weight ever"
    ):
        GRPOConfig(learning_rate=0)
    with pytest.warns(UserWarning, match="importance_sampling_cap=3.0 has no effect without importance_"):
        GRPOConfig(importance_sampling_cap=3.0)
    with pytest.warns(UserWarning, match=r"warmup_steps=10 does not end before the run does \(trainer.max_s"):
        check_run_length(quiet_trainer(max_steps=4), GRPOConfig(warmup_steps=10))
    with pytest.warns(UserWarning, match=r"warmup_steps=4 does not .*, only 75% of it at the last step"):
        check_run_length(quiet_trainer(max_steps=4), GRPOConfig(warmup_steps=4))  # rates 0, 1/4, 2/4, 3/4
    # The tiny model has 1024 positions: 100000 new tokens would be sampled (for minutes) to no purpose.
    assert fit_refused(
        tiny_model_dir,
        tmp_path,
        match=r"^model.grpo.max_completion_length=100000 tokens per row "
        r"exceed the 1024 positions of the policy \(max_position_embeddings in its config\): lower "
        r"max_completion_length to at most 1024$",
        grpo={"max_completion_length": 100000},
    ) == (False, 0)
    assert fit_refused(
        tiny_model_dir, tmp_path, match="trainer.max_steps=0: the run would train nothing", max_steps=0
    ) == (False, 0)
    err = cli_error(fit_args(tiny_model_dir, str(tmp_path), 1, "--new_data=true"), capsys)
    assert one_error_line(err).startswith(
        "error: --new_data true continues a checkpoint's weights on this data, but no --ckpt_path is given"
    )
    # The demo evaluates before it trains: the fit's checks come first.
    config = tmp_path / "demo.yaml"
    config.write_text(
        f"trainer: {{accelerator: cpu, logger: false, default_root_dir: {tmp_path / 'demo'}}}\n"
        f"model: {{policy: {tiny_model_dir}, grpo: {{max_completion_length: 5000}}}}\n"
        "data: {source: arithmetic, val_size: 2}\n"
    )
    with pytest.raises(ValueError, match="max_completion_length=5000 tokens per row exceed the 1024"):
        DEMO.main(["--config", str(config)])
    assert not os.path.exists(tmp_path / "demo" / "summary.json")


class SignalledDuringSampling:
    """A pre-flight's sampling that takes long: SIGTERM arrives at its start, then 20 s of work."""

    def __init__(self, sample) -> None:
        self.sample, self.ended = sample, None

    def __call__(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(400):
            time.sleep(0.05)
        self.ended = True
        return self.sample(*args, **kwargs)


def test_sigterm_stops_a_preflight_at_once(tiny_model_dir, tmp_path):
    module = tiny_module(tiny_model_dir, reward_funcs=[digit_reward], preflight=True)
    trainer = quiet_trainer(default_root_dir=str(tmp_path), max_steps=1, limit_val_batches=0)
    module.configure_model()
    sampling = module.rollouts.sample = SignalledDuringSampling(module.rollouts.sample)
    handler, start = signal.getsignal(signal.SIGTERM), time.monotonic()
    with pytest.raises(SIGTERMException):
        trainer.fit(module, GSM8KDataModule("arithmetic", None, batch_size=2, val_size=2))
    assert time.monotonic() - start < 15 and sampling.ended is None  # not after the 20 s of sampling
    assert trainer.global_step == 0
    saved = torch.load(tmp_path / "checkpoints" / "interrupted.ckpt", weights_only=True)
    assert saved["global_step"] == 0  # resumable: the run had made no step
    assert signal.getsignal(signal.SIGTERM) is handler  # the process's own again


@pytest.fixture(scope="module")
def logged(tiny_model_dir) -> list[str]:
    module = tiny_module(tiny_model_dir, reward_funcs=[digit_reward])
    data = GSM8KDataModule("arithmetic", None, val_size=2)
    data.setup("fit")
    return logged_metric_names(data, module)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_monitor_one_typo_away_from_a_logged_metric_is_refused(logged, data):
    """Any logged name is accepted; one edit away from a `val/...` name (a letter dropped, doubled or
    changed, `_` for `/`) is refused before the run, naming the metric meant; another namespace's metric
    (`gsm8k/accuracy_strict`, from another callback) is not the module's to judge."""
    name = data.draw(st.sampled_from([n for n in logged if n.startswith("val/")]))
    i = data.draw(st.integers(len("val"), len(name) - 1))  # after the namespace: its `/` and on
    edit = data.draw(st.sampled_from(["drop", "double", "change"]))
    typo = {
        "drop": name[:i] + name[i + 1 :],
        "double": name[:i] + name[i] + name[i:],
        "change": name[:i] + ("_" if name[i] == "/" else "x") + name[i + 1 :],
    }[edit]
    check_monitors(
        quiet_trainer(callbacks=[ModelCheckpoint(monitor=name)], enable_checkpointing=True), logged
    )
    if typo in logged:
        return
    with pytest.raises(ValueError, match=f"never logs {typo!r}"):
        check_monitors(quiet_trainer(callbacks=[EarlyStopping(typo)]), logged)
    check_monitors(quiet_trainer(callbacks=[EarlyStopping("gsm8k/" + name.removeprefix("val/"))]), logged)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--eval_every", "0"], "--eval_every 0: must be >= 1"),
        (["--threads", "-1"], "--threads -1: must be >= 1"),
        (["--max_steps", "0"], "--max_steps 0: must be >= 1"),
        (["--variants", "baseline", "baseline"], "--variants names 'baseline' twice"),
        (["--set", "model.grpo.sampling.top_p=2"], "GRPOConfig.sampling.top_p=2: must be > 0 and <= 1"),
        (
            ["--variants", "step_credit", "--step_credit", "-1"],
            "GRPOConfig.advantages.step_credit=-1.0: must be >= 0",
        ),
        (["--cpu_budget", "0"], "CPUTimeBudget.max_cpu_seconds=0.0: must be > 0 or None"),
        (["--set", "data.batch_size=0"], "data.batch_size=0: must be >= 1"),
        (["--config", "no/such.yaml"], "--config no/such.yaml: no such file"),
        (
            ["--set", "model.grpo.temprature=1"],
            "config key 'model.grpo.temprature': GRPOConfig has no option 'temprature' (did you mean "
            "'model.grpo.temperature'?)",
        ),
        (["--set", "trainer.max_stepz=3"], "config key 'trainer.max_stepz': lightning.Trainer has no option"),
        (["--set", "seeds=3"], "config key 'seeds': this script's config has no option 'seeds'"),
        (["--set", "model.grpo=5"], "config key 'model.grpo' is 5: it must be a section of options"),
        (
            ["--set", "trainer.logger=true"],
            "--set 'trainer.logger=true': this script leaves trainer.logger out",
        ),
        (["--set", "trainer.max_steps=0"], "trainer.max_steps=0: every run needs at least one step"),
        (["--set", "trainer.precision=fp7"], "Precision 'fp7' is invalid"),
        (
            ["--variants", "baseline", "--step_credit", "0.3"],
            "--step_credit 0.3: only the step_credit run reads",
        ),
    ],
)
def test_compare_options_refuses_bad_flags_before_its_first_step(tiny_model_dir, tmp_path, flags, message):
    config = tmp_path / "config.yaml"
    config.write_text(f"model:\n  policy: {tiny_model_dir}\ndata:\n  source: arithmetic\n")
    out = tmp_path / "runs" / "results.json"
    with pytest.raises(ValueError) as error:
        COMPARE.main(["--config", str(config), "--out", str(out), *flags])
    assert str(error.value).startswith(message)
    assert not os.path.exists(tmp_path / "runs")  # nothing trained, nothing written


def test_the_demo_without_held_out_rows_is_refused_before_any_weights_load(
    tiny_model_dir, tmp_path, capsys, no_weights
):
    config = tmp_path / "demo.yaml"
    config.write_text(
        f"trainer: {{accelerator: cpu, logger: false, default_root_dir: {tmp_path / 'demo'}}}\n"
        f"model: {{policy: {tiny_model_dir}}}\n"
        "data: {source: arithmetic, val_size: 2}\n"
    )
    with pytest.raises(SystemExit) as exit_info:  # was a ZeroDivisionError traceback after training
        run_script(DEMO.main, ["--config", str(config), "--data.val_size", "0"])
    assert exit_info.value.code == 2
    assert one_error_line(capsys.readouterr().err) == (
        "error: --data.val_size 0: the demo measures held-out accuracy before and after training on the "
        "held-out rows, and there are none; give --data.val_size 1 or more, or train without measuring with "
        "cli.py fit"
    )
    assert not os.path.exists(tmp_path / "demo" / "summary.json")
