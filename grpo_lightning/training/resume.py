"""Exact resume and graceful interruption.

Lightning's checkpoint already holds the weights, the optimizer, the scheduler and the loops' counters.
What it lacks for an exact continuation, and what this file adds:

- the random number generators that sampling draws from (`grpo_lightning.core.rng`); with several processes
  every rank's own states, since each samples its own prompts (`state_of_rank`);
- the position in the shuffled training data (`ResumableSampler`: this rank's share of a seeded order
  per epoch, able to start part-way through);
- checkpoints that `torch.load(weights_only=True)` reads (`grpo_lightning.io.checkpoints`);
- a checkpoint of the last completed step when the run gets SIGTERM or Ctrl-C, or stops on an error
  (`InterruptCheckpoint`);
- checkpoint files that appear complete or not at all (`checkpoints.AtomicCheckpointIO`, installed by
  `InterruptCheckpoint`).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.utils.data import DistributedSampler

from grpo_lightning.io.checkpoints import AtomicCheckpointIO

INTERRUPT_FILENAME = "interrupted.ckpt"


def warn_checkpoint_cadence(callbacks: list[ModelCheckpoint], steps_per_batch: int) -> None:
    """Warn for a `ModelCheckpoint(every_n_train_steps=n)` whose n is not a multiple of the optimizer steps a
    training step makes: it tests the global step after each training step, which adds that many at once."""
    for callback in callbacks:
        every = getattr(callback, "_every_n_train_steps", 0)
        if every % steps_per_batch:
            rank_zero_warn(
                f"ModelCheckpoint(every_n_train_steps={every}) counts optimizer steps, of which a training "
                f"step makes {steps_per_batch} (grpo.update.num_iterations x steps_per_generation): it "
                "saves only "
                f"where a multiple of both falls; set a multiple of {steps_per_batch}"
            )


def state_of_rank(per_rank: list, rank: int, world_size: int) -> Any:
    """This rank's item of what `distributed.gather_per_rank` stored; warns if the process count changed."""
    if len(per_rank) != world_size:
        rank_zero_warn(
            f"the checkpoint holds the state of {len(per_rank)} process(es), this run has {world_size}: "
            "sampling (and dynamic sampling's waiting groups) will not continue as the interrupted run's"
        )
    return per_rank[rank % len(per_rank)]


