"""`FitChecks`: what a `fit` is about to do, checked when the Trainer sets it up, before any weights load
(`run_checks`: the engine, the folders the run writes, the metrics its callbacks monitor, the run's length,
the rows' length; the engine at every stage, the rows' length also for `validate`).
"""

from __future__ import annotations

import lightning as L

from grpo_lightning.core.generation.backends import check_engine_importable
from grpo_lightning.training.run_checks import check_engine, check_fit, check_row_length


class FitChecks(L.Callback):
    """The checks of `run_checks`, on a `GRPOModule`'s `fit`."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        check_engine_importable(pl_module.grpo.engine)  # every stage samples
        check_engine(pl_module, trainer.strategy.root_device)
        if stage == "fit":
            check_fit(trainer, pl_module, trainer.datamodule)
        elif stage == "validate":
            check_row_length(pl_module)  # validation samples as long as training does
