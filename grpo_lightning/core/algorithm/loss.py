"""GRPO advantages, KL penalties (in the loss, or charged to the reward) and clipped policy-gradient losses.

Pure tensor maths (only ``torch``): nothing here knows about models, tokenizers or Lightning. The numbers
match TRL 1.16's ``GRPOTrainer`` for a single process without gradient accumulation, with two additions:
the loss denominators can be set to batch-wide totals so that micro-batches sum to the full-batch loss,
and the log-ratios are clamped before every ``exp`` so that no ``inf`` or ``NaN`` can appear.

References:
    - GRPO: Shao et al., "DeepSeekMath", arXiv:2402.03300, eq. 3.
    - DAPO (clip-higher, token-level normalisation): Yu et al., arXiv:2503.14476.
    - Dr. GRPO (no std scaling, constant normaliser): Liu et al., arXiv:2503.20783.
    - GSPO (sequence-level importance ratio): Zheng et al., arXiv:2507.18071.
    - CISPO (clipped, detached importance weights): MiniMax-M1, arXiv:2506.13585.
    - Two-sided clipping ``delta``: INTELLECT-2, arXiv:2505.07291.
    - KL estimators k1/k2/k3: J. Schulman, "Approximating KL divergence", 2020.
    - The KL term weighted by the importance ratio (``use_bias_correction_kl``): DeepSeek-V3.2,
      arXiv:2512.02556 (TRL's ``use_bias_correction_kl``).
    - KL in the reward (``kl_in_reward``): verl's ``algorithm.use_kl_in_reward`` (``apply_kl_penalty``).
    - Leave-one-out baseline: RLOO, Ahmadian et al., arXiv:2402.14740.
    - Truncated importance sampling of the sampler (``importance_weights``): Yao et al. 2025, "Your
      efficient RL framework secretly brings you off-policy RL training" (``truncated_importance_weights``,
      below).
"""

import math
from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

from grpo_lightning.core.options import Choices

STD_EPS = 1e-4  # added to the reward std before dividing, as in TRL
MAX_LOG_RATIO = 20.0  # bound on |log-ratio| before exp in the importance ratio
CISPO_EPSILON_HIGH = 5.0  # cispo's cap of the IS weight when epsilon_high is unset: TRL's recommended value


# k1 = log pi - log pi_ref has the gradient grad log pi, of mean zero under the policy: in the loss it
# regularises nothing. Refused by `GRPOConfig` and `grpo_loss` alike, with this reason.
K1_IN_LOSS = (
    "in the loss (beta > 0 without use_kl_in_reward) its gradient, grad log pi, has mean zero: it "
    "regularises nothing. Use 'k3' (with use_bias_correction_kl, the reverse KL's gradient) or 'k2' in the "
    "loss, or keep k1 and move the KL into the reward (use_kl_in_reward: true, as verl)"
)

# The registries of the string arguments below: each choice set is a registry's keys, declared once here;
# `GRPOConfig` types its options with the `Literal`s made of them.

# What each centred reward `[N, G]` is divided by: the group's std (GRPO), the batch's (REINFORCE++), none
# (Dr. GRPO). Unbiased stds, with STD_EPS added.
REWARD_SCALES: Choices[Callable[[Tensor], Tensor | float]] = Choices(
    "scale",
    {
        "group": lambda grouped: grouped.std(dim=1, keepdim=True) + STD_EPS,  # [N, 1]
        "batch": lambda grouped: grouped.view(-1).std() + STD_EPS,  # 0-d
        "none": lambda grouped: 1.0,
    },
)
# The factor of the centred reward for a group of G: the group mean as baseline (GRPO), or the mean of the
# G - 1 others (RLOO), r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mean).
BASELINES: Choices[Callable[[int], float]] = Choices(
    "baseline", {"mean": lambda group_size: 1.0, "loo": lambda group_size: group_size / (group_size - 1)}
)
# Per-token KL estimates from log r = log pi_ref - log pi (Schulman 2020); k3 is DeepSeekMath eq. 4's.
KL_ESTIMATORS: Choices[Callable[[Tensor], Tensor]] = Choices(
    "kl_estimator",
    {
        "k1": lambda log_ratio: -log_ratio,
        "k2": lambda log_ratio: 0.5 * log_ratio**2,
        "k3": lambda log_ratio: torch.exp(log_ratio) - log_ratio - 1,
    },
)
ScaleRewards = Literal[tuple(REWARD_SCALES)]
Baseline = Literal[tuple(BASELINES)]
KLEstimator = Literal[tuple(KL_ESTIMATORS)]
# `LOSS_TYPES` (each a surrogate and an aggregation) and `IMPORTANCE_SAMPLING_LEVELS` follow `grpo_loss`'s
# helpers below.


