"""Watching a GRPO run: what each training step logs and sampled, and alarms when the run stops being able to
learn.

`training_step_metrics` are the `train/...` metrics a step logs. `GRPOModule` leaves a `RolloutRecord` in
`last_rollout` after each step; two callbacks read it:

- `CompletionsPanel`: a table of sample completions (`completion_rows`) with their rewards per function,
  total and advantage, printed on the console (with `rich` where it is installed, as TRL prints it) and
  written to every logger that takes tables: TensorBoard's text tab, `completions.csv` beside CSVLogger's
  metrics, W&B's and MLflow's `log_table`;
- `CollapseMonitor`: per-step diversity of the sampled groups, and alarms when the policy collapses, the
  rewards carry no signal, or completions run out of tokens.
"""

from __future__ import annotations

import csv
import html
import os
import shutil
import textwrap
from dataclasses import dataclass, field

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger, WandbLogger
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from grpo_lightning.core.types import Trajectory

__all__ = [
    "CollapseMonitor",
    "CompletionsPanel",
    "RolloutRecord",
    "completion_rows",
    "completions_table",
    "console_table",
    "logging_step",
    "prompt_text",
    "training_step_metrics",
]


def logging_step(trainer: L.Trainer) -> int:
    """The step at which Lightning logs the current training batch's metrics, counted from 0.

    One per training step (one rollout), however many optimizer steps it holds, so it is also the step that
    `every_n_steps` counts. Lightning's own LearningRateMonitor reads the same counter.
    """
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def training_step_metrics(
    trajectory: Trajectory,
    update_stats: dict[str, Tensor],
    grad_norm: Tensor | None,
    reward_names: list[str],
    *,
    learning_rate: float,
    skipped_steps: int,
    generate_seconds: float,
    step_seconds: float,
) -> dict[str, Tensor]:
    """`train/...` metrics, detached float tensors: rewards (total, per function), completion lengths, the
    share cut off, throughput and times, learning rate, skipped steps, the gradient norm of a step that was
    taken, and every statistic of the update (`train/loss`, `train/kl`, ...); statistics already named
    `rollout/...` (the sampler/scorer gap, the rollout engine's speed and counters) keep their name."""
    rewards, rollout = trajectory.rewards, trajectory.rollout  # [B]
    lengths = rollout.completion_mask.sum(dim=1).float()  # [B]
    grouped = rewards.view(-1, trajectory.num_generations)  # [N, G]
    metrics = {
        "train/reward": rewards.mean(),
        "train/reward_std": rewards.std() if rewards.numel() > 1 else torch.zeros(()),
        "train/frac_reward_zero_std": (grouped.std(dim=1) < 1e-6).float().mean(),
        "train/completion_length": lengths.mean(),
        "train/completion_length_min": lengths.min(),
        "train/completion_length_max": lengths.max(),
        "train/frac_truncated": rollout.truncated.float().mean(),
        "train/tokens_per_second": torch.tensor(lengths.sum().item() / step_seconds),
        "train/generate_seconds": torch.tensor(generate_seconds),
        "train/step_seconds": torch.tensor(step_seconds),
        "train/learning_rate": torch.tensor(learning_rate),
        "train/skipped_steps": torch.tensor(float(skipped_steps)),
    }
    if grad_norm is not None:
        metrics["train/grad_norm"] = grad_norm
    for i, name in enumerate(reward_names):
        metrics[f"train/rewards/{name}"] = trajectory.rewards_per_func[:, i].nanmean()
    for key, value in update_stats.items():
        metrics[key if key.startswith("rollout/") else f"train/{key}"] = value
    return {k: v.detach().float() for k, v in metrics.items()}


@dataclass
class RolloutRecord:
    """What one GRPO training step sampled and how it was scored, for callbacks to read.

    Rows are completions, prompt i's group in rows i*G .. i*G+G-1. Tensors are detached and on the CPU.
    """

    prompts: list  # N prompts: chat messages or strings
    completions: list[str]  # N*G decoded completions
    reward_names: list[str]  # F reward function names
    rewards_per_func: Tensor  # [N*G, F] NaN where a function answered None
    rewards: Tensor  # [N*G] weighted total
    advantages: Tensor  # [N*G]
    completion_lengths: Tensor  # [N*G] tokens, EOS included
    truncated: Tensor  # [N*G] bool: hit max_completion_length without EOS
    num_generations: int
    entropy: float  # mean token entropy of the policy on the completions
    extra: dict[str, list] = field(default_factory=dict)  # reward functions' `log_extra` columns, [N*G] each

    @classmethod
    def of(
        cls, trajectory: Trajectory, reward_names: list[str], entropy: float, extra: dict[str, list]
    ) -> RolloutRecord:
        """The record of a training step's trajectory, on the CPU."""
        rollout = trajectory.rollout
        return cls(
            prompts=trajectory.prompts,
            completions=trajectory.completions,
            reward_names=reward_names,
            rewards_per_func=trajectory.rewards_per_func.cpu(),
            rewards=trajectory.rewards.cpu(),
            advantages=trajectory.advantages.cpu(),
            completion_lengths=rollout.completion_mask.sum(dim=1).cpu(),
            truncated=rollout.truncated.cpu(),
            num_generations=trajectory.num_generations,
            entropy=entropy,
            extra=extra,
        )


