"""One optimizer update on a `Trajectory`, in pieces that need no Lightning.

- `mini_batches`: the trajectories of one rollout's optimizer steps (`grpo.steps_per_generation`), and
  `mini_batch_denominators`, what each normalises its loss by.
- `micro_batch_loss`: the GRPO loss (`loss.grpo_loss`) of some rows of a trajectory, with the whole
  mini-batch's denominators, so that the micro-batch losses add up to the mini-batch's, and the
  sampler/scorer gap of its tokens (truncated importance weights where asked, `sampler_correction`);
  `accumulate_gradients` runs the policy pass and backward micro-batch by micro-batch.
- `MicroBatchSums`: the statistics of an update's micro-batches, weighted by their token share.
- `StepGuard`: the optimizer step, skipped when the loss or the gradient is not finite (a run stops after
  `max_bad_steps` such steps in a row) or when fp16 gradients overflowed (the loss scaler lowers its scale).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from grpo_lightning.core.algorithm.batching import MicroBatch, Score, group_rows, shuffled_mini_batches
from grpo_lightning.core.algorithm.loss import grpo_loss
from grpo_lightning.core.algorithm.sampler_correction import logprob_gap_stats, truncated_importance_weights
from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.types import Trajectory


def mini_batches(
    trajectory: Trajectory, steps: int, generator: torch.Generator | None = None
) -> list[Trajectory]:
    """The trajectories of `steps` optimizer steps on one rollout: its groups shuffled (from `generator`,
    None: torch's default CPU generator, which checkpoints keep) and cut into `steps` mini-batches of whole
    groups (`batching.shuffled_mini_batches`). One step: the trajectory itself, nothing drawn."""
    if steps == 1:
        return [trajectory]
    G = trajectory.num_generations
    cut = shuffled_mini_batches(trajectory.rewards.numel() // G, steps, generator)
    return [trajectory.select(group_rows(groups, G)) for groups in cut]


def mini_batch_denominators(
    mini_batch: Trajectory, sum_over_ranks: Callable[[Tensor], Tensor], world_size: int
) -> tuple[Tensor, Tensor]:
    """`(total_tokens, total_sequences)` that one optimizer step's loss is normalised by: the loss tokens
    of its mini-batch on every rank, divided by the world size (DDP averages the ranks' gradients), and
    this rank's sequences in it. Per optimizer step, as TRL and verl normalise each mini-batch."""
    mask = mini_batch.loss_mask  # [b, T]
    total_tokens = sum_over_ranks(mask.sum()) / world_size
    return total_tokens, torch.tensor(float(mask.size(0)), device=mask.device)


def micro_batch_loss(
    trajectory: Trajectory,
    rows: slice,
    logprobs: Tensor,
    entropies: Tensor,
    cfg: GRPOConfig,
    total_tokens: Tensor,
    total_sequences: Tensor,
) -> tuple[Tensor, dict[str, Tensor]]:
    """`grpo_loss` of `trajectory`'s `rows` given the policy's `logprobs` / `entropies` `[b, T]` there,
    normalised by `total_tokens` / `total_sequences` (`mini_batch_denominators`). With the sampler's
    log-probs, the statistics hold the gap to the scorer's, pi_old: the rollout-time log-probs, or with one
    optimizer step per rollout the policy's own (the same weights), so the gap costs no extra pass; with
    `importance_sampling_correction` the loss weights each token by `truncated_importance_weights`."""
    t = trajectory
    old_logprobs = None if t.old_logprobs is None else t.old_logprobs[rows]  # [b, T]
    weights, gap = None, {}
    if t.rollout.sampler_logprobs is not None:
        scorer = old_logprobs if old_logprobs is not None else logprobs.detach()  # [b, T] pi_old
        sampler = t.rollout.sampler_logprobs[rows]  # [b, T]
        cap = cfg.importance_sampling_cap if cfg.importance_sampling_correction else None
        gap = logprob_gap_stats(scorer, sampler, t.loss_mask[rows], cap)
        if cap is not None:
            weights = truncated_importance_weights(scorer, sampler, cap)  # [b, T]
    loss, stats = grpo_loss(
        logprobs,
        t.token_advantages[rows],
        t.loss_mask[rows],
        old_logprobs=old_logprobs,
        ref_logprobs=None if t.ref_logprobs is None else t.ref_logprobs[rows],
        loss_type=cfg.loss_type,
        importance_sampling_level=cfg.importance_sampling_level,
        epsilon=cfg.epsilon,
        epsilon_high=cfg.epsilon_high,
        delta=cfg.delta,
        beta=0.0 if cfg.use_kl_in_reward else cfg.beta,  # else the KL is in the rewards already
        kl_estimator=cfg.kl_estimator,
        max_completion_length=cfg.max_completion_length,
        entropies=entropies,
        entropy_coef=cfg.entropy_coef,
        total_tokens=total_tokens,
        total_sequences=total_sequences,
        importance_weights=weights,
    )
    return loss, {**stats, **gap}


def micro_batch_trajectory(trajectory: Trajectory, rows: MicroBatch) -> tuple[Trajectory, slice]:
    """The trajectory a micro-batch's loss reads and its rows there: `trajectory` itself for a slice; for
    indices, their own trajectory trimmed to their longest row (`Trajectory.select`), all of its rows."""
    if isinstance(rows, slice):
        return trajectory, rows
    return trajectory.select(rows, trim=True), slice(None)


def accumulate_gradients(
    score: Score,
    policy: torch.nn.Module,
    trajectory: Trajectory,
    parts: list[MicroBatch],
    cfg: GRPOConfig,
    total_tokens: Tensor,
    total_sequences: Tensor,
    backward: Callable[[Tensor], None] = Tensor.backward,
) -> MicroBatchSums:
    """The policy pass and `backward` of each micro-batch of `trajectory` (`batching.micro_batches`): the
    gradients of its whole loss, accumulated; the loss and statistics summed over the micro-batches."""
    sums = MicroBatchSums()
    tokens = trajectory.loss_mask.sum().clamp(min=1)
    for rows in parts:
        part, part_rows = micro_batch_trajectory(trajectory, rows)
        logprobs, entropies = score(policy, part.rollout, part_rows, with_entropy=True)  # [b, T'] each
        loss, stats = micro_batch_loss(
            part, part_rows, logprobs, entropies, cfg, total_tokens, total_sequences
        )
        backward(loss)
        sums.add(loss, stats, token_share=part.loss_mask[part_rows].sum() / tokens)
    return sums


class MicroBatchSums:
    """An update's loss and statistics over its micro-batches.

    The micro-batch losses are shares of the rollout's (whole-rollout denominators): they add up, as does
    `policy_loss`. Maxima take the largest; the other statistics are micro-batch means, weighted by the
    micro-batch's token share.
    """

    ADDED = ("policy_loss",)
    MAXED = ("rollout/logp_gap_max",)

    def __init__(self) -> None:
        self.values: dict[str, Tensor] = {}

    def add(self, loss: Tensor, stats: dict[str, Tensor], token_share: Tensor) -> None:
        self.values["loss"] = self.values.get("loss", 0.0) + loss.detach()
        for key, value in stats.items():
            if key in self.MAXED:
                self.values[key] = torch.maximum(self.values[key], value) if key in self.values else value
            else:
                self.values[key] = self.values.get(key, 0.0) + (
                    value if key in self.ADDED else value * token_share
                )

    @property
    def loss(self) -> Tensor:
        return self.values["loss"]


class StepGuard:
    """Takes the optimizer step unless the update is not finite; counts consecutive skipped steps."""

    def __init__(self, max_bad_steps: int) -> None:
        self.max_bad_steps = max_bad_steps
        self.bad_steps = 0  # consecutive non-finite steps, kept in checkpoints

    def step(
        self, optimizer: torch.optim.Optimizer, loss: Tensor, grad_norm: Tensor, scaled: bool, step: int
    ) -> bool:
        """Step `optimizer` (whose gradients were clipped to `grad_norm`) when the update is finite; True
        when the weights changed. `scaled`: a 16-mixed loss scaler wraps the optimizer."""
        if scaled and torch.isfinite(loss) and not torch.isfinite(grad_norm):
            optimizer.step()  # the scaler sees the overflow: it skips the update and lowers the loss scale
            warnings.warn(f"step {step}: fp16 gradients overflowed, update skipped", stacklevel=3)
            return False
        if not (torch.isfinite(loss) and torch.isfinite(grad_norm)):
            optimizer.zero_grad()
            self.bad_steps += 1
            warnings.warn(f"step {step}: loss or gradient not finite, update skipped", stacklevel=3)
            if self.bad_steps >= self.max_bad_steps:
                raise FloatingPointError(
                    f"{self.bad_steps} consecutive steps with a non-finite loss or gradient (max_bad_steps="
                    f"{self.max_bad_steps}): lower the learning rate, or check the rewards and the model's "
                    "dtype"
                )
            return False
        self.bad_steps = 0
        optimizer.step()
        return True
