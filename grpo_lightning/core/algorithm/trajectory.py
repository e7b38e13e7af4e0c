"""`Trajectory`: one object from rollout to loss, and `build_trajectory`, the pure function that makes it.

A training step samples and scores completion groups (a `ScoredGroups`), computes the reference and
old-policy log-probs, and then `build_trajectory` turns them into what the loss needs: the loss mask, the
outcome (the rewards, with the KL charged to them when `use_kl_in_reward`), the group-relative advantages
and, with step credit, per-token advantages. No Lightning and no model here: the module passes a gather
function for the one decision that needs the other ranks (`scale_rewards="batch"`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields

from torch import Tensor
from transformers import PreTrainedTokenizerBase

from grpo_lightning.core.algorithm.credit import step_credit_penalties
from grpo_lightning.core.algorithm.loss import group_advantages, kl_in_reward
from grpo_lightning.core.algorithm.sampler_correction import logprob_gap_stats
from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.types import Rollout, ScoredGroups, Trajectory

# Everyone's `[sum of B]` rewards and where this rank's `[B]` start in them (scale_rewards="batch").
GatherRewards = Callable[[Tensor], tuple[Tensor, int]]


def loss_mask(rollout: Rollout, mask_truncated_completions: bool) -> Tensor:
    """`[B, T]` float: the completion tokens, without the completions that never stopped when asked (DAPO
    sec. 3.4, overlong filtering)."""
    mask = rollout.completion_mask.float()  # [B, T]
    if mask_truncated_completions:
        mask = mask * (~rollout.truncated).float()[:, None]
    return mask


def advantages_of(outcome: Tensor, cfg: GRPOConfig, gather: GatherRewards | None = None) -> Tensor:
    """Group-relative advantages `[B]` of this rank's outcome. With `gather` (scale_rewards="batch" over
    several ranks) the std is that of the whole batch over all ranks, as TRL computes it."""
    args = (cfg.num_generations, cfg.scale_rewards, cfg.baseline, cfg.advantage_clip)
    if gather is None:
        return group_advantages(outcome, *args)  # [B]
    everyone, start = gather(outcome)  # [sum of B]
    return group_advantages(everyone, *args)[start : start + outcome.numel()]  # [B]


def build_trajectory(
    scored: ScoredGroups,
    cfg: GRPOConfig,
    *,
    old_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    gather: GatherRewards | None = None,
    stats: dict[str, Tensor] | None = None,
) -> Trajectory:
    """The trajectory of `scored`'s groups: loss mask, KL in the reward (verl's `use_kl_in_reward`, needs
    `old_logprobs` and `ref_logprobs`), group advantages (DeepSeekMath arXiv:2402.03300 sec. 4.1.2) and
    step credit (`credit.step_credit_penalties`, needs the `tokenizer`). `stats` are earlier metrics of the
    step (dynamic sampling's), extended with those of the options used here, and with `old_logprobs` and
    the sampler's, the gap between them over the whole rollout (`sampler_correction.logprob_gap_stats`; one
    update per rollout measures it in the loss instead, which then has the scorer's log-probs)."""
    rollout, rewards = scored.rollout, scored.rewards  # rewards: [B]
    stats = dict(stats or {})
    outcome = rewards  # [B]
    if cfg.use_kl_in_reward:
        outcome = kl_in_reward(
            rewards, old_logprobs, ref_logprobs, rollout.completion_mask, cfg.beta, cfg.kl_estimator
        )  # [B]
        stats["kl_reward_penalty"] = (rewards - outcome).mean()
    advantages = advantages_of(outcome, cfg, gather)  # [B]
    token_advantages = advantages  # [B], or [B, T] with step credit
    if cfg.step_credit > 0:
        penalties = step_credit_penalties(
            tokenizer, rollout.completion_ids, rollout.completion_mask, cfg.step_credit
        )  # [B, T]
        token_advantages = advantages[:, None] + penalties  # [B, T]
        stats["step_credit/frac_tokens"] = (penalties < 0).sum() / rollout.completion_mask.sum()
    mask = loss_mask(rollout, cfg.mask_truncated_completions)  # [B, T]
    if old_logprobs is not None and rollout.sampler_logprobs is not None:
        cap = cfg.importance_sampling_cap if cfg.importance_sampling_correction else None
        stats.update(logprob_gap_stats(old_logprobs, rollout.sampler_logprobs, mask, cap))
    return Trajectory(
        **{f.name: getattr(scored, f.name) for f in fields(ScoredGroups)},  # what the groups hold
        loss_mask=mask,
        old_logprobs=old_logprobs,
        ref_logprobs=ref_logprobs,
        advantages=advantages,
        token_advantages=token_advantages,
        stats=stats,
    )
