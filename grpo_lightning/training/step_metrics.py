"""What each training step logs and sampled: the `train/...` metrics, those of each optimizer step
(`update_metrics`) and those of the rollout (`rollout_metrics`), written on the optimizer-step axis
(`log_training_step`); `GRPOModule` leaves a `RolloutRecord` (what the step sampled and scored) in
`last_rollout`, which the monitors of `training.callbacks` read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import lightning as L
import torch
from torch import Tensor

from grpo_lightning.core.types import Trajectory

__all__ = [
    "RolloutRecord",
    "UpdateRows",
    "log_training_step",
    "logging_step",
    "rollout_metrics",
    "update_metrics",
]

# Each optimizer step of a training step: its index (the optimizer steps before it) and its metrics.
UpdateRows = list[tuple[int, dict[str, Tensor]]]


def logging_step(trainer: L.Trainer) -> int:
    """The step at which Lightning logs the current training batch's metrics, counted from 0.

    One per training step (one rollout), however many optimizer steps it holds, so it is also the step that
    `every_n_steps` counts. Lightning's own LearningRateMonitor reads the same counter. The `train/...`
    metrics are on the optimizer-step axis instead (`log_training_step`); the two agree with one optimizer
    step per training step.
    """
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def update_metrics(
    stats: dict[str, Tensor], grad_norm: Tensor | None, learning_rate: float
) -> dict[str, Tensor]:
    """`train/...` metrics of one optimizer step, detached float tensors: every statistic of its update
    (`train/loss`, `train/kl`, `train/entropy`, `train/clip_ratio/...`, ...), the learning rate it used and,
    for a step taken, the gradient norm; statistics already named `rollout/...` (the sampler/scorer gap
    measured in the loss) keep their name."""
    metrics = {key if key.startswith("rollout/") else f"train/{key}": value for key, value in stats.items()}
    metrics["train/learning_rate"] = torch.tensor(learning_rate)
    if grad_norm is not None:
        metrics["train/grad_norm"] = grad_norm
    return {k: v.detach().float() for k, v in metrics.items()}


def rollout_metrics(
    trajectory: Trajectory,
    stats: dict[str, Tensor],
    reward_names: list[str],
    *,
    skipped_steps: int,
    generate_seconds: float,
    step_seconds: float,
) -> dict[str, Tensor]:
    """`train/...` metrics of a training step's rollout, detached float tensors: rewards (total, per
    function), completion lengths, the share cut off, throughput and times, the consecutive skipped
    optimizer steps, and `stats` (the trajectory's, the rewards' own metrics) as `train/...`; those already
    named `rollout/...` (the sampler/scorer gap, the rollout engine's speed and counters) keep their name."""
    rewards, rollout = trajectory.rewards, trajectory.rollout  # [B]
    lengths = rollout.model_mask.sum(dim=1).float()  # [B] the model's tokens, as TRL counts them
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
        "train/skipped_steps": torch.tensor(float(skipped_steps)),
    }
    for i, name in enumerate(reward_names):
        metrics[f"train/rewards/{name}"] = trajectory.rewards_per_func[:, i].nanmean()
    for key, value in stats.items():
        metrics[key if key.startswith("rollout/") else f"train/{key}"] = value
    return {k: v.detach().float() for k, v in metrics.items()}


def log_training_step(
    module: L.LightningModule, rollout: dict[str, Tensor], updates: UpdateRows, batch_size: int
) -> None:
    """Write a training step's metrics to the loggers, one row per optimizer step at its index (the
    optimizer steps before it, counted from 0 as Lightning numbers its steps; transformers writes the
    index + 1), every `log_every_n_steps` optimizer steps as TRL's `logging_steps`; the `rollout` metrics
    once, in the first row of its optimizer steps that is written (none written: none). The callbacks and
    the progress bar see the rollout's metrics and its last optimizer step's (`callback_metrics`).

    One optimizer step at Lightning's own step (the default, one per rollout): Lightning writes it, in one
    row with the other metrics of the training step (`monitor/...`)."""
    trainer, device = module.trainer, module.device
    latest = {**rollout, **updates[-1][1]}  # a training step makes one optimizer step at least
    # Decided by the run, not by the step: Lightning refuses a key logged with other arguments later on, and
    # a skipped (non-finite) update leaves a step whose row index is not Lightning's.
    by_lightning = module.grpo.update.optimizer_steps_per_batch == 1
    logger = None if by_lightning else False  # None: Lightning's default, the loggers if there are any
    module.log_dict({k: v.to(device) for k, v in latest.items()}, logger=logger, batch_size=batch_size)
    module.log(
        "reward", latest["train/reward"].to(device), prog_bar=True, logger=False, batch_size=batch_size
    )
    every, first = trainer.log_every_n_steps, module.grpo.run.logging_first_step
    epoch = torch.tensor(float(trainer.current_epoch))
    regular = [step for step, _ in updates if every and (step + 1) % every == 0]
    if by_lightning:
        (step, _), lightning_writes = updates[-1], bool(regular)
        if first and step == 0 and not lightning_writes:  # TRL's logging_first_step
            trainer._logger_connector.log_metrics({**latest, "epoch": epoch}, step=0)
        return
    rows = [(step, metrics) for step, metrics in updates if step in regular or (first and step == 0)]
    for i, (step, metrics) in enumerate(rows):
        written = {**(rollout if i == 0 else {}), **metrics, "epoch": epoch}
        # Lightning's own writer (every logger, `trainer.logged_metrics`), at a step of our choosing: one
        # `self.log` per training step keeps only the last of several values of a key.
        trainer._logger_connector.log_metrics(written, step=step)


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
    completion_lengths: Tensor  # [N*G] the model's tokens, EOS included
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
            completion_lengths=rollout.model_mask.sum(dim=1).cpu(),
            truncated=rollout.truncated.cpu(),
            num_generations=trajectory.num_generations,
            entropy=entropy,
            extra=extra,
        )