def group_advantages(
    rewards: Tensor,
    group_size: int,
    scale: ScaleRewards = "group",
    baseline: Baseline = "mean",
    clip: float | None = None,
) -> Tensor:
    """Group-relative advantages, one per completion (DeepSeekMath arXiv:2402.03300, section 4.1.2).

    Args:
        rewards: ``[N * G]`` scalar rewards, the ``G = group_size`` completions of each prompt contiguous.
        group_size: completions per prompt, at least 2.
        scale: ``"group"`` divides by the group's reward std (GRPO), ``"batch"`` by the std of all rewards,
            ``"none"`` only centres (Dr. GRPO, arXiv:2503.20783). Stds are unbiased and get ``1e-4`` added.
        baseline: ``"mean"`` subtracts the group mean (GRPO); ``"loo"`` subtracts the mean of the other
            ``G - 1`` rewards of the group (RLOO, arXiv:2402.14740), i.e. ``G / (G - 1) * (r_i - mean)``.
        clip: if given, advantages are clamped to ``[-clip, clip]``.

    Returns:
        ``[N * G]`` advantages. A group whose rewards are all equal gets exactly 0.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N * group_size], got shape {tuple(rewards.shape)}.")
    if group_size < 2:
        raise ValueError(f"group_size must be at least 2, got {group_size}.")
    if rewards.numel() % group_size != 0:
        raise ValueError(f"rewards.numel()={rewards.numel()} is not divisible by group_size={group_size}.")
    if not torch.isfinite(rewards).all():
        raise ValueError(f"rewards contain non-finite values: {rewards.tolist()}.")
    if clip is not None and clip <= 0:
        raise ValueError(f"clip must be positive, got {clip}.")

    loo_factor, std = BASELINES[baseline], REWARD_SCALES[scale]
    rewards = rewards if rewards.is_floating_point() else rewards.float()
    grouped = rewards.view(-1, group_size)  # [N, G]
    advantages = grouped - grouped.mean(dim=1, keepdim=True)  # [N, G]
    advantages = advantages * loo_factor(group_size) / std(grouped)  # [N, G] / ([N, 1], 0-d or 1.0)

    # Rounding in the mean can leave tiny non-zero values in a constant group: force them to 0.
    constant_group = grouped.amax(dim=1, keepdim=True) == grouped.amin(dim=1, keepdim=True)  # [N, 1]
    advantages = advantages.masked_fill(constant_group, 0.0)  # [N, G]
    if clip is not None:
        advantages = advantages.clamp(-clip, clip)
    return advantages.reshape(-1)  # [N * G]


def kl_penalty(
    logprobs: Tensor, ref_logprobs: Tensor, estimator: KLEstimator = "k3", max_log_ratio: float = 20.0
) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi.

    Estimators from J. Schulman, "Approximating KL divergence" (2020).

    With ``r = pi_ref / pi`` (``log r`` clamped to ``[-max_log_ratio, max_log_ratio]``):
    ``k1 = -log r``, ``k2 = (log r)^2 / 2``, ``k3 = r - log r - 1`` (the estimator of DeepSeekMath eq. 4).
    Each has expectation KL(pi || pi_ref) to first order (k1 and k3 exactly); their gradients in a loss
    differ (see ``grpo_loss``).

    Args:
        logprobs: ``[B, T]`` log-probabilities of the sampled tokens under the policy.
        ref_logprobs: ``[B, T]`` log-probabilities of the same tokens under the reference model.
        estimator: ``"k1"``, ``"k2"`` or ``"k3"``.
        max_log_ratio: bound on ``|log r|`` applied before any ``exp``.

    Returns:
        ``[B, T]`` per-token KL estimates (padding positions are not masked).
    """
    estimate = KL_ESTIMATORS[estimator]
    return estimate((ref_logprobs - logprobs).clamp(-max_log_ratio, max_log_ratio))  # [B, T]


