"""Clipped policy-gradient losses of GRPO and its variants: each surrogate apart from its aggregation.

Pure tensor maths (only ``torch``): nothing here knows about models, tokenizers or Lightning. The numbers
match TRL 1.16's ``GRPOTrainer`` for a single process without gradient accumulation (``bnpo`` also with
it: each micro-batch's token mean over their number), with two additions: the other loss types'
denominators can be set to batch-wide totals so that micro-batches sum to the full-batch loss, and the
log-ratios are clamped before every ``exp`` so that no ``inf`` or ``NaN`` can appear.

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
"""

from dataclasses import dataclass
from typing import Annotated, Literal, NamedTuple

import torch
from torch import Tensor

from grpo_lightning.core.algorithm.kl import KLOptions, kl_penalty
from grpo_lightning.core.options import Choices, PositiveFloat, Range, check_fields, option_error

MAX_LOG_RATIO = 20.0  # bound on |log-ratio| before exp in the importance ratio
CISPO_EPSILON_HIGH = 5.0  # cispo's cap of the IS weight when epsilon_high is unset: TRL's recommended value


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


# The per-token surrogates: (ratio, advantages, logprobs, the loss's options) -> (per-token loss, low-clipped,
# high-clipped), each [B, T] or [B, 1]. A variant with a knob of its own adds the knob to `PolicyLossOptions`,
# its function here and its row in `LOSS_TYPES`.
def _clipped_surrogate(ratio: Tensor, advantages: Tensor, logprobs: Tensor, options: "PolicyLossOptions"):
    """PPO's clipped surrogate (DeepSeekMath eq. 3) with DAPO's clip-higher and INTELLECT-2's delta cap."""
    epsilon, epsilon_high, delta = options.epsilon, options.upper_clip, options.delta
    clipped_ratio = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    unclipped_ratio = ratio if delta is None else torch.clamp(ratio, max=delta)
    per_token_loss = -torch.min(unclipped_ratio * advantages, clipped_ratio * advantages)  # [B, T|1]
    is_low_clipped = (ratio < 1 - epsilon) & (advantages < 0)
    is_high_clipped = (ratio > 1 + epsilon_high) & (advantages > 0)
    return per_token_loss, is_low_clipped, is_high_clipped


def _cispo_surrogate(ratio: Tensor, advantages: Tensor, logprobs: Tensor, options: "PolicyLossOptions"):
    """CISPO (MiniMax-M1): the detached IS weight capped at epsilon_high times A log pi; no low clip."""
    cap = options.upper_clip
    per_token_loss = -torch.clamp(ratio, max=cap).detach() * advantages * logprobs  # [B, T]
    is_high_clipped = (ratio > cap) & (advantages > 0)
    return per_token_loss, torch.zeros_like(ratio, dtype=torch.bool), is_high_clipped


class LossCounts(NamedTuple):
    """What the aggregations divide by: the counts of this micro-batch and of its optimizer step."""

    token_counts: Tensor  # [B] each sequence's loss tokens, at least 1
    local_tokens: Tensor  # 0-d: this micro-batch's loss tokens, at least 1
    num_tokens: Tensor  # 0-d: the optimizer step's loss tokens (`total_tokens`), at least 1
    num_sequences: Tensor  # 0-d: the optimizer step's sequences (`total_sequences`), at least 1
    max_completion_length: int | None
    num_micro_batches: int  # of the optimizer step this micro-batch is one of


# The aggregations: (per-token loss [B, T], mask, counts) -> the 0-d loss.
def _sequence_mean(per_token_loss: Tensor, mask: Tensor, counts: LossCounts) -> Tensor:
    """Mean over sequences of each sequence's token mean (DeepSeekMath eq. 3)."""
    sequence_means = _masked_sum(per_token_loss, mask, dim=-1) / counts.token_counts  # [B]
    return sequence_means.sum() / counts.num_sequences


def _token_mean(per_token_loss: Tensor, mask: Tensor, counts: LossCounts) -> Tensor:
    """Token sum / the optimizer step's tokens (DAPO eq. 8)."""
    return _masked_sum(per_token_loss, mask) / counts.num_tokens


