"""The sampler/scorer gap and its importance-sampling correction (Yao et al. 2025; TRL's
``vllm_importance_sampling_mode``): how far the rollout engine's log-probs are from the ones the loss
scores, and the weights that correct for it.

The loss assumes the completions were drawn from the policy it scores (`pi_old`, the log-probs of the
policy before the update). The rollout engine draws them from `pi_sampler`, which differs wherever
sampling does not compute exactly as scoring does: another precision or kernel (an inference copy, a KV
cache decoded token by token), top-k/top-p truncation, `min_new_tokens`. Yao et al. 2025 ("Your efficient
RL framework secretly brings you off-policy RL training", fengyao.notion.site/off-policy-rl) show that
this gap biases the policy gradient, and correct it with truncated importance sampling (TIS): each
token's loss is weighted by

    w_t = min(pi_old(y_t) / pi_sampler(y_t), C)        (detached; C the cap)

which makes the expectation over the sampler's tokens that over `pi_old`'s, up to the truncation, whose
bias is bounded by the cap while the variance stays bounded too. This is TRL's mode "token_truncate"
(`vllm_importance_sampling_correction` with `vllm_importance_sampling_mode="token_truncate"`, cap
`vllm_importance_sampling_clip_max`); TRL corrects by default with vLLM only, and then in mode
"sequence_mask" (a sequence's ratio, the exp of its summed log-ratio, weighs all its tokens, and a
sequence whose ratio is outside [clip_min, clip_max] is dropped). verl has this mode as an option
(`algorithm.rollout_is` with `rollout_is_level: token`, `rollout_is_mode: truncate`,
`rollout_is_threshold`). Pure tensor maths here; `grpo_loss` applies the weights.
"""

import math
from dataclasses import dataclass
from typing import Annotated, Literal

import torch
from torch import Tensor

from grpo_lightning.core.algorithm.loss import MAX_LOG_RATIO
from grpo_lightning.core.options import Alias, Choices, Range, check_fields

LOGP_GAP_THRESHOLD = 0.1  # |log pi_old - log pi_sampler| above which a token counts in logp_gap_frac_above


def _bounded_by_truncation(log_ratio: Tensor, floor: float | None, cap: float | None) -> Tensor:
    """The ratio clipped into [floor, cap] (in log space: no overflow before the cap)."""
    low = None if floor is None else math.log(floor)
    high = None if cap is None else math.log(cap)
    return log_ratio.clamp(min=low, max=high).exp()


def outside_bounds(log_ratio: Tensor, floor: float | None, cap: float | None) -> Tensor:
    """Where the ratio lies outside [floor, cap], judged on its log before any bounding: a weight truncated
    at the cap can round to one float step below it, so the truncated weights cannot say which were cut."""
    outside = torch.zeros_like(log_ratio, dtype=torch.bool)
    if cap is not None:
        outside |= log_ratio > math.log(cap)
    if floor is not None:
        outside |= log_ratio < (math.log(floor) if floor > 0 else -math.inf)
    return outside


def _bounded_by_mask(log_ratio: Tensor, floor: float | None, cap: float | None) -> Tensor:
    """The ratio where it lies in [floor, cap], 0 outside (the token or sequence drops out of the loss)."""
    ratio = log_ratio.clamp(max=MAX_LOG_RATIO).exp()
    return ratio.masked_fill(outside_bounds(log_ratio, floor, cap), 0.0)


# TRL's `vllm_importance_sampling_mode`: the ratio pi_old / pi_sampler per token or per sequence (the
# product over its tokens, applied to each of them), truncated into [floor, cap] or masked outside it.
IMPORTANCE_SAMPLING_MODES = Choices(
    "importance_sampling_mode",
    {
        "token_truncate": (False, _bounded_by_truncation),
        "token_mask": (False, _bounded_by_mask),
        "sequence_truncate": (True, _bounded_by_truncation),
        "sequence_mask": (True, _bounded_by_mask),
    },
)
ImportanceSamplingMode = Literal[tuple(IMPORTANCE_SAMPLING_MODES)]


def importance_log_ratios(
    scorer_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor, mode: str
) -> Tensor:
    """`[B, T]` the log of the ratio pi_old / pi_sampler that `mode` (`IMPORTANCE_SAMPLING_MODES`) bounds:
    each token's, or its sequence's (the sum over the `mask`ed tokens) on each of its tokens."""
    per_sequence, _ = IMPORTANCE_SAMPLING_MODES[mode]
    log_ratio = (scorer_logprobs.detach() - sampler_logprobs) * mask  # [B, T]
    if per_sequence:
        log_ratio = log_ratio.sum(dim=-1, keepdim=True)  # [B, 1]
    return log_ratio.expand_as(scorer_logprobs)  # [B, T]


def importance_weights(
    scorer_logprobs: Tensor,
    sampler_logprobs: Tensor,
    mask: Tensor,
    mode: str = "token_truncate",
    cap: float | None = 2.0,
    floor: float | None = None,
) -> tuple[Tensor, Tensor]:
    """The detached per-token weights `[B, T]` of the sampler correction in `mode`
    (`IMPORTANCE_SAMPLING_MODES`; token_truncate with no floor is TIS's `min(pi_old / pi_sampler, cap)`), and
    where
    the bounds changed them (`outside_bounds`, `[B, T]` bool).

    Args:
        scorer_logprobs / sampler_logprobs: `[B, T]` the sampled tokens' log-probs under pi_old and the
            sampler.
        mask: `[B, T]` the tokens that count (a sequence's ratio is the product over them).
        cap / floor: the bounds of the ratio; None: unbounded on that side.
    """
    _, bound = IMPORTANCE_SAMPLING_MODES[mode]
    log_ratio = importance_log_ratios(scorer_logprobs, sampler_logprobs, mask, mode)  # [B, T]
    return bound(log_ratio, floor, cap), outside_bounds(log_ratio, floor, cap)