def kl_in_reward(
    rewards: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    beta: float,
    estimator: KLEstimator = "k1",
) -> Tensor:
    """`rewards - beta * sum_t KL_t`: the KL to the reference charged to each completion's reward.

    As verl's `apply_kl_penalty` (`token_level_rewards = token_level_scores - beta * kld`), whose GRPO
    advantage then sums the token-level rewards over the completion. verl's default estimator there is
    `kl_penalty: kl`, i.e. k1 = log pi - log pi_ref.

    Args:
        rewards: `[B]` outcome rewards.
        logprobs: `[B, T]` log-probs of the completion tokens under the sampling policy.
        ref_logprobs: `[B, T]` the same under the reference.
        mask: `[B, T]` non-zero on real completion tokens; padding never counts, even if it holds inf/NaN.
        beta: the KL coefficient.
        estimator: "k1", "k2" or "k3" (see `kl_penalty`).

    Returns:
        `[B]` penalised rewards.
    """
    kl = kl_penalty(logprobs, ref_logprobs, estimator)  # [B, T]
    kl = torch.where(mask.bool(), kl, torch.zeros((), dtype=kl.dtype, device=kl.device))  # [B, T]
    return rewards - beta * kl.sum(dim=-1)  # [B]


def _masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``values`` where ``mask`` is true; padding never contributes, even if it holds inf/NaN."""
    masked = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    return masked.sum() if dim is None else masked.sum(dim)


def _denominator(value: float | Tensor, like: Tensor) -> Tensor:
    """``value`` as a 0-d tensor matching ``like``, clamped to at least 1 so that empty batches give 0."""
    return torch.as_tensor(value, dtype=like.dtype, device=like.device).clamp(min=1.0)


def _stat_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Detached logging mean: masked token mean of ``[B, T]``, plain mean over rows of ``[B, 1]`` (as TRL)."""
    values = values.detach().float()
    if values.shape[-1] == 1:
        return values.sum() / max(values.shape[0], 1)
    return _masked_sum(values, mask) / mask.sum().clamp(min=1)


# The per-token surrogates: (ratio, advantages, logprobs, epsilon, epsilon_high, delta) -> (per-token loss,
# low-clipped, high-clipped), each [B, T] or [B, 1].
def _clipped_surrogate(ratio, advantages, logprobs, epsilon, epsilon_high, delta):
    """PPO's clipped surrogate (DeepSeekMath eq. 3) with DAPO's clip-higher and INTELLECT-2's delta cap."""
    clipped_ratio = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    unclipped_ratio = ratio if delta is None else torch.clamp(ratio, max=delta)
    per_token_loss = -torch.min(unclipped_ratio * advantages, clipped_ratio * advantages)  # [B, T|1]
    is_low_clipped = (ratio < 1 - epsilon) & (advantages < 0)
    is_high_clipped = (ratio > 1 + epsilon_high) & (advantages > 0)
    return per_token_loss, is_low_clipped, is_high_clipped


