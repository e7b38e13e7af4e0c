"""A training budget in process CPU seconds instead of wall-clock.

On a machine shared with other jobs, wall-clock depends on the load; the CPU time the training process
itself used (user + system, all its threads, `time.process_time`) does much less. With `n` threads that keep
busy, `cpu_seconds / n` stands in for the wall-clock the same run takes on a quiet machine of `n` cores.
"""

from __future__ import annotations

import time

import lightning as L


class CPUTimeBudget(L.Callback):
    """Stops training before the next batch would take the training CPU time over `max_cpu_seconds`.

    Only the time inside training batches counts (`on_train_batch_start` to `on_train_batch_end`: sampling,
    scoring, the update): validation loops, checkpoints and the callbacks that run after this one at the
    end of a batch (put this one first) are left out. The stop is predicted from the mean cost of the
    batches so far, so a run ends under the budget unless a single batch costs more than the mean by more
    than what is left.

    Args:
        max_cpu_seconds: the budget, in CPU seconds of this process (e.g. 1200 = 10 minutes on 2 busy
            cores). `None`: no limit, the figures are measured all the same.
    """

    def __init__(self, max_cpu_seconds: float | None = None) -> None:
        if max_cpu_seconds is not None and not max_cpu_seconds > 0:
            raise ValueError(f"CPUTimeBudget: max_cpu_seconds must be > 0, got {max_cpu_seconds!r}")
        self.max_cpu_seconds = max_cpu_seconds
        self.cpu_seconds = 0.0  # training CPU seconds so far
        self.wall_seconds = 0.0  # the same batches' wall-clock
        self.batches = 0
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
        per_batch = self.cpu_seconds / self.batches
        if self.max_cpu_seconds is not None and self.cpu_seconds + per_batch > self.max_cpu_seconds:
            trainer.should_stop = True
