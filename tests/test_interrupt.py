"""SIGTERM and Ctrl-C during training: a checkpoint of the last completed step, a non-zero exit status, and a
run resumed from it; a full disk leaves no partial checkpoint."""

import builtins
import errno
import os
import signal
import subprocess
import sys
import tempfile
import time

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from grpo_lightning.cli import EXIT_CTRL_C, EXIT_SIGTERM, build_cli
from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.training.data import GSM8KDataModule
from grpo_lightning.training.module import GRPOModule
from grpo_lightning.training.resume import ResumableSampler
from tests.helpers import quiet_trainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fit_args(model_dir: str, root: str, max_steps: int, *extra: str) -> list[str]:
    return [
        "fit",
        f"--model.policy={model_dir}",
        "--model.reward_funcs=[tests.helpers.digit_reward]",
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


def interrupt_cli_fit(model_dir: str, root: str, signum: int) -> tuple[int, str]:
    """Run `cli.py fit` in a subprocess, send it `signum` after two steps; its exit status and output."""
    log_path = os.path.join(root, "train.log")
    metrics = os.path.join(root, "lightning_logs", "version_0", "metrics.csv")
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "cli.py", *fit_args(model_dir, root, 10_000)],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            # A shell's background job ignores SIGINT, and the child would inherit that: Ctrl-C acts as usual.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        try:
            deadline = time.monotonic() + 240
            while steps_logged(metrics) < 2:
                assert process.poll() is None, open(log_path).read()
                assert time.monotonic() < deadline, "no training step within the time limit"
                time.sleep(0.2)
            process.send_signal(signum)
            process.wait(timeout=120)
        finally:
            if process.poll() is None:
                process.kill()
    with open(log_path) as f:
        return process.returncode, f.read()


@pytest.mark.long
def test_sigterm_to_a_training_process_checkpoints_and_the_run_resumes(tiny_model_dir, tmp_path):
    root = str(tmp_path)
    status, output = interrupt_cli_fit(tiny_model_dir, root, signal.SIGTERM)
    assert status == EXIT_SIGTERM == 143, output  # a scheduler must not record the run as finished

    ckpt = os.path.join(root, "lightning_logs", "version_0", "checkpoints", "interrupted.ckpt")
    saved = torch.load(ckpt, weights_only=True)
    step = saved["global_step"]
    assert step >= 2
    assert f"SIGTERM: wrote the checkpoint of step {step} to {ckpt}" in output
    assert "Traceback" not in output
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


@pytest.mark.long
def test_ctrl_c_to_the_cli_checkpoints_and_exits_130(tiny_model_dir, tmp_path):
    status, output = interrupt_cli_fit(tiny_model_dir, str(tmp_path), signal.SIGINT)
    assert status == EXIT_CTRL_C == 130, output
    ckpt = os.path.join(str(tmp_path), "lightning_logs", "version_0", "checkpoints", "interrupted.ckpt")
    step = torch.load(ckpt, weights_only=True)["global_step"]
    assert step >= 2
    assert f"Ctrl-C: wrote the checkpoint of step {step} to {ckpt}" in output
    assert "Traceback" not in output


# ------------------------------------------------------------------------------------------ full disk
FREE_BYTES = 100


