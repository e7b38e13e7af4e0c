"""KL penalties to the reference: per-token estimators, in the loss or charged to the reward.

Pure tensor maths (only ``torch``). References:
    - KL estimators k1/k2/k3: J. Schulman, "Approximating KL divergence", 2020.
    - KL in the reward (``kl_in_reward``): verl's ``algorithm.use_kl_in_reward`` (``apply_kl_penalty``).
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Literal

import torch
from torch import Tensor

from grpo_lightning.core.options import (
    Alias,
    Choices,
    NonNegativeFloat,
    check_fields,
    option_error,
    warn_inert,
)

# k1 = log pi - log pi_ref has the gradient grad log pi, of mean zero under the policy: in the loss it
# regularises nothing. Refused by `GRPOConfig` and `grpo_loss` alike, with this reason.
K1_IN_LOSS = (
    "in the loss (beta > 0 without use_kl_in_reward) its gradient, grad log pi, has mean zero: it "
    "regularises nothing. Use 'k3' (with use_bias_correction_kl, the reverse KL's gradient) or 'k2' in the "
    "loss, or keep k1 and move the KL into the reward (use_kl_in_reward: true, as verl)"
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
KLEstimator = Literal[tuple(KL_ESTIMATORS)]


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


@dataclass(frozen=True)
class KLOptions:
    """The KL penalty to the frozen reference, in the loss or charged to the reward (`GRPOConfig.kl`)."""

    beta: NonNegativeFloat = 0.0
    """Weight of the KL penalty to the frozen reference; 0 loads no reference at all. 0.0 as TRL and DAPO
    (DeepSeekMath used 0.04).
    """
    estimator: Annotated[KLEstimator, Alias("kl_estimator")] = "k3"
    """"k1", "k2" or "k3", estimates of KL(pi || pi_ref) per token (Schulman, "Approximating KL divergence",
    2020); "k3" as TRL and DeepSeekMath eq. 4. In the loss (beta > 0 without use_kl_in_reward) k1 is
    refused: its gradient, grad log pi, has mean zero under the policy, so it regularises nothing. k2's
    gradient is the reverse KL's, KL(pi || pi_ref); k3's the forward KL's, KL(pi_ref || pi), unless
    use_bias_correction_kl makes it the reverse KL's. k1 is for use_kl_in_reward.
    """
    bias_correction: Annotated[bool, Alias("use_bias_correction_kl")] = True
    """Multiply each token's KL term by the importance ratio pi / pi_old, gradient included (at
    importance_sampling_level "sequence", the sequence's ratio): k3's gradient is then the reverse KL's,
    KL(pi || pi_ref), on-policy and off (DeepSeek-V3.2, arXiv:2512.02556). On-policy the ratio is 1, so the
    loss is the same and its gradient is not. True as TRL's `use_bias_correction_kl`, whose KL is k3; with
    k2, whose gradient is the reverse KL's already on-policy, it becomes E_pi[k2]'s: set false to keep it.
    Acts on the KL in the loss only (beta > 0 without use_kl_in_reward).
    """
    in_reward: Annotated[bool, Alias("use_kl_in_reward")] = False
    """Put the KL in the reward instead of the loss, as verl's `algorithm.use_kl_in_reward`: reward_i -= beta
    * sum over the completion's tokens of the `kl_estimator` estimate (sampling policy vs reference),
    before the advantages; the loss then has no KL term. Needs beta > 0. verl pairs it with k1
    (`algorithm.kl_penalty: kl`): set kl_estimator "k1" to match.
    """

    @property
    def in_loss(self) -> bool:
        """Whether the loss has a KL term (beta > 0, not charged to the reward)."""
        return self.beta > 0 and not self.in_reward

    @property
    def loss_beta(self) -> float:
        """The KL weight in the loss: beta, or 0 when the KL is charged to the reward."""
        return self.beta if self.in_loss else 0.0

    def __post_init__(self) -> None:
        check_fields(self)
        if self.in_reward and self.beta == 0:
            raise option_error(
                self, "in_reward", True, "needs beta > 0 (beta weighs the KL charged to the reward)"
            )
        if self.estimator == "k1" and self.in_loss:
            raise option_error(self, "estimator", "k1", K1_IN_LOSS)
        if self.beta == 0:
            warn_inert(self, "estimator", "beta > 0")
        if not self.in_loss:
            warn_inert(self, "bias_correction", "beta > 0 and the KL in the loss (use_kl_in_reward: false)")