def _cispo_surrogate(ratio, advantages, logprobs, epsilon, epsilon_high, delta):
    """CISPO (MiniMax-M1): the detached IS weight capped at epsilon_high times A log pi; no low clip."""
    per_token_loss = -torch.clamp(ratio, max=epsilon_high).detach() * advantages * logprobs  # [B, T]
    is_high_clipped = (ratio > epsilon_high) & (advantages > 0)
    return per_token_loss, torch.zeros_like(ratio, dtype=torch.bool), is_high_clipped


# The aggregations: (per-token loss [B, T], mask, token counts [B], total tokens, total sequences,
# max_completion_length) -> the 0-d loss.
def _sequence_mean(per_token_loss, mask, token_counts, num_tokens, num_sequences, max_completion_length):
    """Mean over sequences of each sequence's token mean (DeepSeekMath eq. 3)."""
    sequence_means = _masked_sum(per_token_loss, mask, dim=-1) / token_counts  # [B]
    return sequence_means.sum() / num_sequences


def _token_mean(per_token_loss, mask, token_counts, num_tokens, num_sequences, max_completion_length):
    """Token sum / number of tokens (DAPO eq. 8)."""
    return _masked_sum(per_token_loss, mask) / num_tokens


def _constant_normaliser(per_token_loss, mask, token_counts, num_tokens, num_sequences, max_length):
    """Token sum / (sequences x max_completion_length) (Dr. GRPO)."""
    return _masked_sum(per_token_loss, mask) / (num_sequences * max_length)


LOSS_TYPES = Choices(
    "loss_type",
    {
        "grpo": (_clipped_surrogate, _sequence_mean),
        "bnpo": (_clipped_surrogate, _token_mean),
        "dapo": (_clipped_surrogate, _token_mean),
        "dr_grpo": (_clipped_surrogate, _constant_normaliser),
        "cispo": (_cispo_surrogate, _token_mean),
    },
)
# The log-ratio the importance ratio is taken of: per token, or the sequence's token mean (GSPO).
IMPORTANCE_SAMPLING_LEVELS = Choices(
    "importance_sampling_level",
    {
        "token": lambda log_ratio, mask, token_counts: log_ratio,  # [B, T]
        "sequence": lambda log_ratio, mask, token_counts: (
            _masked_sum(log_ratio, mask, dim=-1) / token_counts
        ).unsqueeze(-1),  # [B, 1]
    },
)
LossType = Literal[tuple(LOSS_TYPES)]
ImportanceSamplingLevel = Literal[tuple(IMPORTANCE_SAMPLING_LEVELS)]


