"""Group-relative advantages (DeepSeekMath, arXiv:2402.03300, sec. 4.1.2) and the registries of their choices.

Pure tensor maths (only ``torch``). References:
    - GRPO: Shao et al., "DeepSeekMath", arXiv:2402.03300.
    - Dr. GRPO (no std scaling): Liu et al., arXiv:2503.20783.
    - REINFORCE++ (the batch's std): Hu, arXiv:2501.03262.
    - Leave-one-out baseline: RLOO, Ahmadian et al., arXiv:2402.14740.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Literal

import torch
from torch import Tensor

from grpo_lightning.core.options import Alias, Choices, PositiveFloat, Range, TRLValues, check_fields

STD_EPS = 1e-4  # added to the reward std before dividing, as in TRL

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
ScaleRewards = Literal[tuple(REWARD_SCALES)]
Baseline = Literal[tuple(BASELINES)]


@dataclass(frozen=True)
class AdvantageOptions:
    """How rewards become advantages (`GRPOConfig.advantages`)."""

    scale_rewards: Annotated[ScaleRewards, TRLValues((True, "group"), (False, "none"))] = "group"
    """"group" divides the centred reward by the group's std (GRPO), "batch" by the batch's (Hu et al.,
    REINFORCE++, arXiv:2501.03262), "none" only centres (Dr. GRPO, arXiv:2503.20783).
    """
    baseline: Baseline = "mean"
    """"mean" (group mean, GRPO) or "loo" (leave-one-out, RLOO, arXiv:2402.14740)."""
    clip: Annotated[PositiveFloat | None, Alias("advantage_clip")] = None
    """Clamp advantages to [-c, c]. None: no clipping."""
    step_credit: Annotated[float, Range(">= 0", why="it is subtracted from the advantage")] = 0.0
    """Token-level credit for wrong steps: each generated token that writes part of an arithmetic claim that
    does not verify (`grpo_lightning.core.rewards.steps`, e.g. "3 + 4 = 8") gets this much subtracted from its
    completion's outcome advantage, making the advantages [B, T] (process supervision at the step, as
    Lightman et al. arXiv:2305.20050 and Math-Shepherd arXiv:2312.08935 assign it, from a verifier instead
    of a learned reward model). 0.0 turns it off.
    """

    def __post_init__(self) -> None:
        check_fields(self)


def group_advantages(
    rewards: Tensor, group_size: int, options: AdvantageOptions = AdvantageOptions()
) -> Tensor:
    """Group-relative advantages, one per completion (DeepSeekMath arXiv:2402.03300, section 4.1.2).

    Args:
        rewards: ``[N * G]`` scalar rewards, the ``G = group_size`` completions of each prompt contiguous.
        group_size: completions per prompt, at least 2.
        options: the scale (``"group"`` divides by the group's reward std as GRPO, ``"batch"`` by the std of
            all rewards, ``"none"`` only centres as Dr. GRPO, arXiv:2503.20783; stds are unbiased and get
            ``1e-4`` added), the baseline (``"mean"``: the group mean as GRPO; ``"loo"``: the mean of the
            other ``G - 1`` rewards of the group as RLOO, arXiv:2402.14740, i.e. ``G / (G - 1) * (r_i -
            mean)``) and the clip (advantages clamped to ``[-clip, clip]``). ``step_credit`` is not read here
            (``credit.step_credit_penalties``).

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

    loo_factor, std = BASELINES[options.baseline], REWARD_SCALES[options.scale_rewards]
    rewards = rewards if rewards.is_floating_point() else rewards.float()
    grouped = rewards.view(-1, group_size)  # [N, G]
    advantages = grouped - grouped.mean(dim=1, keepdim=True)  # [N, G]
    advantages = advantages * loo_factor(group_size) / std(grouped)  # [N, G] / ([N, 1], 0-d or 1.0)

    # Rounding in the mean can leave tiny non-zero values in a constant group: force them to 0.
    constant_group = grouped.amax(dim=1, keepdim=True) == grouped.amin(dim=1, keepdim=True)  # [N, 1]
    advantages = advantages.masked_fill(constant_group, 0.0)  # [N, G]
    if options.clip is not None:
        advantages = advantages.clamp(-options.clip, options.clip)
    return advantages.reshape(-1)  # [N * G]