def decoupled_weights(
    proximal_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor
) -> tuple[Tensor, Tensor]:
    """AReaL's decoupled PPO weights (Fu et al. 2025, arXiv:2505.24298 eq. 5): each token's policy term,
    clipped around the proximal policy pi_prox (the weights the update starts from, `old_logprobs`), is
    weighted by pi_prox / pi_behaviour (the policy that sampled it), unbounded (up to `MAX_LOG_RATIO` in log
    space, against overflow), detached; 0 outside `mask`. With nothing bounded."""
    log_ratio = (proximal_logprobs.detach() - behaviour_logprobs).clamp(
        -MAX_LOG_RATIO, MAX_LOG_RATIO
    )  # [B, T]
    weights = torch.where(mask.bool(), log_ratio.exp(), torch.zeros((), device=log_ratio.device))  # [B, T]
    return weights, torch.zeros_like(weights, dtype=torch.bool)


def logprob_gap_stats(
    scorer_logprobs: Tensor,
    sampler_logprobs: Tensor,
    mask: Tensor,
    correction: tuple[Tensor, Tensor] | None = None,
) -> dict[str, Tensor]:
    """How far the sampler's log-probs are from the scorer's on the `mask`ed tokens: `rollout/logp_gap_mean`
    and `_max` of |scorer - sampler|, `rollout/logp_gap_frac_above` (the share above
    `LOGP_GAP_THRESHOLD`), and with the correction's `(weights, bounded)` (`importance_weights`) the
    weights' mean and the share the bounds changed (truncated at the cap, or masked to 0), judged before
    bounding, and their min and max."""
    mask = mask.bool()  # [B, T]
    gap = (scorer_logprobs.detach() - sampler_logprobs).abs().float()  # [B, T]
    gap = torch.where(mask, gap, torch.zeros((), device=gap.device))  # padding counts nowhere, even NaN
    tokens = mask.sum().clamp(min=1)
    stats = {
        "rollout/logp_gap_mean": gap.sum() / tokens,
        "rollout/logp_gap_max": gap.max() if gap.numel() else gap.new_zeros(()),
        "rollout/logp_gap_frac_above": ((gap > LOGP_GAP_THRESHOLD) & mask).sum() / tokens,
    }
    if correction is not None:
        weights, bounded = correction  # [B, T] each
        stats["rollout/is_weight_mean"] = torch.where(mask, weights, 0.0).sum() / tokens
        counted = weights[mask] if mask.any() else weights.new_ones(1)  # [N]
        stats["rollout/is_weight_min"], stats["rollout/is_weight_max"] = counted.min(), counted.max()
        stats["rollout/is_weight_frac_capped"] = (bounded & mask).sum() / tokens
    return stats


@dataclass(frozen=True)
class SamplerCorrectionOptions:
    """The sampler correction (`GRPOConfig.sampler_correction`, None: off; the flat switch
    `importance_sampling_correction: true` turns it on): correct for the rollout engine's sampler not being
    the policy the loss scores, weighting each token's policy term by the ratio pi_old / pi_sampler, bounded
    by `mode` (truncated importance sampling, TIS: Yao et al. 2025, "Your efficient RL framework secretly
    brings you off-policy RL training"; `importance_weights`). pi_sampler is each token's log-prob as it was
    drawn (after temperature, top-k/top-p, min_completion_length), pi_old the scorer's before the update;
    where they are equal nothing changes. Every step logs the gap (`rollout/logp_gap_mean`, `_max`,
    `_frac_above`), and with the correction `rollout/is_weight_mean` and `_frac_capped`. Off by default:
    both engines sample the policy they score up to rounding, and on the demo the correction learned no
    better (BENCHMARKS.md, "The demo in bf16-mixed"). Turn it on where `rollout/logp_gap_frac_above` is
    material, or with top_p/top_k/min_completion_length, whose truncation is a gap by design. TRL:
    `vllm_importance_sampling_correction` (TRL corrects by default with vLLM only, in mode
    "sequence_mask"); verl: `algorithm.rollout_is` with `rollout_is_level: token`, `rollout_is_mode:
    truncate`.
    """

    mode: Annotated[ImportanceSamplingMode, Alias("importance_sampling_mode")] = "token_truncate"
    """How the ratio pi_old / pi_sampler is bounded, as TRL's `vllm_importance_sampling_mode`:
    "token_truncate" (each token's ratio clipped into [floor, cap], Yao et al.'s TIS), "token_mask" (a token
    whose ratio is outside drops out of the loss), "sequence_truncate" / "sequence_mask" (one ratio per
    completion, the product over its tokens, clipped, or the whole completion dropped; TRL's default with
    vLLM is "sequence_mask").
    """
    cap: Annotated[
        float, Range(">= 1", why="below 1 it shrinks on-policy tokens"), Alias("importance_sampling_cap")
    ] = 2.0
    """The upper bound C of the ratio; 2.0 as Yao et al. 2025 (TRL's `vllm_importance_sampling_clip_max`
    defaults to 3.0, verl's `rollout_is_threshold` to 2.0).
    """
    floor: Annotated[Annotated[float, Range("> 0, <= 1")] | None, Alias("importance_sampling_floor")] = None
    """The lower bound of the ratio (a floor for the truncate modes, below it masked for the mask modes);
    None: no lower bound. TRL: `vllm_importance_sampling_clip_min`.
    """

    def __post_init__(self) -> None:
        check_fields(self)
