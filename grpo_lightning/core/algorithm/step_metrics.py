"""The metrics one GRPO training step logs under `train/`, from its trajectory and its update."""

from __future__ import annotations

import torch
from torch import Tensor

from grpo_lightning.core.types import Trajectory


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
