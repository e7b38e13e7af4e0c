"""Watching a GRPO run: what each training step sampled, and alarms when the run stops being able to learn.

`GRPOModule` leaves a `RolloutRecord` in `last_rollout` after each step; two callbacks read it:

- `CompletionsPanel`: a TensorBoard text table of sample completions (`completions_table`) with their
  rewards per function, total and advantage;
- `CollapseMonitor`: per-step diversity of the sampled groups, and alarms when the policy collapses, the
  rewards carry no signal, or completions run out of tokens.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field

import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from grpo_lightning.core.types import Trajectory

__all__ = [
    "CollapseMonitor",
    "CompletionsPanel",
    "RolloutRecord",
    "completions_table",
    "logging_step",
    "prompt_text",
]


def logging_step(trainer: L.Trainer) -> int:
    """The step at which Lightning logs the current training batch's metrics, counted from 0.

    One per training step (one rollout), however many optimizer steps it holds, so it is also the step that
    `every_n_steps` counts. Lightning's own LearningRateMonitor reads the same counter.
    """
    return trainer.fit_loop.epoch_loop._batches_that_stepped


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


def completions_table(record: RolloutRecord, num_prompts: int = 2, max_chars: int = 1000) -> str:
    """A Markdown table of the first `num_prompts` groups: each completion with its rewards and advantage,
    then the columns the reward functions logged with `log_extra`."""
    header = ["prompt", "completion", *record.reward_names, "reward", "advantage", "tokens", *record.extra]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    G = record.num_generations
    for i in range(min(num_prompts, len(record.prompts))):
        for row in range(i * G, (i + 1) * G):
            prompt = _markdown_cell(prompt_text(record.prompts[i]), max_chars) if row == i * G else ""
            length = f"{int(record.completion_lengths[row])}{' (cut)' if record.truncated[row] else ''}"
            cells = [
                prompt,
                _markdown_cell(record.completions[row], max_chars),
                *(f"{float(v):.3f}" for v in record.rewards_per_func[row]),
                f"{float(record.rewards[row]):.3f}",
                f"{float(record.advantages[row]):+.3f}",
                length,
                *(_markdown_cell(str(values[row]), max_chars) for values in record.extra.values()),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


class CompletionsPanel(L.Callback):
    """Every `every_n_steps` training steps (from the first), a TensorBoard text panel `completions`:
    the completions of a few prompts with each completion's rewards per function, total and advantage, and
    the columns reward functions logged with TRL's `log_extra(column, values)`.

    Reads `pl_module.last_rollout` (a `RolloutRecord`); only TensorBoard loggers get the panel.
    """

    def __init__(self, every_n_steps: int = 50, num_prompts: int = 2, max_chars: int = 1000) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.num_prompts = num_prompts
        self.max_chars = max_chars

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx):
        step = logging_step(trainer)
        record = getattr(pl_module, "last_rollout", None)
        if record is None or step % self.every_n_steps:
            return
        loggers = [lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]
        if not loggers or not trainer.is_global_zero:
            return
        table = completions_table(record, self.num_prompts, self.max_chars)
        for logger in loggers:
            logger.experiment.add_text("completions", table, global_step=step)


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
