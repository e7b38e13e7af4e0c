"""KL penalties to the reference: per-token estimators, in the loss or charged to the reward.

Pure tensor maths (only ``torch``). References:
    - KL estimators k1/k2/k3: J. Schulman, "Approximating KL divergence", 2020.
    - KL in the reward (``kl_in_reward``): verl's ``algorithm.use_kl_in_reward`` (``apply_kl_penalty``).
"""

from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

from grpo_lightning.core.options import Choices

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