# ------------------------------------------------------------------------------------------ data order
class ResumableSampler(DistributedSampler):
    """This rank's share of the training rows in a fixed order per epoch, able to start the next pass
    `start` rows into that share.

    Each epoch's order is a permutation seeded by `seed + epoch` (or 0..n-1 without `shuffle`), never drawn
    from the global RNG, so a resumed run sees the rows the uninterrupted one would have. Its first
    `num_replicas * (num_rows // num_replicas)` rows are dealt round-robin (rank r takes positions r,
    r + num_replicas, ...); the `num_rows % num_replicas` rows left over sit that epoch out (other rows
    each epoch). So the ranks never share a row within an epoch and all take the same number of batches,
    which DDP and FSDP need (a rank with one batch more would wait alone in a collective).

    A rank-aware sampler rather than a loader that checkpoints its own state: every rank's position
    follows from the epoch and the number of batches done, which are the same on all ranks, so the one
    state that rank 0 writes (`GSM8KDataModule.state_dict`) resumes every rank. A stateful loader's state
    is per rank, and Lightning's checkpoint holds rank 0's only. It subclasses `DistributedSampler`
    because Lightning leaves a loader whose sampler is one as it is (with the default
    `use_distributed_sampler=True`); any other sampler it wraps in its `DistributedSamplerWrapper`, whose
    indices no longer match once the inner sampler starts part-way. Lightning calls `set_epoch` on it
    before each epoch.
    """

    def __init__(
        self, num_rows: int, seed: int = 0, shuffle: bool = True, num_replicas: int = 1, rank: int = 0
    ) -> None:
        if num_rows < num_replicas:
            raise ValueError(f"{num_rows} training rows cannot be shared among {num_replicas} processes")
        super().__init__(
            range(num_rows), num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=True
        )
        self.num_rows = num_rows
        self.start = 0

    def resume(self, epoch: int, start: int) -> None:
        """Make the next pass the one of `epoch`, beginning `start` rows into this rank's share; later
        passes start at 0."""
        if not 0 <= start <= self.num_samples:
            raise ValueError(f"resume position {start} outside this rank's {self.num_samples} training rows")
        self.epoch, self.start = epoch, start

    def order(self, epoch: int) -> list[int]:
        """The epoch's order of all rows, before they are dealt to the ranks."""
        if not self.shuffle:
            return list(range(self.num_rows))
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_rows, generator=generator).tolist()

    def share(self, epoch: int) -> list[int]:
        """This rank's rows of the epoch, in order."""
        return self.order(epoch)[: self.total_size][self.rank :: self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        start, self.start = self.start, 0
        return iter(self.share(self.epoch)[start:])


class InterruptCheckpoint(L.Callback):
    """On SIGTERM or Ctrl-C, finish the current step, write a checkpoint of it and stop; on an error during
    training, write a checkpoint of the last completed step before the error propagates.

    SIGTERM is what schedulers send before killing a job; Lightning turns it into `trainer.received_sigterm`
    and a `SIGTERMException` after the step. A first Ctrl-C is turned into the same graceful stop (a
    second one interrupts at once, without a checkpoint). An error (a reward function that raises, too
    many non-finite steps) stops a step before its update, so the weights are those of the last completed
    step; this is done on a single device only, where no other rank can be left waiting in the save.

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

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Here, not in `on_fit_start`: Lightning notes every signal's handler after `on_fit_start` and puts
        # them back when the run ends, after an error too, once this callback has restored Ctrl-C's; a
        # handler of ours noted there would be put back, and take the user's later Ctrl-C.
        current = signal.getsignal(signal.SIGINT)
        # Only outside another program's handler; one left behind by an earlier fit that never reached its
        # end (same process, e.g. a notebook) is replaced, else Ctrl-C would flag that old run.
        stale = isinstance(getattr(current, "__self__", None), InterruptCheckpoint)
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
        path = self.path(trainer)
        trainer.save_checkpoint(path)
        self.saved_path = path  # only once written: a failed save is not reported as a checkpoint
        rank_zero_info(
            f"{reason}: wrote the checkpoint of step {trainer.global_step} to {path}; "
            f"resume with --ckpt_path {path}"
        )

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if self._ctrl_c:
            self.stopped_by = "Ctrl-C"
            self._save(trainer, "Ctrl-C")
            trainer.should_stop = True

    def on_exception(self, trainer: L.Trainer, pl_module, exception: BaseException) -> None:
        self._restore_sigint()
        if isinstance(exception, SIGTERMException):
            # Lightning raises it once the step in progress (and any validation after it) is over.
            self.stopped_by = "SIGTERM"
            self._save(trainer, "SIGTERM")
        elif (
            isinstance(exception, Exception)
            and trainer.state.fn == TrainerFn.FITTING
            and trainer.global_step > 0
            and trainer.world_size == 1
        ):
            try:
                self._save(trainer, f"stopped by {type(exception).__name__}")
            except Exception as err:  # never hide the error that stopped the run behind this one
                rank_zero_warn(f"could not write a checkpoint after the error: {err}")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore_sigint()


def version_checkpoint_folders(trainer: L.Trainer) -> str | None:
    """Give a run without a logger a checkpoint folder of its own, `<default_root_dir>/checkpoints/version_N`
    with the first N not taken, as a logger gives each run a version: else every such run writes
    `<default_root_dir>/checkpoints/` and one run's `last.ckpt` or `interrupted.ckpt` replaces another's.

    Sets the folder on the Trainer's `ModelCheckpoint` and `InterruptCheckpoint` callbacks that name none
    (adding an `InterruptCheckpoint` when it has none) and returns it; None, changing nothing, with a logger.
    """
    if trainer.loggers:
        return None
    root = os.path.join(trainer.default_root_dir, "checkpoints")
    version = 0
    while os.path.exists(os.path.join(root, f"version_{version}")):
        version += 1
    folder = os.path.join(root, f"version_{version}")
    if not any(isinstance(c, InterruptCheckpoint) for c in trainer.callbacks):
        trainer.callbacks.append(InterruptCheckpoint())
    for callback in trainer.callbacks:
        if isinstance(callback, ModelCheckpoint | InterruptCheckpoint) and not callback.dirpath:
            callback.dirpath = folder
    return folder