def _micro_batch_token_mean(per_token_loss: Tensor, mask: Tensor, counts: LossCounts) -> Tensor:
    """This micro-batch's own token mean / the step's number of micro-batches (TRL's bnpo)."""
    return _masked_sum(per_token_loss, mask) / counts.local_tokens / counts.num_micro_batches


def _constant_normaliser(per_token_loss: Tensor, mask: Tensor, counts: LossCounts) -> Tensor:
    """Token sum / (sequences x max_completion_length) (Dr. GRPO)."""
    return _masked_sum(per_token_loss, mask) / (counts.num_sequences * counts.max_completion_length)


LOSS_TYPES = Choices(
    "loss_type",
    {
        "grpo": (_clipped_surrogate, _sequence_mean),
        "bnpo": (_clipped_surrogate, _micro_batch_token_mean),
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


@dataclass(frozen=True)
class PolicyLossOptions:
    """The policy loss: its variant, the importance ratio and its clipping, the entropy bonus
    (`GRPOConfig.loss`; `grpo_loss`)."""

    loss_type: LossType = "dapo"
    """"grpo" (mean of per-sequence token means, arXiv:2402.03300 eq. 3), "dapo" (token mean over the
    optimizer step's tokens on all ranks, DAPO arXiv:2503.14476 eq. 8), "bnpo" (as TRL computes it: each
    micro-batch's own token mean divided by the step's number of micro-batches, on each rank apart, so
    micro-batches with fewer tokens weigh each token more; the same as dapo when every micro-batch holds as
    many tokens), "dr_grpo" (token sum / (B * L_max), arXiv:2503.20783), "cispo" (clipped IS-weight policy
    gradient, MiniMax-M1 arXiv:2506.13585).
    """
    importance_sampling_level: ImportanceSamplingLevel = "token"
    """"token" or "sequence" (GSPO, arXiv:2507.18071)."""
    epsilon: PositiveFloat = 0.2
    """Lower clip of the ratio, 1 - epsilon (PPO, arXiv:1707.06347)."""
    epsilon_high: PositiveFloat | None = None
    """Upper clip, 1 + epsilon_high (DAPO's clip-higher; for cispo the raw cap of the IS weight). None means
    epsilon, or for cispo 5.0 (TRL's recommended value, ScaleRL arXiv:2510.13786; TRL itself falls back to
    epsilon, a cap of 0.2 that shrinks every weight).
    """
    delta: Annotated[float, Range("> 1")] | None = None
    """Cap of the unclipped ratio, two-sided clipping (INTELLECT-2, arXiv:2505.07291)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus, loss - coef * mean token entropy (negative: a penalty)."""
    mask_truncated_completions: bool = False
    """Drop completions that never stopped from the loss (DAPO sec. 3.4)."""
    top_entropy_quantile: Annotated[float, Range("> 0, <= 1", why="a share of the tokens")] = 1.0
    """The share of each micro-batch's completion tokens, those of highest entropy under the policy, whose
    policy term is kept ("Beyond the 80/20 Rule", arXiv:2506.01939, keeps 0.2); the KL term keeps every
    token, the entropy bonus only these. 1.0 keeps every token. TRL's `top_entropy_quantile`: the threshold
    is the micro-batch's entropy quantile on each rank (TRL's gathers the ranks' tokens first)."""

    @property
    def upper_clip(self) -> float:
        """`epsilon_high` as the surrogate applies it: unset, `epsilon`, or for cispo `CISPO_EPSILON_HIGH`."""
        if self.epsilon_high is not None:
            return self.epsilon_high
        return CISPO_EPSILON_HIGH if self.loss_type == "cispo" else self.epsilon

    def __post_init__(self) -> None:
        check_fields(self)
        # cispo's epsilon_high is a raw cap of the weight, not an offset from 1: no delta above it applies.
        if self.delta is not None and self.delta <= 1 + (self.epsilon_high or self.epsilon):
            raise option_error(
                self, "delta", self.delta, "must be > 1 + epsilon_high (it caps ratios above the clip range)"
            )


def high_entropy_tokens(entropies: Tensor, mask: Tensor, share: float) -> Tensor:
    """`[B, T]` bool: the masked tokens whose entropy is at least the `1 - share` quantile of the masked
    tokens' entropies (linear interpolation, `torch.quantile`'s; TRL's `get_high_entropy_mask`)."""
    mask = mask.bool()  # [B, T]
    values = entropies.detach()[mask].float()  # [N]
    if values.numel() == 0:
        return torch.zeros_like(mask)
    threshold = torch.quantile(values, 1.0 - share)
    return (entropies.detach() >= threshold) & mask  # [B, T]


def grpo_loss(
    logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    options: PolicyLossOptions = PolicyLossOptions(),
    kl: KLOptions = KLOptions(),
    *,
    old_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    max_completion_length: int | None = None,
    entropies: Tensor | None = None,
    total_tokens: float | Tensor | None = None,
    total_sequences: int | Tensor | None = None,
    importance_weights: Tensor | None = None,
    num_micro_batches: int = 1,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped surrogate policy loss of GRPO and its variants, to be minimised.

    Per token, with importance ratio ``rho = pi / pi_old`` and advantage ``A`` (DeepSeekMath eq. 3)::

        l = -min(rho * A, clamp(rho, 1 - epsilon, 1 + epsilon_high) * A) + beta * KL

    with the ``options`` of the policy loss (``PolicyLossOptions``) and beta, the estimator and the bias
    correction of ``kl`` (``KLOptions``; its ``loss_beta``: no KL term when the KL is charged to the reward).
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
    (``kl.in_reward``), as verl uses it. In expectation over tokens of pi, ``k2``'s gradient,
    ``(log pi - log pi_ref) grad log pi``, is that of the reverse KL, KL(pi || pi_ref); ``k3``'s,
    ``(1 - pi_ref / pi) grad log pi``, is that of the forward KL, KL(pi_ref || pi). With
    ``kl.bias_correction`` (TRL's ``use_bias_correction_kl``, the default) each token's KL is multiplied by
    the importance ratio ``rho`` (with its gradient; the sequence's at the sequence level), which makes
    ``k3``'s gradient ``rho (log pi - log pi_ref) grad log pi``: the reverse KL's, also off-policy
    (DeepSeek-V3.2, arXiv:2512.02556). On-policy ``rho`` is 1: the loss is unchanged, its gradient is not.
    For ``k2`` it gives the gradient of E_pi[k2] instead of the reverse KL's.

    Aggregation over the masked tokens (``options.loss_type``):
        - ``grpo``: mean over sequences of each sequence's token mean (DeepSeekMath eq. 3).
        - ``dapo``, ``cispo``: token sum / number of tokens (``total_tokens`` when given).
        - ``bnpo``: token sum / this batch's own number of tokens / ``num_micro_batches`` (TRL's bnpo under
          gradient accumulation; ``total_tokens`` does not change it).
        - ``dr_grpo``: token sum / (number of sequences * ``max_completion_length``) (arXiv:2503.20783).

    When a batch is split into micro-batches (or across devices), pass the full batch's ``total_tokens``
    (replaces the local token count) and ``total_sequences`` (replaces the local ``B``): the micro-batch
    losses then sum to the full-batch loss, except bnpo's, whose micro-batch losses sum to the mean of their
    token means when ``num_micro_batches`` is their number. The defaults use the local counts, as TRL.

    ``importance_weights`` ``w`` (detached, ``[B, T]``) multiply each token's policy term, ``l = -w * min(...)
    + beta * KL``: the truncated importance weights ``min(pi_old / pi_sampler, C)`` of tokens drawn by a
    sampler other than ``pi_old`` (Yao et al. 2025, TIS; TRL weights the same term, not the KL). All ones
    leave the loss and its gradient unchanged.

    The entropy bonus subtracts ``options.entropy_coef`` times the masked token mean of ``entropies`` (its
    token count is ``total_tokens`` when given, for every loss type, bnpo's too; TRL divides each
    micro-batch's own entropy mean by the number of micro-batches instead).

    With ``options.top_entropy_quantile`` ``q < 1``, only the tokens of the highest entropies (``q`` of this
    batch's, ``high_entropy_tokens``) keep their policy term, and the entropy bonus sums theirs only; the
    aggregation's token counts and the KL term are the unselected mask's, as TRL's.

    Args:
        logprobs: ``[B, T]`` completion-token log-probabilities under the current policy (with grad).
        advantages: ``[B]`` or ``[B, T]``.
        mask: ``[B, T]``, non-zero for real completion tokens, 0 for padding (bool, int or float).
        options: the loss variant, the ratio's level and clipping, the entropy bonus.
        kl: the KL term; its estimator also gives the ``kl`` statistic whenever ``ref_logprobs`` is given.
        old_logprobs: ``[B, T]`` ``log pi_old``, the ratio's anchor: the completions' log-probabilities under
            the policy the update started from (the one that sampled them, unless an older one did), detached.
            ``None``: the current policy is that one, and ``logprobs.detach()`` stands in (``rho`` is 1 in
            value, and its gradient is that of ``log pi``).
        ref_logprobs: ``[B, T]`` log-probabilities under the reference model; required when
            ``kl.loss_beta != 0``.
        max_completion_length: required for ``dr_grpo``.
        entropies: ``[B, T]`` per-token entropies; required when ``options.entropy_coef != 0`` or
            ``options.top_entropy_quantile < 1``.
        total_tokens: global number of masked tokens (float or 0-d tensor).
        total_sequences: global number of sequences (int or 0-d tensor).
        importance_weights: ``[B, T]`` per-token weights of the policy term, or ``None``.
        num_micro_batches: the micro-batches of the optimizer step this batch is one of (bnpo divides by it).

    Returns:
        ``(loss, stats)``: the 0-d loss and detached 0-d stats ``policy_loss`` (before the entropy bonus),
        ``kl`` (the per-token KL as the loss weighs it: times ``rho`` with the bias correction, as TRL logs
        it), ``entropy``, ``clip_ratio/low_mean``, ``clip_ratio/high_mean`` and ``clip_ratio/region_mean``.
        Stats are local masked token means (for a sequence-level ratio, clip fractions are means over
        sequences, as TRL). For ``cispo``, ``clip_ratio/high_mean`` is the fraction with
        ``rho > epsilon_high`` and ``A > 0``, and ``clip_ratio/low_mean`` is 0.
    """
    surrogate, aggregate = LOSS_TYPES[options.loss_type]
    ratio_of_level = IMPORTANCE_SAMPLING_LEVELS[options.importance_sampling_level]
    beta, entropy_coef = kl.loss_beta, options.entropy_coef
    if beta != 0.0 and ref_logprobs is None:
        raise ValueError(f"ref_logprobs is required when beta != 0 (beta={beta}).")
    if entropy_coef != 0.0 and entropies is None:
        raise ValueError(f"entropies are required when entropy_coef != 0 (entropy_coef={entropy_coef}).")
    if options.loss_type == "dr_grpo" and max_completion_length is None:
        raise ValueError("max_completion_length is required when loss_type='dr_grpo'.")

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
        ratio, advantages, logprobs, options
    )  # [B, T] or [B, 1], and the clip masks
    if importance_weights is not None:
        per_token_loss = per_token_loss * importance_weights.detach()  # [B, T]
    if options.top_entropy_quantile < 1.0:
        if entropies is None:
            raise ValueError("entropies are required when top_entropy_quantile < 1.")
        mask_of_policy = high_entropy_tokens(entropies, mask, options.top_entropy_quantile)  # [B, T]
        per_token_loss = per_token_loss * mask_of_policy  # [B, T]
    else:
        mask_of_policy = mask

    per_token_kl = None
    if ref_logprobs is not None:
        per_token_kl = kl_penalty(logprobs, ref_logprobs, kl.estimator)  # [B, T]
        if kl.bias_correction:  # the ratio before any clip or delta cap, as TRL's coef_1
            per_token_kl = per_token_kl * ratio  # [B, T] x ([B, T] or [B, 1])
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl  # [B, T]

    local_tokens = _denominator(mask.sum(), logprobs)
    num_tokens = local_tokens if total_tokens is None else _denominator(total_tokens, logprobs)
    num_sequences = _denominator(logprobs.shape[0] if total_sequences is None else total_sequences, logprobs)
    counts = LossCounts(
        token_counts, local_tokens, num_tokens, num_sequences, max_completion_length, num_micro_batches
    )
    policy_loss = aggregate(per_token_loss, mask, counts)

    loss = policy_loss
    if entropy_coef != 0.0:
        loss = loss - entropy_coef * _masked_sum(entropies, mask_of_policy) / num_tokens

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
