"""`CollapseMonitor`: per-step diversity of the sampled groups, read from the `RolloutRecord` that
`GRPOModule` leaves in `last_rollout` after each step, and alarms when the policy collapses, the rewards
carry no signal, or completions run out of tokens.
"""

from __future__ import annotations

import lightning as L
from lightning.pytorch.utilities import rank_zero_warn

from grpo_lightning.training.step_metrics import RolloutRecord


class CollapseMonitor(L.Callback):
    """Per-step diversity of the sampled groups, and warnings when a run stops being able to learn.

    Logs `monitor/frac_identical_groups` (groups whose G completions are all the same text),
    `monitor/distinct_per_group` (mean number of distinct completions per group), and three 0/1 alarms
    that turn on once their condition has held for `patience` consecutive steps, each with a warning:

    - `monitor/collapse`: at least `identical_fraction` of the groups are identical (the policy has
      stopped exploring; token entropy `train/entropy` usually falls with it);
    - `monitor/no_signal`: at least `no_signal_fraction` of the groups have equal rewards throughout (all
      wrong or all right), so their advantages, and the gradient, are zero;
    - `monitor/truncation`: at least `truncated_fraction` of the completions hit `max_completion_length`.

    Reads `pl_module.last_rollout` (a `RolloutRecord`).
    """

    ALARMS = ("collapse", "no_signal", "truncation")

    def __init__(
        self,
        patience: int = 3,
        identical_fraction: float = 0.5,
        no_signal_fraction: float = 1.0,
        truncated_fraction: float = 0.9,
    ) -> None:
        if patience < 1:
            raise ValueError(f"patience must be >= 1, got {patience}")
        self.patience = patience
        self.thresholds = {
            "collapse": identical_fraction,
            "no_signal": no_signal_fraction,
            "truncation": truncated_fraction,
        }
        self.streaks = dict.fromkeys(self.ALARMS, 0)

    def update(self, record: RolloutRecord) -> dict[str, float]:
        """Fold in one step's rollout: returns its metrics and warns when an alarm goes off."""
        G = record.num_generations
        groups = [record.completions[i : i + G] for i in range(0, len(record.completions), G)]
        distinct = [len(set(group)) for group in groups]
        grouped = record.rewards.view(-1, G)  # [N, G]
        fractions = {
            "collapse": sum(d == 1 for d in distinct) / len(groups),
            "no_signal": float((grouped.max(dim=1).values - grouped.min(dim=1).values < 1e-6).float().mean()),
            "truncation": float(record.truncated.float().mean()),
        }
        metrics = {
            "monitor/frac_identical_groups": fractions["collapse"],
            "monitor/distinct_per_group": sum(distinct) / len(groups),
        }
        for alarm in self.ALARMS:
            self.streaks[alarm] = self.streaks[alarm] + 1 if fractions[alarm] >= self.thresholds[alarm] else 0
            metrics[f"monitor/{alarm}"] = float(self.streaks[alarm] >= self.patience)
            if self.streaks[alarm] == self.patience:  # once per episode, not on every step after
                rank_zero_warn(self._message(alarm, fractions[alarm], record))
        return metrics

    def _message(self, alarm: str, fraction: float, record: RolloutRecord) -> str:
        steps = f"for {self.patience} steps"
        if alarm == "collapse":
            return (
                f"policy collapse: {fraction:.0%} of groups sampled {record.num_generations} identical "
                f"completions {steps} (token entropy {record.entropy:.3f}); raise the temperature or lower "
                f"the learning rate"
            )
        if alarm == "no_signal":
            return (
                f"no learning signal: {fraction:.0%} of groups got equal rewards {steps} (mean reward "
                f"{float(record.rewards.mean()):.3f}), so their advantages are zero; the task is too hard or "
                f"too easy for the model, or a reward function is broken (run `cli.py audit`)"
            )
        return (
            f"{fraction:.0%} of completions hit max_completion_length {steps}: raise it, or penalise length"
        )

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx):
        record = getattr(pl_module, "last_rollout", None)
        if record is None:
            return
        metrics = self.update(record)
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=len(record.completions))