def fill_disk(full: str, tmp_path, monkeypatch) -> None:
    """Put the folder `full` on a full disk: a write into a file there fails with ENOSPC once FREE_BYTES are
    written.

    The system's temporary folder is made another filesystem, as /tmp often is: a rename from it into the
    full folder fails with EXDEV, and `shutil.move` falls back to copying (through `open` and `os.sendfile`).
    """
    os.makedirs(full, exist_ok=True)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "another_filesystem"))
    os.makedirs(tempfile.tempdir)
    real_open, real_rename, real_replace, real_sendfile = builtins.open, os.rename, os.replace, os.sendfile

    def on_full_disk(path) -> bool:
        return os.path.abspath(os.fsdecode(path)).startswith(full + os.sep)

    def no_space() -> OSError:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    class FileOnFullDisk:
        def __init__(self, f) -> None:
            self.file = f

        def write(self, data) -> int:
            room = FREE_BYTES - self.file.tell()
            if len(data) > room:
                self.file.write(data[: max(0, room)])
                raise no_space()
            return self.file.write(data)

        def __getattr__(self, name: str):
            return getattr(self.file, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            self.file.close()

    def open_(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        writes = any(c in mode for c in "wax+")
        return (
            FileOnFullDisk(f) if writes and isinstance(file, str | os.PathLike) and on_full_disk(file) else f
        )

    def across_filesystems(real):
        def move(src, dst, *args, **kwargs):
            if on_full_disk(src) != on_full_disk(dst):
                raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))
            return real(src, dst, *args, **kwargs)

        return move

    def sendfile(out_fd: int, in_fd: int, offset, count: int) -> int:
        if on_full_disk(os.readlink(f"/proc/self/fd/{out_fd}")):
            room = FREE_BYTES - os.fstat(out_fd).st_size
            if count > room:
                real_sendfile(out_fd, in_fd, offset, max(0, room))
                raise no_space()
        return real_sendfile(out_fd, in_fd, offset, count)

    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(os, "rename", across_filesystems(real_rename))
    monkeypatch.setattr(os, "replace", across_filesystems(real_replace))
    monkeypatch.setattr(os, "sendfile", sendfile)


@pytest.fixture
def full_disk(tmp_path, monkeypatch) -> str:
    full = str(tmp_path / "full")
    fill_disk(full, tmp_path, monkeypatch)
    return full


def tiny_fit(model_dir: str, root: str, **trainer_kwargs) -> L.Trainer:
    grpo = GRPOConfig(num_generations=2, max_completion_length=4, preflight=False, log_completions_every=0)
    module = GRPOModule(model_dir, grpo=grpo)
    data = GSM8KDataModule(
        source="arithmetic", system_prompt=None, arithmetic_size=8, batch_size=2, val_size=2
    )
    trainer = quiet_trainer(limit_val_batches=0, default_root_dir=root, **trainer_kwargs)
    trainer.fit(module, data)
    return trainer


def test_a_full_disk_leaves_no_partial_checkpoint(tiny_model_dir, tmp_path, full_disk):
    # ModelCheckpoint's save fails after step 1; InterruptCheckpoint then tries interrupted.ckpt, fails too.
    every_step = ModelCheckpoint(dirpath=full_disk, every_n_train_steps=1, save_top_k=-1)
    with pytest.raises(OSError, match="No space left on device") as error:
        with pytest.warns(UserWarning, match="could not write a checkpoint after the error"):
            tiny_fit(
                tiny_model_dir, str(tmp_path), max_steps=2, callbacks=[every_step], enable_checkpointing=True
            )
    assert error.value.errno == errno.ENOSPC
    assert full_disk in str(error.value)  # names the checkpoint it could not write
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Ctrl-C is the user's again
    assert os.listdir(full_disk) == []  # no truncated .ckpt, no 0-byte interrupted.ckpt, no temporary file


def test_a_full_disk_keeps_the_previous_checkpoint_of_the_same_name(tiny_model_dir, tmp_path, monkeypatch):
    trainer = tiny_fit(tiny_model_dir, str(tmp_path), max_steps=1)
    full = str(tmp_path / "full")
    path = os.path.join(full, "last.ckpt")
    trainer.save_checkpoint(path)
    with open(path, "rb") as f:
        before = f.read()
    with monkeypatch.context() as patch:
        fill_disk(full, tmp_path, patch)
        with pytest.raises(OSError, match="No space left on device"):
            trainer.save_checkpoint(path)
    with open(path, "rb") as f:
        assert f.read() == before  # replaced whole or not at all
    assert os.listdir(full) == ["last.ckpt"]
