"""What each training step logs and sampled: `training_step_metrics` are the `train/...` metrics a step logs;
`GRPOModule` leaves a `RolloutRecord` (what the step sampled and scored) in `last_rollout`, which the
callbacks of `training.monitors` read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import lightning as L
import torch
from torch import Tensor

from grpo_lightning.core.types import Trajectory

__all__ = [
    "RolloutRecord",
    "logging_step",
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
