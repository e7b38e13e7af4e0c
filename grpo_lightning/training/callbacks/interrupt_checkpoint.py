"""`InterruptCheckpoint`: a checkpoint of the last completed step when a run gets SIGTERM or Ctrl-C, or stops
on an error, written whole or not at all (`io.checkpoints.AtomicCheckpointIO`, which it installs).
"""

from __future__ import annotations

import copy
import os
import signal
import uuid

import lightning as L
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from grpo_lightning.core.ranks import AgreedFailure
from grpo_lightning.core.rng import capture_rng_states, restore_rng_states
from grpo_lightning.core.stop_requests import (
    abandon,
    clear,
    end_rollout,
    enter_interruptible,
    enter_rollout,
    leave_interruptible,
    leave_rollout,
    request_stop,
    share_between_ranks,
)
from grpo_lightning.io.checkpoints import AtomicCheckpointIO
from grpo_lightning.io.shared_stops import SharedStops

INTERRUPT_FILENAME = "interrupted.ckpt"


class InterruptCheckpoint(L.Callback):
    """On SIGTERM or Ctrl-C, finish the current step, write a checkpoint of it and stop; on an error during
    training, write a checkpoint of the last completed step before the error propagates.

    SIGTERM is what schedulers send before killing a job; a step's rollout is abandoned at once (on several
    ranks, every rank's, at a point they agree on: a SIGTERM to any one of them stops them all), else the
    step finishes first. A first Ctrl-C is turned into the same graceful stop after the step (a second one
    interrupts at once, without a checkpoint). An error (a reward function that raises, too many
    non-finite steps) stops a step before its update, so the weights are those of the last completed step;
    this is done on a single device, or where every rank stopped on the same error at the same point
    (`core.ranks.AgreedFailure`: a rollout that failed on one rank), so that no rank is left waiting in
    the save.

    The checkpoint goes to `dirpath` (default: the `ModelCheckpoint`'s folder, else `<log_dir>/checkpoints`
    with a logger, `<default_root_dir>/checkpoints` without) as `interrupted.ckpt`, or `interrupted-v1.ckpt`,
    ... where that name is taken (never over a file); the log names it: resume with `--ckpt_path <path>`.
    `stopped_by` says which signal stopped the run ("SIGTERM", "Ctrl-C"; None otherwise), so that the CLI
    can exit with a non-zero status. Where the strategy writes checkpoints with Lightning's default
    `TorchCheckpointIO`, it is replaced by `AtomicCheckpointIO`, for this checkpoint and `ModelCheckpoint`'s.
    """

    def __init__(self, dirpath: str | None = None) -> None:
        self.dirpath = dirpath
        self.saved_path: str | None = None
        self.stopped_by: str | None = None
        self._ctrl_c = False
        self._previous_sigint = None
        self._step_start: dict | None = None  # the step in progress's starting state (`_open_step`)
        self._shared: SharedStops | None = None  # several ranks: their stop requests shared while fitting
        self._fit_answers_sigterm = False  # this fit's SIGTERM handler is in (from its sanity check or start)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # not a CheckpointIO the user chose
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()

    def folder(self, trainer: L.Trainer) -> str:
        """Where the checkpoint goes: `dirpath`, else the `ModelCheckpoint`'s folder, else where one would
        write (`<log_dir>/checkpoints` with a logger, `<default_root_dir>/checkpoints` without)."""
        dirpath = self.dirpath or getattr(trainer.checkpoint_callback, "dirpath", None)
        if dirpath is None and trainer.loggers:
            dirpath = os.path.join(trainer.log_dir, "checkpoints")
        return dirpath or os.path.join(trainer.default_root_dir, "checkpoints")

    def path(self, trainer: L.Trainer) -> str:
        """`interrupted.ckpt` in `folder`; `interrupted-v1.ckpt`, ... where a file of that name exists
        (another run's, or the one this run resumed from), as `ModelCheckpoint` versions its names."""
        stem, suffix = os.path.splitext(INTERRUPT_FILENAME)
        path, version = os.path.join(self.folder(trainer), INTERRUPT_FILENAME), 0
        while os.path.exists(path):
            version += 1
            path = os.path.join(self.folder(trainer), f"{stem}-v{version}{suffix}")
        return path

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.saved_path, self.stopped_by, self._ctrl_c = None, None, False
        self._step_start, self._fit_answers_sigterm = None, False
        clear()

    # ------------------------------------------------------------- SIGTERM answered within the step
    # Lightning turns SIGTERM into a flag that it reads after each step: a rollout of minutes would outlive
    # the scheduler's grace period. On one process, a SIGTERM also asks `core.stop_requests` to stop: the
    # step's rollout (until its first optimizer step), a validation or a prediction batch are abandoned at
    # once (or at the next decoding step), and the checkpoint is that of the last completed step, with the
    # generators and dynamic sampling's waiting groups as that step left them: a resumed run redoes the
    # abandoned step as the uninterrupted run did it. With several processes a rank cannot leave a step
    # that the others go on with (they would wait for it in a collective): while fitting (from the
    # sanity check on, whose batches are left as validation's), the ranks share
    # their stop requests (`io.shared_stops`) and agree before each step's first collective whether to stop
    # (`core.stop_requests.settle`), so that every rank abandons the same step's rollout, or finishes the
    # step and stops at the next one's start; a validation batch is left alike, the ranks agreeing after
    # each batch.
    def _install_sigterm(self, trainer: L.Trainer) -> None:
        if self._shares_stops(trainer):
            self._share_stops(trainer)
            previous = None  # not Lightning's: it broadcasts from the handler, a collective no rank joins
        elif trainer.world_size != 1 or trainer.strategy.launcher is not None:
            return
        else:
            previous = signal.getsignal(signal.SIGTERM)  # Lightning's, which sets `trainer.received_sigterm`

        def on_sigterm(signum, frame) -> None:
            if callable(previous):
                previous(signum, frame)
            request_stop(SIGTERMException)

        try:
            signal.signal(signal.SIGTERM, on_sigterm)  # Lightning puts its own back when the run ends
        except ValueError:  # not the main thread: SIGTERM is answered after the step
            self._stop_sharing()

    @staticmethod
    def _shares_stops(trainer: L.Trainer) -> bool:
        """Fitting on several ranks of a process group: their stop requests are shared."""
        return (
            trainer.world_size > 1
            and trainer.state.fn == TrainerFn.FITTING
            and torch.distributed.is_available()
            and torch.distributed.is_initialized()
        )

    def _share_stops(self, trainer: L.Trainer) -> None:
        self._stop_sharing()
        key = trainer.strategy.broadcast(f"grpo_lightning/stop/{uuid.uuid4().hex}")  # rank 0's, for this run
        self._shared = SharedStops(key, trainer.strategy.root_device)
        share_between_ranks(self._shared.any_rank, SIGTERMException)

    def _stop_sharing(self) -> None:
        share_between_ranks(None)
        if self._shared is not None:
            self._shared.close()
            self._shared = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module, batch, batch_idx: int) -> None:
        buffer = getattr(pl_module, "group_buffer", None)
        self._step_start = {
            "rng": capture_rng_states(),
            "group_buffer": copy.deepcopy(vars(buffer)) if buffer is not None else None,
        }
        enter_rollout()

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module, optimizer) -> None:
        leave_rollout()
        self._step_start = None  # the step's first update: from here it is finished, not abandoned

    def _back_to_step_start(self, pl_module) -> None:
        """Put back the generators and waiting groups an abandoned step started with, for its checkpoint."""
        if self._step_start is None:
            return
        restore_rng_states(self._step_start["rng"])
        if self._step_start["group_buffer"] is not None:
            vars(pl_module.group_buffer).update(self._step_start["group_buffer"])
        self._step_start = None

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx: int, dataloader_idx: int = 0):
        if trainer.world_size == 1:
            enter_interruptible()
        elif self._shared is not None:  # fitting on several ranks: a batch is left by all of them together
            enter_rollout()

    def on_validation_batch_end(
        self, trainer, pl_module, outputs, batch, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if trainer.world_size == 1:
            leave_interruptible()
        elif self._shared is not None:
            # Every rank takes as many batches (`validation_sets.rank_share`) and none has a collective of
            # its own: after each, the ranks agree whether a stop request ends validation (if a collective
            # inside the batch, FSDP2's gathers, has not agreed already).
            end_rollout()

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn != TrainerFn.FITTING:
            clear()
            self._install_sigterm(trainer)

    on_test_start = on_validation_start
    on_test_batch_start = on_validation_batch_start
    on_test_batch_end = on_validation_batch_end

    def on_predict_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        clear()
        self._install_sigterm(trainer)

    def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx: int, dataloader_idx: int = 0):
        enter_interruptible()

    def on_predict_batch_end(
        self, trainer, pl_module, outputs, batch, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        leave_interruptible()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._stop_sharing()
        clear()

    def on_sanity_check_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # The sanity check's validation comes before `on_train_start`: a SIGTERM there is answered as in a
        # validation while fitting (on several ranks, Lightning's own handler would wait in a broadcast for
        # ranks still in their batch).
        self._answer_sigterm_while_fitting(trainer)

    def _answer_sigterm_while_fitting(self, trainer: L.Trainer) -> None:
        if not self._fit_answers_sigterm:  # once: a second handler would wrap the first
            self._fit_answers_sigterm = True
            self._install_sigterm(trainer)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Here, not in `on_fit_start`: Lightning notes every signal's handler after `on_fit_start` and puts
        # them back when the run ends, after an error too, once this callback has restored Ctrl-C's; a
        # handler of ours noted there would be put back, and take the user's later Ctrl-C.
        current = signal.getsignal(signal.SIGINT)
        # Only outside another program's handler; one left behind by an earlier fit that never reached its
        # end (same process, e.g. a notebook) is replaced, else Ctrl-C would flag that old run.
        stale = isinstance(getattr(current, "__self__", None), InterruptCheckpoint)
        self._answer_sigterm_while_fitting(trainer)
        if current is signal.default_int_handler or stale:
            try:
                signal.signal(signal.SIGINT, self._on_sigint)
                self._previous_sigint = signal.default_int_handler
            except ValueError:  # not the main thread: leave Ctrl-C alone
                self._previous_sigint = None

    def _on_sigint(self, signum, frame) -> None:
        if self._ctrl_c:
            raise KeyboardInterrupt
        self._ctrl_c = True
        print("\nCtrl-C: stopping after this step with a checkpoint (press again to abort now)", flush=True)

    def _restore_sigint(self) -> None:
        if self._previous_sigint is not None:
            signal.signal(signal.SIGINT, self._previous_sigint)
            self._previous_sigint = None

    def _save(self, trainer: L.Trainer, reason: str) -> None:
        if self.saved_path is not None:
            return
        path = trainer.strategy.broadcast(self.path(trainer))  # rank 0's: the one file every rank names
        trainer.save_checkpoint(path)
        self.saved_path = path  # only once written: a failed save is not reported as a checkpoint
        rank_zero_info(
            f"{reason}: wrote the checkpoint of step {trainer.global_step} to {path}; "
            f"resume with --ckpt_path {path}"
        )

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        leave_rollout()
        self._step_start = None
        if self._ctrl_c:
            self.stopped_by = "Ctrl-C"
            self._save(trainer, "Ctrl-C")
            trainer.should_stop = True

    def on_exception(self, trainer: L.Trainer, pl_module, exception: BaseException) -> None:
        self._restore_sigint()
        try:
            self._checkpoint_on(exception, trainer, pl_module)
        finally:
            self._stop_sharing()

    def _checkpoint_on(self, exception: BaseException, trainer: L.Trainer, pl_module) -> None:
        if isinstance(exception, SIGTERMException):
            abandon()  # on several ranks, before they agreed on this step: they stop too
        else:
            leave_rollout()
        clear()  # writing the checkpoint is not to be cut short
        if trainer.state.fn != TrainerFn.FITTING:
            self.stopped_by = "SIGTERM" if isinstance(exception, SIGTERMException) else None
            return
        self._back_to_step_start(pl_module)  # a step left part-way is discarded: its start is saved
        if isinstance(exception, SIGTERMException):
            # Raised by `core.stop_requests` within the step (on several ranks, by all of them at the point
            # they agreed on, or at the next step's start), or by Lightning once the step in progress (and
            # any validation after it) is over.
            self.stopped_by = "SIGTERM"
            self._save(trainer, "SIGTERM")
        elif (
            isinstance(exception, Exception)
            and trainer.state.fn == TrainerFn.FITTING
            and trainer.global_step > 0
            and (trainer.world_size == 1 or isinstance(exception, AgreedFailure))
        ):
            try:
                self._save(trainer, f"stopped by {type(exception).__name__}")
            except Exception as err:  # never hide the error that stopped the run behind this one
                rank_zero_warn(f"could not write a checkpoint after the error: {err}")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore_sigint()
        self._stop_sharing()