def prompt_text(prompt: list[dict[str, str]] | str) -> str:
    """The question of a prompt: the last message's content for chat prompts."""
    return prompt[-1]["content"] if isinstance(prompt, list) else prompt


def _markdown_cell(text: str, max_chars: int) -> str:
    """Text that stays inside one Markdown table cell and shows literally (TensorBoard renders Markdown)."""
    if len(text) > max_chars:
        text = text[:max_chars] + " …"
    for char in "\\`*_[]#":  # Markdown's own characters, the backslash first
        text = text.replace(char, "\\" + char)
    # Every line break a decoded completion can hold (\r, \x0b, \x85, \u2028, ... as well as \n) would end
    # the table's row.
    return "<br>".join(html.escape(text, quote=False).replace("|", "&#124;").splitlines())


def completion_rows(record: RolloutRecord, num_prompts: int = 2) -> tuple[list[str], list[list]]:
    """The first `num_prompts` groups as a table: its column names, and a row per completion (prompt,
    completion, each reward function's value, the weighted total, the advantage, the length in tokens,
    whether it was cut at `max_completion_length`, then the columns the reward functions logged with
    `log_extra`). Values are plain Python: text, floats (NaN where a function answered None), ints, bools."""
    columns = ["prompt", "completion", *record.reward_names, "reward", "advantage", "tokens", "cut"]
    columns += list(record.extra)
    rows = []
    G = record.num_generations
    for i in range(min(num_prompts, len(record.prompts))):
        for row in range(i * G, (i + 1) * G):
            rows.append(
                [
                    prompt_text(record.prompts[i]),
                    record.completions[row],
                    *(float(v) for v in record.rewards_per_func[row]),
                    float(record.rewards[row]),
                    float(record.advantages[row]),
                    int(record.completion_lengths[row]),
                    bool(record.truncated[row]),
                    *(values[row] for values in record.extra.values()),
                ]
            )
    return columns, rows


def _shown(column: str, value: object) -> str:
    """A cell's text: numbers to 3 decimals, the advantage signed, the token count and "cut" together."""
    if column == "advantage":
        return f"{value:+.3f}"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def _display(columns: list[str], rows: list[list]) -> tuple[list[str], list[list[str]]]:
    """The columns and cells as shown: the cut flag folded into the token count ("64 (cut)")."""
    cut = columns.index("cut")
    shown = [c for c in columns if c != "cut"]
    cells = []
    for row in rows:
        texts = [_shown(c, v) for c, v in zip(columns, row, strict=True)]
        texts[cut - 1] += " (cut)" if row[cut] else ""
        cells.append(texts[:cut] + texts[cut + 1 :])
    return shown, cells


def completions_table(record: RolloutRecord, num_prompts: int = 2, max_chars: int = 1000) -> str:
    """A Markdown table of the first `num_prompts` groups (`completion_rows`), each prompt shown once, on
    its group's first row."""
    columns, rows = _display(*completion_rows(record, num_prompts))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for i, cells in enumerate(rows):
        cells[0] = cells[0] if i % record.num_generations == 0 else ""
        lines.append("| " + " | ".join(_markdown_cell(cell, max_chars) for cell in cells) + " |")
    return "\n".join(lines)


def console_table(record: RolloutRecord, step: int, num_prompts: int = 1, max_chars: int = 300) -> str:
    """The first `num_prompts` groups as plain text for a terminal (what `CompletionsPanel` prints where
    `rich` is not installed): each prompt, then one line per completion with its numbers first."""
    columns, rows = _display(*completion_rows(record, num_prompts))
    width = max(60, shutil.get_terminal_size().columns)
    numbers = columns[2:]
    widths = [max(len(c), *(len(r[2 + j]) for r in rows)) for j, c in enumerate(numbers)]
    header = "  ".join(c.rjust(w) for c, w in zip(numbers, widths, strict=True)) + "  completion"
    lines = [f"completions at step {step}"]
    for i, cells in enumerate(rows):
        if i % record.num_generations == 0:
            lines += textwrap.wrap(f"prompt: {' '.join(cells[0].split())[:max_chars]}", width) + [header]
        text = " ".join(cells[1].split())
        text = text[:max_chars] + " …" if len(text) > max_chars else text
        line = "  ".join(v.rjust(w) for v, w in zip(cells[2:], widths, strict=True)) + f"  {text!r}"
        lines.append(line)
    return "\n".join(lines)


def _print_rich(record: RolloutRecord, step: int, num_prompts: int, max_chars: int) -> bool:
    """Print the groups as a `rich` table, as TRL does; False where rich is not installed."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        return False
    columns, rows = _display(*completion_rows(record, num_prompts))
    table = Table(title=f"completions at step {step}", show_lines=True)
    for column in columns:
        numeric = column not in ("prompt", "completion") and column not in record.extra
        table.add_column(column, justify="right" if numeric else "left", overflow="fold")
    for i, cells in enumerate(rows):
        cells[0] = cells[0][:max_chars] if i % record.num_generations == 0 else ""
        cells[1] = cells[1][:max_chars] + (" …" if len(cells[1]) > max_chars else "")
        table.add_row(*cells)
    Console().print(table)
    return True


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
        if self.console and not _print_rich(record, step, self.console_prompts, self.max_chars // 3):
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
