"""Tests for group_advantages (grpo_lightning.core.algorithm.loss): hand-computed values per scale and
baseline, TRL's formula, errors, and properties (permutation, equal rewards)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_lightning.core.algorithm.advantages import AdvantageOptions, group_advantages

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
SIGN = torch.tensor([1.0, -1.0, -1.0, 1.0, 0.0, 0.0, 0.0, 0.0])


@pytest.mark.parametrize(
    ("scale", "baseline", "magnitude"),
    [
        ("group", "mean", 0.5 / (math.sqrt(1 / 3) + 1e-4)),  # group std of [1, 0, 0, 1] is sqrt(1/3)
        ("batch", "mean", 0.5 / (math.sqrt(1.5 / 7) + 1e-4)),  # batch mean 0.75, sum of squares 1.5
        ("none", "mean", 0.5),
        ("none", "loo", 2 / 3),  # 1 - mean(0, 0, 1)
        ("group", "loo", (2 / 3) / (math.sqrt(1 / 3) + 1e-4)),
    ],
)
def test_group_advantages_hand_values(scale: str, baseline: str, magnitude: float) -> None:
    advantages = group_advantages(REWARDS, 4, AdvantageOptions(scale, baseline))
    torch.testing.assert_close(advantages, SIGN * magnitude)
    assert torch.equal(advantages[4:], torch.zeros(4))


def test_loo_is_reward_minus_mean_of_others() -> None:
    rewards = torch.tensor([0.3, 1.7, -2.0, 0.9, 5.0, 4.0], dtype=torch.float64)
    expected = [
        r - (sum(group) - r) / 2 for group in (rewards[:3].tolist(), rewards[3:].tolist()) for r in group
    ]
    torch.testing.assert_close(
        group_advantages(rewards, 3, AdvantageOptions("none", "loo")),
        torch.tensor(expected, dtype=torch.float64),
    )


def test_zero_variance_group_is_exactly_zero() -> None:
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7, 0.0, 1.0, 0.5])
    for scale in ("group", "batch", "none"):
        for baseline in ("mean", "loo"):
            advantages = group_advantages(rewards, 3, AdvantageOptions(scale, baseline))
            assert torch.equal(advantages[:6], torch.zeros(6))
            assert advantages[6] < 0 < advantages[7]


def test_advantage_clip() -> None:
    advantages = group_advantages(torch.tensor([0.0, 0.0, 0.0, 10.0]), 4, AdvantageOptions("none", clip=1.0))
    torch.testing.assert_close(advantages, torch.tensor([-1.0, -1.0, -1.0, 1.0]))


@pytest.mark.parametrize(
    ("rewards", "group_size", "match"),
    [
        (torch.ones(6), 4, "not divisible"),
        (torch.ones(6), 1, "at least 2"),
        (torch.tensor([1.0, float("nan")]), 2, "non-finite"),
        (torch.tensor([1.0, float("inf")]), 2, "non-finite"),
    ],
)
def test_group_advantages_errors(rewards: torch.Tensor, group_size: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        group_advantages(rewards, group_size)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"scale_rewards": "std"}, "scale_rewards='std': must be one of group, batch, none"),
        ({"baseline": "median"}, "baseline='median': must be one of mean, loo"),
        ({"clip": 0.0}, "clip"),
    ],
)
def test_advantage_options_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        AdvantageOptions(**kwargs)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_match_trl_formula(scale: str) -> None:
    nanstd = pytest.importorskip("trl.trainer.utils").nanstd
    rewards = torch.randn(24, generator=torch.Generator().manual_seed(1))
    rewards[8:12] = 0.5  # one zero-variance group
    # TRL 1.16 GRPOTrainer._generate_and_score_completions, "sum_then_normalize" with one reward function.
    mean = torch.nanmean(rewards.view(-1, 4), dim=1).repeat_interleave(4)
    std = nanstd(rewards.view(-1, 4), dim=1).repeat_interleave(4) if scale != "batch" else nanstd(rewards)
    expected = rewards - mean
    if scale != "none":
        expected = expected / (std + 1e-4)
    torch.testing.assert_close(
        group_advantages(rewards, 4, AdvantageOptions(scale)), expected, atol=1e-6, rtol=0
    )


@settings(max_examples=30, deadline=None)
@given(
    rewards=st.lists(st.floats(-1e3, 1e3, width=32), min_size=12, max_size=12),
    perm=st.permutations(range(4)),
    scale=st.sampled_from(["group", "batch", "none"]),
    baseline=st.sampled_from(["mean", "loo"]),
)
def test_permuting_a_group_permutes_advantages(rewards: list, perm: list, scale: str, baseline: str) -> None:
    rewards = torch.tensor(rewards)
    index = torch.cat([torch.tensor(perm), torch.arange(4, 12)])  # permute the first group only
    advantages = group_advantages(rewards, 4, AdvantageOptions(scale, baseline))
    permuted = group_advantages(rewards[index], 4, AdvantageOptions(scale, baseline))
    torch.testing.assert_close(permuted, advantages[index], atol=1e-5, rtol=1e-4)


@settings(max_examples=30, deadline=None)
@given(
    value=st.floats(-1e6, 1e6),
    groups=st.integers(1, 4),
    group_size=st.integers(2, 6),
    scale=st.sampled_from(["group", "batch", "none"]),
    baseline=st.sampled_from(["mean", "loo"]),
)
def test_equal_rewards_give_zero(
    value: float, groups: int, group_size: int, scale: str, baseline: str
) -> None:
    rewards = torch.full((groups * group_size,), value, dtype=torch.float64)
    advantages = group_advantages(rewards, group_size, AdvantageOptions(scale, baseline))
    assert torch.equal(advantages, torch.zeros_like(rewards))
