"""SIGTERM and Ctrl-C during training: a checkpoint of the last completed step, and a run resumed from it."""

import os
import signal
import subprocess
import sys
import time

import lightning as L
import torch

from grpo_lightning.cli import build_cli
from grpo_lightning.config import GRPOConfig
from grpo_lightning.data import GSM8KDataModule
from grpo_lightning.module import GRPOModule
from grpo_lightning.resume import ResumableSampler
from tests.conftest import quiet_trainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fit_args(model_dir: str, root: str, max_steps: int, *extra: str) -> list[str]:
    return [
        "fit",
        f"--model.policy={model_dir}",
        "--model.reward_funcs=[tests.conftest.digit_reward]",
        "--model.grpo.num_generations=2",
        "--model.grpo.max_completion_length=6",
        "--model.grpo.preflight=false",
        "--data.source=arithmetic",
        "--data.system_prompt=null",
        "--data.batch_size=2",
        "--data.val_size=2",
        "--trainer.accelerator=cpu",
        f"--trainer.max_steps={max_steps}",
        "--trainer.limit_val_batches=0",
        "--trainer.enable_progress_bar=false",
        "--trainer.log_every_n_steps=1",
        f"--trainer.default_root_dir={root}",
        "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
        f"--trainer.logger.save_dir={root}",
        "--trainer.logger.flush_logs_every_n_steps=1",
        *extra,
    ]


def steps_logged(metrics_csv: str) -> int:
    if not os.path.exists(metrics_csv):
        return 0
    with open(metrics_csv) as f:
        return max(0, sum(1 for _ in f) - 1)  # one row per step after the header


class FirstBatch(L.Callback):
    """The questions of the first batch this run trains on."""

    def __init__(self) -> None:
        self.questions: list[str] | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.questions is None:
            self.questions = batch["question"]


def test_sigterm_to_a_training_process_checkpoints_and_the_run_resumes(tiny_model_dir, tmp_path):
    root = str(tmp_path)
    log_path = tmp_path / "train.log"
    metrics = os.path.join(root, "lightning_logs", "version_0", "metrics.csv")
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "cli.py", *fit_args(tiny_model_dir, root, 10_000)],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 240
            while steps_logged(metrics) < 2:
                assert process.poll() is None, log_path.read_text()
                assert time.monotonic() < deadline, "no training step within the time limit"
                time.sleep(0.2)
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=120)
        finally:
            if process.poll() is None:
                process.kill()
    output = log_path.read_text()
    assert process.returncode == 0, output

    ckpt = os.path.join(root, "lightning_logs", "version_0", "checkpoints", "interrupted.ckpt")
    saved = torch.load(ckpt, weights_only=True)
    step = saved["global_step"]
    assert step >= 2
    assert f"SIGTERM: wrote the checkpoint of step {step} to {ckpt}" in output
    assert saved["GSM8KDataModule"] == {"epoch": 0, "batches_done": step}  # weights and data agree

    cli = build_cli(
        fit_args(
            tiny_model_dir,
            root,
            step + 2,
            f"--ckpt_path={ckpt}",
            "--trainer.callbacks=tests.test_interrupt.FirstBatch",
        )
    )
    assert cli.trainer.global_step == step + 2
    # By name: the CLI imports this file as `tests.test_interrupt`, pytest under another module name.
    first = next(c for c in cli.trainer.callbacks if type(c).__name__ == "FirstBatch")
    rows = cli.datamodule.train_rows
    order = ResumableSampler(len(rows), seed=0).order(0)
    assert first.questions == [rows[i]["question"] for i in order[2 * step : 2 * step + 2]]  # the next batch


class PressCtrlC(L.Callback):
    """Sends this process SIGINT while step `at` runs, as a user pressing Ctrl-C."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.at - 1:
            os.kill(os.getpid(), signal.SIGINT)


def test_ctrl_c_finishes_the_step_and_checkpoints_it(tiny_model_dir, tmp_path):
    grpo = GRPOConfig(num_generations=2, max_completion_length=4, preflight=False)
    module = GRPOModule(tiny_model_dir, grpo=grpo)
    data = GSM8KDataModule(
        source="arithmetic", system_prompt=None, arithmetic_size=20, batch_size=2, val_size=2
    )
    trainer = quiet_trainer(
        max_steps=50, limit_val_batches=0, default_root_dir=str(tmp_path), callbacks=[PressCtrlC(at=3)]
    )
    trainer.fit(module, data)  # returns: the first Ctrl-C is a graceful stop, not a KeyboardInterrupt

    assert trainer.global_step == 3
    saved = torch.load(tmp_path / "checkpoints" / "interrupted.ckpt", weights_only=True)
    assert saved["global_step"] == 3
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Ctrl-C is the user's again