def grpo_loss(
    logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    old_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    loss_type: LossType = "dapo",
    importance_sampling_level: ImportanceSamplingLevel = "token",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    beta: float = 0.0,
    max_completion_length: int | None = None,
    entropies: Tensor | None = None,
    entropy_coef: float = 0.0,
    kl_estimator: KLEstimator = "k3",
    total_tokens: float | Tensor | None = None,
    total_sequences: int | Tensor | None = None,
    importance_weights: Tensor | None = None,
    use_bias_correction_kl: bool = True,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped surrogate policy loss of GRPO and its variants, to be minimised.

    Per token, with importance ratio ``rho = pi / pi_old`` and advantage ``A`` (DeepSeekMath eq. 3)::

        l = -min(rho * A, clamp(rho, 1 - epsilon, 1 + epsilon_high) * A) + beta * KL

    ``epsilon_high > epsilon`` is DAPO's clip-higher (arXiv:2503.14476). ``delta`` additionally caps ``rho``
    in the unclipped branch (two-sided clipping, INTELLECT-2 arXiv:2505.07291). With
    ``importance_sampling_level="sequence"``, ``rho`` is the exp of the sequence's mean token log-ratio
    (GSPO, arXiv:2507.18071). ``loss_type="cispo"`` replaces the surrogate by
    ``l = -sg(min(rho, epsilon_high)) * A * log pi`` (MiniMax-M1, arXiv:2506.13585); as in TRL,
    ``epsilon_high`` is then the raw upper bound of the ratio, not an offset from 1. Unset, it is 5.0 for
    cispo (TRL's documented recommendation, from ScaleRL arXiv:2510.13786), not ``epsilon``: TRL falls back
    to ``epsilon`` (0.2), which would cap every weight far below 1.

    The KL term uses ``k2`` or ``k3``: ``k1 = log pi - log pi_ref`` has the gradient ``grad log pi``, whose
    mean under pi is 0, so in the loss it regularises nothing. ``k1`` belongs in the reward
    (``kl_in_reward``), as verl uses it. In expectation over tokens of pi, ``k2``'s gradient,
    ``(log pi - log pi_ref) grad log pi``, is that of the reverse KL, KL(pi || pi_ref); ``k3``'s,
    ``(1 - pi_ref / pi) grad log pi``, is that of the forward KL, KL(pi_ref || pi). With
    ``use_bias_correction_kl`` (the default, as TRL's) each token's KL is multiplied by the importance ratio
    ``rho`` (with its gradient; the sequence's at ``importance_sampling_level="sequence"``), which makes
    ``k3``'s gradient ``rho (log pi - log pi_ref) grad log pi``: the reverse KL's, also off-policy
    (DeepSeek-V3.2, arXiv:2512.02556). On-policy ``rho`` is 1: the loss is unchanged, its gradient is not.
    For ``k2`` it gives the gradient of E_pi[k2] instead of the reverse KL's.

    Aggregation over the masked tokens:
        - ``grpo``: mean over sequences of each sequence's token mean (DeepSeekMath eq. 3).
        - ``bnpo``, ``dapo``, ``cispo``: token sum / number of tokens.
        - ``dr_grpo``: token sum / (number of sequences * ``max_completion_length``) (arXiv:2503.20783).

    When a batch is split into micro-batches (or across devices), pass the full batch's ``total_tokens``
    (replaces the local token count) and ``total_sequences`` (replaces the local ``B``): the micro-batch
    losses then sum to the full-batch loss. The defaults use the local counts, as TRL.

    ``importance_weights`` ``w`` (detached, ``[B, T]``) multiply each token's policy term, ``l = -w * min(...)
    + beta * KL``: the truncated importance weights ``min(pi_old / pi_sampler, C)`` of tokens drawn by a
    sampler other than ``pi_old`` (Yao et al. 2025, TIS; TRL weights the same term, not the KL). All ones
    leave the loss and its gradient unchanged.

    The entropy bonus subtracts ``entropy_coef`` times the masked token mean of ``entropies`` (its token
    count is ``total_tokens`` when given).

    Args:
        logprobs: ``[B, T]`` completion-token log-probabilities under the current policy (with grad).
        advantages: ``[B]`` or ``[B, T]``.
        mask: ``[B, T]``, non-zero for real completion tokens, 0 for padding (bool, int or float).
        old_logprobs: ``[B, T]`` log-probabilities under the sampling policy; ``None`` means on-policy.
        ref_logprobs: ``[B, T]`` log-probabilities under the reference model; required when ``beta != 0``.
        loss_type: one of ``"grpo"``, ``"bnpo"``, ``"dapo"``, ``"dr_grpo"``, ``"cispo"``.
        importance_sampling_level: ``"token"`` or ``"sequence"``.
        epsilon: lower clipping range.
        epsilon_high: upper clipping range, defaults to ``epsilon`` (for ``cispo``: ``CISPO_EPSILON_HIGH``).
        delta: optional cap on the ratio in the unclipped branch (should exceed ``1 + epsilon_high``).
        beta: KL coefficient.
        max_completion_length: required for ``dr_grpo``.
        entropies: ``[B, T]`` per-token entropies; required when ``entropy_coef != 0``.
        entropy_coef: entropy bonus coefficient.
        kl_estimator: ``"k2"`` or ``"k3"`` (see :func:`kl_penalty`); ``"k1"`` only with ``beta=0``.
        total_tokens: global number of masked tokens (float or 0-d tensor).
        total_sequences: global number of sequences (int or 0-d tensor).
        importance_weights: ``[B, T]`` per-token weights of the policy term, or ``None``.
        use_bias_correction_kl: multiply the per-token KL by the importance ratio (TRL's option).

    Returns:
        ``(loss, stats)``: the 0-d loss and detached 0-d stats ``policy_loss`` (before the entropy bonus),
        ``kl`` (the per-token KL as the loss weighs it: times ``rho`` with the bias correction, as TRL logs
        it), ``entropy``, ``clip_ratio/low_mean``, ``clip_ratio/high_mean`` and ``clip_ratio/region_mean``.
        Stats are local masked token means (for a sequence-level ratio, clip fractions are means over
        sequences, as TRL). For ``cispo``, ``clip_ratio/high_mean`` is the fraction with
        ``rho > epsilon_high`` and ``A > 0``, and ``clip_ratio/low_mean`` is 0.
    """
    surrogate, aggregate = LOSS_TYPES[loss_type]
    ratio_of_level = IMPORTANCE_SAMPLING_LEVELS[importance_sampling_level]
    if beta != 0.0 and ref_logprobs is None:
        raise ValueError(f"ref_logprobs is required when beta != 0 (beta={beta}).")
    if beta != 0.0 and kl_estimator == "k1":
        raise ValueError(f"kl_estimator='k1': {K1_IN_LOSS}")
    if entropy_coef != 0.0 and entropies is None:
        raise ValueError(f"entropies are required when entropy_coef != 0 (entropy_coef={entropy_coef}).")
    if loss_type == "dr_grpo" and max_completion_length is None:
        raise ValueError("max_completion_length is required when loss_type='dr_grpo'.")

    if epsilon_high is None:
        epsilon_high = CISPO_EPSILON_HIGH if loss_type == "cispo" else epsilon
    mask = mask.bool()  # [B, T]
    token_counts = mask.sum(-1).clamp(min=1).to(logprobs.dtype)  # [B]
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)  # [B, 1]
    advantages = advantages.to(logprobs.dtype)  # [B, 1] or [B, T]
    if old_logprobs is None:
        old_logprobs = logprobs.detach()

    log_ratio = ratio_of_level(logprobs - old_logprobs, mask, token_counts)  # [B, T] or [B, 1]
    ratio = torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))  # [B, T] or [B, 1]
    per_token_loss, is_low_clipped, is_high_clipped = surrogate(
        ratio, advantages, logprobs, epsilon, epsilon_high, delta
    )  # [B, T] or [B, 1], and the clip masks
    if importance_weights is not None:
        per_token_loss = per_token_loss * importance_weights.detach()  # [B, T]

    per_token_kl = None
    if ref_logprobs is not None:
        per_token_kl = kl_penalty(logprobs, ref_logprobs, kl_estimator)  # [B, T]
        if use_bias_correction_kl:  # the ratio before any clip or delta cap, as TRL's coef_1
            per_token_kl = per_token_kl * ratio  # [B, T] x ([B, T] or [B, 1])
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl  # [B, T]

    num_tokens = _denominator(mask.sum() if total_tokens is None else total_tokens, logprobs)
    num_sequences = _denominator(logprobs.shape[0] if total_sequences is None else total_sequences, logprobs)
    counts = (token_counts, num_tokens, num_sequences, max_completion_length)
    policy_loss = aggregate(per_token_loss, mask, *counts)

    loss = policy_loss
    if entropy_coef != 0.0:
        loss = loss - entropy_coef * _masked_sum(entropies, mask) / num_tokens

    zero = torch.zeros((), device=logprobs.device)
    stats = {
        "policy_loss": policy_loss.detach(),
        "kl": zero if per_token_kl is None else _stat_mean(per_token_kl, mask),
        "entropy": zero if entropies is None else _stat_mean(entropies, mask),
        "clip_ratio/low_mean": _stat_mean(is_low_clipped, mask),
        "clip_ratio/high_mean": _stat_mean(is_high_clipped, mask),
        "clip_ratio/region_mean": _stat_mean(is_low_clipped | is_high_clipped, mask),
    }
    return loss, stats


# The sampler/scorer gap: how far the rollout engine's log-probs are from the ones the loss scores, and the
# truncated importance-sampling correction for it.
#
# The loss assumes the completions were drawn from the policy it scores (`pi_old`, the log-probs of the
# policy before the update). The rollout engine draws them from `pi_sampler`, which differs wherever
# sampling does not compute exactly as scoring does: another precision or kernel (an inference copy, a KV
# cache decoded token by token), top-k/top-p truncation, `min_new_tokens`. Yao et al. 2025 ("Your efficient
# RL framework secretly brings you off-policy RL training", fengyao.notion.site/off-policy-rl) show that
# this gap biases the policy gradient, and correct it with truncated importance sampling (TIS): each
# token's loss is weighted by
#
#     w_t = min(pi_old(y_t) / pi_sampler(y_t), C)        (detached; C the cap)
#
# which makes the expectation over the sampler's tokens that over `pi_old`'s, up to the truncation, whose
# bias is bounded by the cap while the variance stays bounded too. This is TRL's mode "token_truncate"
# (`vllm_importance_sampling_correction` with `vllm_importance_sampling_mode="token_truncate"`, cap
# `vllm_importance_sampling_clip_max`); TRL corrects by default with vLLM only, and then in mode
# "sequence_mask" (a sequence's ratio, the exp of its summed log-ratio, weighs all its tokens, and a
# sequence whose ratio is outside [clip_min, clip_max] is dropped). verl has this mode as an option
# (`algorithm.rollout_is` with `rollout_is_level: token`, `rollout_is_mode: truncate`,
# `rollout_is_threshold`). Pure tensor maths here; `grpo_loss` applies the weights.

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
    (`IMPORTANCE_SAMPLING_MODES`; token_truncate with no floor is `truncated_importance_weights`), and where
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


def logprob_gap_stats(
    scorer_logprobs: Tensor,
    sampler_logprobs: Tensor,
    mask: Tensor,
    cap: float | None = None,
    correction: tuple[Tensor, Tensor] | None = None,
) -> dict[str, Tensor]:
    """How far the sampler's log-probs are from the scorer's on the `mask`ed tokens: `rollout/logp_gap_mean`
    and `_max` of |scorer - sampler|, `rollout/logp_gap_frac_above` (the share above
    `LOGP_GAP_THRESHOLD`), and with the correction's `(weights, bounded)` (`importance_weights`; or a
    `cap`: the TIS weights at it) the weights' mean and the share the bounds changed (truncated at the cap,
    or masked to 0), judged before bounding."""
    mask = mask.bool()  # [B, T]
    gap = (scorer_logprobs.detach() - sampler_logprobs).abs().float()  # [B, T]
    gap = torch.where(mask, gap, torch.zeros((), device=gap.device))  # padding counts nowhere, even NaN
    tokens = mask.sum().clamp(min=1)
    stats = {
        "rollout/logp_gap_mean": gap.sum() / tokens,
        "rollout/logp_gap_max": gap.max() if gap.numel() else gap.new_zeros(()),
        "rollout/logp_gap_frac_above": ((gap > LOGP_GAP_THRESHOLD) & mask).sum() / tokens,
    }
    if correction is None and cap is not None:
        correction = importance_weights(scorer_logprobs, sampler_logprobs, mask, "token_truncate", cap)
    if correction is not None:
        weights, bounded = correction  # [B, T] each
        stats["rollout/is_weight_mean"] = torch.where(mask, weights, 0.0).sum() / tokens
        stats["rollout/is_weight_frac_capped"] = (bounded & mask).sum() / tokens
    return stats
