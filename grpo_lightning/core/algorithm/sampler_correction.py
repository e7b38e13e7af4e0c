"""The sampler/scorer gap: how far the rollout engine's log-probs are from the ones the loss scores, and the
truncated importance-sampling correction for it.

The loss assumes the completions were drawn from the policy it scores (`pi_old`, the log-probs of the
policy before the update). The rollout engine draws them from `pi_sampler`, which differs wherever
sampling does not compute exactly as scoring does: another precision or kernel (an inference copy, a KV
cache decoded token by token), top-k/top-p truncation, `min_new_tokens`. Yao et al. 2025 ("Your efficient
RL framework secretly brings you off-policy RL training", fengyao.notion.site/off-policy-rl) show that
this gap biases the policy gradient, and correct it with truncated importance sampling (TIS): each
token's loss is weighted by

    w_t = min(pi_old(y_t) / pi_sampler(y_t), C)        (detached; C the cap)

which makes the expectation over the sampler's tokens that over `pi_old`'s, up to the truncation, whose
bias is bounded by the cap while the variance stays bounded too. TRL applies it by default with vLLM
(`vllm_importance_sampling_correction`, mode "token_truncate", cap `vllm_importance_sampling_clip_max`),
verl as an option (`algorithm.rollout_is` with `rollout_is_level: token`, `rollout_is_mode: truncate`,
`rollout_is_threshold`). Pure tensor maths here; `grpo_loss` applies the weights.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

LOGP_GAP_THRESHOLD = 0.1  # |log pi_old - log pi_sampler| above which a token counts in logp_gap_frac_above


def truncated_importance_weights(scorer_logprobs: Tensor, sampler_logprobs: Tensor, cap: float) -> Tensor:
    """`min(exp(scorer - sampler), cap)` per token `[B, T]`, detached (Yao et al. 2025's TIS weight).

    Args:
        scorer_logprobs: `[B, T]` the sampled tokens' log-probs under the policy the loss takes as `pi_old`.
        sampler_logprobs: `[B, T]` the same tokens' log-probs under the distribution they were drawn from.
        cap: the truncation C, > 0.
    """
    log_ratio = (scorer_logprobs.detach() - sampler_logprobs).clamp(max=math.log(cap))
    return log_ratio.exp()  # [B, T] clamped in log space: no overflow before the cap


def logprob_gap_stats(
    scorer_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor, cap: float | None = None
) -> dict[str, Tensor]:
    """How far the sampler's log-probs are from the scorer's on the `mask`ed tokens: `rollout/logp_gap_mean`
    and `_max` of |scorer - sampler|, `rollout/logp_gap_frac_above` (the share above
    `LOGP_GAP_THRESHOLD`), and with a `cap` the TIS weights' mean and the share truncated at it."""
    mask = mask.bool()  # [B, T]
    gap = (scorer_logprobs.detach() - sampler_logprobs).abs().float()  # [B, T]
    gap = torch.where(mask, gap, torch.zeros((), device=gap.device))  # padding counts nowhere, even NaN
    tokens = mask.sum().clamp(min=1)
    stats = {
        "rollout/logp_gap_mean": gap.sum() / tokens,
        "rollout/logp_gap_max": gap.max() if gap.numel() else gap.new_zeros(()),
        "rollout/logp_gap_frac_above": ((gap > LOGP_GAP_THRESHOLD) & mask).sum() / tokens,
    }
    if cap is not None:
        weights = truncated_importance_weights(scorer_logprobs, sampler_logprobs, cap)  # [B, T]
        stats["rollout/is_weight_mean"] = torch.where(mask, weights, 0.0).sum() / tokens
        stats["rollout/is_weight_frac_capped"] = ((weights >= cap) & mask).sum() / tokens
    return stats
