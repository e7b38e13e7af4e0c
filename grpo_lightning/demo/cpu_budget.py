"""A training budget in process CPU seconds, wall-clock seconds, or both.

On a machine shared with other jobs, wall-clock depends on the load; the CPU time the training process
itself used (user + system, all its threads, `time.process_time`) does much less. With `n` threads that keep
busy, `cpu_seconds / n` stands in for the wall-clock the same run takes on a quiet machine of `n` cores; they
seldom keep busy (measured for the demo: 2 threads used about 1.5 CPU seconds per second), so "10 minutes of
training on 2 cores" is a wall-clock limit on a quiet machine, with the CPU limit for loaded ones.
"""

from __future__ import annotations

import time

import lightning as L
from lightning.pytorch.utilities import rank_zero_info

from grpo_lightning.core.options import Rule, check_value


class CPUTimeBudget(L.Callback):
    """Stops training before the next batch would take the training CPU time over `max_cpu_seconds` or the
    training wall-clock over `max_wall_seconds`.

    Only the time inside training batches counts (`on_train_batch_start` to `on_train_batch_end`: sampling,
    scoring, the update): validation loops, checkpoints and the callbacks that run after this one at the
    end of a batch (put this one first) are left out. The stop is predicted from the mean cost of the
    batches so far, so a run ends under the budget unless a single batch costs more than the mean by more
    than what is left. Unlike the trainer's `max_time`, which stops after the batch that passed it, the run
    ends under the limit. The stop is logged with the figures behind it, and `stopped_by` names the limit.

    Args:
        max_cpu_seconds: the budget, in CPU seconds of this process (e.g. 1200 = 10 minutes of 2 busy
            cores). `None`: no limit, the figures are measured all the same.
        max_wall_seconds: the budget in wall-clock seconds of the same batches (600 = 10 minutes).
            `None`: no limit.
    """

    def __init__(self, max_cpu_seconds: float | None = None, max_wall_seconds: float | None = None) -> None:
        for name, value in (("max_cpu_seconds", max_cpu_seconds), ("max_wall_seconds", max_wall_seconds)):
            check_value("CPUTimeBudget", name, value, Rule(float, "> 0", none=True))
        self.max_cpu_seconds = max_cpu_seconds
        self.max_wall_seconds = max_wall_seconds
        self.cpu_seconds = 0.0  # training CPU seconds so far
        self.wall_seconds = 0.0  # the same batches' wall-clock
        self.batches = 0
        self.stopped_by: str | None = None  # the limit that stopped the run, if one did
        self._cpu_start = self._wall_start = 0.0

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx
    ) -> None:
        self._cpu_start, self._wall_start = time.process_time(), time.perf_counter()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx
    ) -> None:
        self.cpu_seconds += time.process_time() - self._cpu_start
        self.wall_seconds += time.perf_counter() - self._wall_start
        self.batches += 1
        for name, spent, limit in (
            ("max_cpu_seconds", self.cpu_seconds, self.max_cpu_seconds),
            ("max_wall_seconds", self.wall_seconds, self.max_wall_seconds),
        ):
            if limit is not None and spent + spent / self.batches > limit and not trainer.should_stop:
                trainer.should_stop = True
                self.stopped_by = name
                rank_zero_info(
                    f"CPUTimeBudget: stopping after {self.batches} training batch(es), {trainer.global_step} "
                    f"optimizer step(s): {spent:.1f} s spent, and one more batch at their mean of "
                    f"{spent / self.batches:.1f} s would pass {name}={limit:g}"
                )
