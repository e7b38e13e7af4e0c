"""Exact resume and graceful interruption.

Lightning's checkpoint already holds the weights, the optimizer, the scheduler and the loops' counters.
What it lacks for an exact continuation, and what this file adds:

- the random number generators that sampling draws from (`grpo_lightning.core.rng`); with several processes
  every rank's own states, since each samples its own prompts (`state_of_rank`);
- the position in the shuffled training data (`ResumableSampler`: this rank's share of a seeded order
  per epoch, able to start part-way through);
- checkpoints that `torch.load(weights_only=True)` reads (`grpo_lightning.io.checkpoints`);
- a checkpoint of the last completed step when the run gets SIGTERM or Ctrl-C, or stops on an error
  (`callbacks.interrupt_checkpoint.InterruptCheckpoint`);
- checkpoint files that appear complete or not at all (`checkpoints.AtomicCheckpointIO`, installed by
  `InterruptCheckpoint`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DistributedSampler


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
