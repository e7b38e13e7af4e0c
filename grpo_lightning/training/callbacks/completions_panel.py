"""`CompletionsPanel`: a table of sample completions (`completions_table.completion_rows`) from the
`RolloutRecord` that `GRPOModule` leaves in `last_rollout` after each step, with their rewards per function,
total and advantage, printed on the console (with `rich` where it is installed, as TRL prints it) and
written to every logger that takes tables: TensorBoard's text tab, `completions.csv` beside CSVLogger's
metrics, W&B's and MLflow's `log_table`.
"""

from __future__ import annotations

import csv
import os

import lightning as L
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger, WandbLogger

from grpo_lightning.training.callbacks.completions_table import (
    completion_rows,
    completions_table,
    console_table,
    print_rich_table,
)
from grpo_lightning.training.step_metrics import RolloutRecord, logging_step


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
