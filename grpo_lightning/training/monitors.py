"""The callbacks that watch a GRPO run through the `RolloutRecord` that `GRPOModule` leaves in `last_rollout`
after each step:

- `CompletionsPanel`: a table of sample completions (`completions_table.completion_rows`) with their
  rewards per function, total and advantage, printed on the console (with `rich` where it is installed, as
  TRL prints it) and written to every logger that takes tables: TensorBoard's text tab, `completions.csv`
  beside CSVLogger's metrics, W&B's and MLflow's `log_table`;
- `CollapseMonitor`: per-step diversity of the sampled groups, and alarms when the policy collapses, the
  rewards carry no signal, or completions run out of tokens.
"""

from __future__ import annotations

import csv
import os

import lightning as L
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger, WandbLogger
from lightning.pytorch.utilities import rank_zero_warn

from grpo_lightning.training.completions_table import (
    completion_rows,
    completions_table,
    console_table,
    print_rich_table,
)
from grpo_lightning.training.step_metrics import RolloutRecord, logging_step

__all__ = ["CollapseMonitor", "CompletionsPanel"]


class CompletionsPanel(L.Callback):
    """Every `every_n_steps` training steps (from the first), the completions of a few prompts with each
    completion's rewards per function, total, advantage and length, and the columns reward functions logged
    with TRL's `log_extra(column, values)`:

    - on the console (`console`): the first `console_prompts` groups, as a `rich` table where rich is
      installed, else as text (`console_table`);
    - in every logger that takes tables: TensorBoard's text tab (`completions`, Markdown), a
      `completions.csv` beside CSVLogger's metrics (one row per completion, with its step), W&B's and
      MLflow's `log_table` (`completions`; MLflow: `completions/step_<N>.json`).

    Reads `pl_module.last_rollout` (a `RolloutRecord`).
    """

    def __init__(
        self,
        every_n_steps: int = 50,
        num_prompts: int = 2,
        max_chars: int = 1000,
        console: bool = True,
        console_prompts: int = 1,
    ) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.num_prompts = num_prompts
        self.max_chars = max_chars
        self.console = console
        self.console_prompts = console_prompts

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx):
        step = logging_step(trainer)
        record = getattr(pl_module, "last_rollout", None)
        if record is None or step % self.every_n_steps or not trainer.is_global_zero:
            return
        if self.console and not print_rich_table(record, step, self.console_prompts, self.max_chars // 3):
            print(console_table(record, step, self.console_prompts, self.max_chars // 3), flush=True)
        self.log_tables(trainer.loggers, record, step)

    def log_tables(self, loggers: list, record: RolloutRecord, step: int) -> None:
        """Write the groups' table to each logger that takes tables."""
        columns, rows = completion_rows(record, self.num_prompts)
        for logger in loggers:
            if isinstance(logger, TensorBoardLogger):
                table = completions_table(record, self.num_prompts, self.max_chars)
                logger.experiment.add_text("completions", table, global_step=step)
            elif isinstance(logger, CSVLogger):
                _append_csv(os.path.join(logger.log_dir, "completions.csv"), ["step", *columns], step, rows)
            elif isinstance(logger, WandbLogger):
                data = [[_plain_cell(v) for v in row] for row in rows]
                logger.log_table(key="completions", columns=columns, data=data, step=step)
            elif isinstance(logger, MLFlowLogger):
                data = {c: [_plain_cell(row[j]) for row in rows] for j, c in enumerate(columns)}
                logger.experiment.log_table(logger.run_id, data, f"completions/step_{step:06d}.json")


def _plain_cell(value: object) -> object:
    """A table cell the W&B and MLflow tables take: numbers and booleans as they are, the rest as text."""
    return value if isinstance(value, int | float | bool | str) else str(value)


def _append_csv(path: str, columns: list[str], step: int, rows: list[list]) -> None:
    """Append one line per completion (its step first) to `path`, with a header when the file is new."""
    new = not os.path.exists(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        if new:
            writer.writerow(columns)
        writer.writerows([step, *(_plain_cell(v) for v in row)] for row in rows)


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
