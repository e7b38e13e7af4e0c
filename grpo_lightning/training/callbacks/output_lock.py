"""`HoldsOutputLock`: a callback that holds `io.files.OutputLock` on its run's output from `setup` until the
run ends (`teardown`, or `on_exception` when it fails), so that a second run writing the same place meanwhile
is refused in one line. Used by the run's config and checkpoint folder (`run_folder.SaveRunConfig`), the
validation results file (`results_writer.ValidationResultsWriter`) and the export folder
(`export_best.ExportBestCallback`)."""

from __future__ import annotations

from collections.abc import Callable

import lightning as L

from grpo_lightning.io.files import OutputLock

__all__ = ["HoldsOutputLock"]


class HoldsOutputLock(L.Callback):
    """Takes `OutputLock(path, option)` with `hold_lock` and lets it go when the run ends."""

    _lock: OutputLock | None = None

    def hold_lock(self, path: str, option: str, check: Callable[[], object] = lambda: None) -> None:
        """Hold the lock on `path`, then `check()` what is there: a run that held the lock before may have
        written it. A failed check lets the lock go and raises."""
        self._lock = OutputLock(path, option)
        self._lock.acquire()
        try:
            check()
        except BaseException:
            self.release_lock()
            raise

    def release_lock(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.release_lock()

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self.release_lock()
