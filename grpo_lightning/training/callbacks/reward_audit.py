"""The reward audit at the start of `fit` (`grpo_lightning.core.rewards.audit`), a warning with its table
when it
is not perfect."""

from __future__ import annotations

import lightning as L
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from grpo_lightning.core.rewards.audit import audit_module_rewards, auditable

__all__ = ["RewardAuditCallback"]


class RewardAuditCallback(L.Callback):
    """Before training, audits the module's `reward_funcs` (and `reward_weights`) on the first `num_rows`
    training rows of the data module (`train_rows`, as `GSM8KDataModule` has); warns with the table when
    the audit is not perfect."""

    def __init__(self, num_rows: int = 200) -> None:
        self.num_rows = num_rows

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        rows = getattr(trainer.datamodule, "train_rows", None)
        if not rows or not auditable(rows[: self.num_rows]) or not trainer.is_global_zero:
            return
        report = audit_module_rewards(pl_module, rows[: self.num_rows])
        if report.perfect:
            rank_zero_info(f"reward audit on {report.num_rows} reference solutions: OK")
        else:
            rank_zero_warn("the reward audit is not perfect:\n" + report.table())
