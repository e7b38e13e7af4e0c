"""Tests for grpo_lightning.core.algorithm.loss: hand-computed values, a per-element reference, TRL 1.16,
properties."""

import math
from collections import defaultdict
from types import SimpleNamespace
from typing import get_args

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_lightning.core.algorithm.loss import LossType, group_advantages, grpo_loss, kl_penalty

LOSS_TYPES = get_args(LossType)
LEVELS = ("token", "sequence")
MAX_LEN = 8  # max_completion_length used for dr_grpo throughout


def _options(loss_type: str, **kwargs) -> dict:
    """grpo_loss keyword options; cispo gets a raw ratio bound for epsilon_high, as in TRL."""
    options = {"loss_type": loss_type, "max_completion_length": MAX_LEN}
    if loss_type == "cispo":
        options["epsilon_high"] = 1.3
    return options | kwargs


def _batch(seed: int = 0, batch: int = 4, length: int = 5, dtype: torch.dtype = torch.float64) -> dict:
    """Random tensors with ratios spread well beyond the clip range and uneven completion lengths."""
    gen = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(batch, length, generator=gen, dtype=dtype) * 3  # [B, T]
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    lengths[0] = length
    return {
        "logprobs": logprobs,
        "old_logprobs": logprobs + torch.randn(batch, length, generator=gen, dtype=dtype) * 0.4,
        "ref_logprobs": logprobs + torch.randn(batch, length, generator=gen, dtype=dtype) * 0.5,
        "entropies": torch.rand(batch, length, generator=gen, dtype=dtype) * 2,
        "advantages": torch.randn(batch, generator=gen, dtype=dtype),  # [B]
        "mask": torch.arange(length) < lengths.unsqueeze(1),  # [B, T] bool
    }


def _kl_reference(logprob: float, ref: float, estimator: str) -> float:
    log_ratio = ref - logprob
    return {"k1": -log_ratio, "k2": 0.5 * log_ratio**2, "k3": math.exp(log_ratio) - log_ratio - 1}[estimator]


def _reference_loss(
    logprobs,
    advantages,
    mask,
    old_logprobs,
    ref_logprobs=None,
    entropies=None,
    *,
    loss_type="dapo",
    importance_sampling_level="token",
    epsilon=0.2,
    epsilon_high=None,
    delta=None,
    beta=0.0,
    max_completion_length=None,
    entropy_coef=0.0,
    kl_estimator="k3",
) -> float:
    """Element-by-element transcription of the objective with Python floats."""
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    batch, length = logprobs.shape
    row_losses = []
    for b in range(batch):
        tokens = [t for t in range(length) if mask[b, t]]
        seq_log_ratio = sum(float(logprobs[b, t] - old_logprobs[b, t]) for t in tokens) / max(len(tokens), 1)
        losses = []
        for t in tokens:
            log_ratio = float(logprobs[b, t] - old_logprobs[b, t])
            ratio = math.exp(seq_log_ratio if importance_sampling_level == "sequence" else log_ratio)
            adv = float(advantages[b, t] if advantages.dim() == 2 else advantages[b])
            if loss_type == "cispo":
                loss = -min(ratio, epsilon_high) * adv * float(logprobs[b, t])
            else:
                unclipped = ratio if delta is None else min(ratio, delta)
                clipped = min(max(ratio, 1 - epsilon), 1 + epsilon_high)
                loss = -min(unclipped * adv, clipped * adv)
            if beta:
                loss += beta * _kl_reference(float(logprobs[b, t]), float(ref_logprobs[b, t]), kl_estimator)
            losses.append(loss)
        row_losses.append(losses)
    num_tokens = max(sum(len(losses) for losses in row_losses), 1)
    total = sum(sum(losses) for losses in row_losses)
    if loss_type == "grpo":
        result = sum(sum(losses) / max(len(losses), 1) for losses in row_losses) / batch
    elif loss_type == "dr_grpo":
        result = total / (batch * max_completion_length)
    else:
        result = total / num_tokens
    if entropy_coef:
        result -= entropy_coef * sum(float(entropies[b, t]) for b, t in mask.nonzero().tolist()) / num_tokens
    return result


# ----------------------------------------------------------------------------------------------------------
# group_advantages
# ----------------------------------------------------------------------------------------------------------

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
    advantages = group_advantages(REWARDS, 4, scale=scale, baseline=baseline)
    torch.testing.assert_close(advantages, SIGN * magnitude)
    assert torch.equal(advantages[4:], torch.zeros(4))


def test_loo_is_reward_minus_mean_of_others() -> None:
    rewards = torch.tensor([0.3, 1.7, -2.0, 0.9, 5.0, 4.0], dtype=torch.float64)
    expected = [
        r - (sum(group) - r) / 2 for group in (rewards[:3].tolist(), rewards[3:].tolist()) for r in group
    ]
    torch.testing.assert_close(
        group_advantages(rewards, 3, scale="none", baseline="loo"),
        torch.tensor(expected, dtype=torch.float64),
    )


def test_zero_variance_group_is_exactly_zero() -> None:
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7, 0.0, 1.0, 0.5])
    for scale in ("group", "batch", "none"):
        for baseline in ("mean", "loo"):
            advantages = group_advantages(rewards, 3, scale=scale, baseline=baseline)
            assert torch.equal(advantages[:6], torch.zeros(6))
            assert advantages[6] < 0 < advantages[7]


def test_advantage_clip() -> None:
    advantages = group_advantages(torch.tensor([0.0, 0.0, 0.0, 10.0]), 4, scale="none", clip=1.0)
    torch.testing.assert_close(advantages, torch.tensor([-1.0, -1.0, -1.0, 1.0]))


@pytest.mark.parametrize(
    ("rewards", "group_size", "kwargs", "match"),
    [
        (torch.ones(6), 4, {}, "not divisible"),
        (torch.ones(6), 1, {}, "at least 2"),
        (torch.tensor([1.0, float("nan")]), 2, {}, "non-finite"),
        (torch.tensor([1.0, float("inf")]), 2, {}, "non-finite"),
        (torch.ones(4), 2, {"scale": "std"}, "scale='std': must be one of group, batch, none"),
        (torch.ones(4), 2, {"baseline": "median"}, "baseline='median': must be one of mean, loo"),
        (torch.ones(4), 2, {"clip": 0.0}, "clip"),
    ],
)
def test_group_advantages_errors(rewards: torch.Tensor, group_size: int, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        group_advantages(rewards, group_size, **kwargs)


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
    torch.testing.assert_close(group_advantages(rewards, 4, scale=scale), expected, atol=1e-6, rtol=0)


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
    advantages = group_advantages(rewards, 4, scale=scale, baseline=baseline)
    permuted = group_advantages(rewards[index], 4, scale=scale, baseline=baseline)
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
    advantages = group_advantages(rewards, group_size, scale=scale, baseline=baseline)
    assert torch.equal(advantages, torch.zeros_like(rewards))


# ----------------------------------------------------------------------------------------------------------
# kl_penalty
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_penalty_formula(estimator: str) -> None:
    data = _batch(2)
    kl = kl_penalty(data["logprobs"], data["ref_logprobs"], estimator)
    expected = [
        [_kl_reference(lp, ref, estimator) for lp, ref in zip(lp_row, ref_row, strict=True)]
        for lp_row, ref_row in zip(data["logprobs"].tolist(), data["ref_logprobs"].tolist(), strict=True)
    ]
    torch.testing.assert_close(kl, torch.tensor(expected, dtype=torch.float64))


def test_kl_penalty_clamps_and_validates() -> None:
    kl = kl_penalty(torch.tensor([[-1e4, 0.0]]), torch.tensor([[0.0, -1e4]]), "k3", max_log_ratio=20.0)
    torch.testing.assert_close(kl, torch.tensor([[math.exp(20) - 21, math.exp(-20) + 19]]))
    with pytest.raises(ValueError, match="estimator='k4': must be one of k1, k2, k3"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4")


# ----------------------------------------------------------------------------------------------------------
# grpo_loss: hand-computed numbers
# ----------------------------------------------------------------------------------------------------------
# Row 0 has A = +1 and ratios [1.5, 0.5, pad]; row 1 has A = -1 and ratios [1.5, 0.5, 1.0]. With epsilon 0.2
# the per-token losses are row 0: [-1.2 (high-clipped), -0.5], row 1: [1.5, 0.8 (low-clipped), 1.0].

HAND_LOGPROBS = torch.tensor([[-1.0, -2.0, -5.0], [-0.5, -1.5, -3.0]], dtype=torch.float64)
HAND_RATIOS = torch.tensor([[1.5, 0.5, 7.0], [1.5, 0.5, 1.0]], dtype=torch.float64)
HAND = {
    "logprobs": HAND_LOGPROBS,
    "old_logprobs": HAND_LOGPROBS - HAND_RATIOS.log(),
    "advantages": torch.tensor([1.0, -1.0], dtype=torch.float64),
    "mask": torch.tensor([[1, 1, 0], [1, 1, 1]]),
}


@pytest.mark.parametrize(
    ("loss_type", "delta", "expected"),
    [
        ("grpo", None, (-1.7 / 2 + 3.3 / 3) / 2),
        ("bnpo", None, 1.6 / 5),
        ("dapo", None, 1.6 / 5),
        ("dr_grpo", None, 1.6 / (2 * MAX_LEN)),
        ("dapo", 1.4, 1.5 / 5),  # delta caps row 1 token 0: 1.5 -> 1.4
        ("grpo", 1.4, (-1.7 / 2 + 3.2 / 3) / 2),
    ],
)
def test_clipped_loss_hand_values(loss_type: str, delta: float | None, expected: float) -> None:
    loss, stats = grpo_loss(**HAND, **_options(loss_type, delta=delta))
    torch.testing.assert_close(loss, torch.tensor(expected, dtype=torch.float64))
    torch.testing.assert_close(stats["clip_ratio/high_mean"], torch.tensor(0.2))
    torch.testing.assert_close(stats["clip_ratio/low_mean"], torch.tensor(0.2))
    torch.testing.assert_close(stats["clip_ratio/region_mean"], torch.tensor(0.4))
    assert stats["kl"] == 0 and stats["entropy"] == 0


def test_clipped_gradient_hand_values() -> None:
    logprobs = HAND["logprobs"].clone().requires_grad_()
    loss, _ = grpo_loss(**(HAND | {"logprobs": logprobs}), loss_type="dapo")
    loss.backward()
    # d(-ratio * A)/d logprob = -ratio * A on unclipped tokens, 0 on clipped tokens and padding; / 5 tokens.
    expected = torch.tensor([[0.0, -0.5, 0.0], [1.5, 0.0, 1.0]], dtype=torch.float64) / 5
    torch.testing.assert_close(logprobs.grad, expected)


def test_cispo_hand_values() -> None:
    logprobs = HAND["logprobs"].clone().requires_grad_()
    loss, stats = grpo_loss(**(HAND | {"logprobs": logprobs}), loss_type="cispo", epsilon_high=1.3)
    # -min(ratio, 1.3) * A * logprob: row 0: 1.3, 1.0; row 1: -0.65, -0.75, -3.0.
    torch.testing.assert_close(loss, torch.tensor(-2.1 / 5, dtype=torch.float64))
    loss.backward()
    expected_grad = torch.tensor([[-1.3, -0.5, 0.0], [1.3, 0.5, 1.0]], dtype=torch.float64) / 5
    torch.testing.assert_close(logprobs.grad, expected_grad)
    torch.testing.assert_close(stats["clip_ratio/high_mean"], torch.tensor(0.2))
    assert stats["clip_ratio/low_mean"] == 0
    torch.testing.assert_close(stats["clip_ratio/region_mean"], torch.tensor(0.2))


def test_cispo_without_epsilon_high_caps_the_weights_at_trls_recommended_5() -> None:
    # Ratio 7 on a masked token only: the largest weight that counts is 1.5, under the cap of 5, over 0.2.
    default, stats = grpo_loss(**HAND, loss_type="cispo")
    explicit, _ = grpo_loss(**HAND, loss_type="cispo", epsilon_high=5.0)
    torch.testing.assert_close(default, explicit)
    # -ratio * A * logprob with no ratio capped (a cap of 0.2 would give 0.2 in place of 1.5 and 0.5).
    expected = -(1.5 * -1.0 + 0.5 * -2.0 - (1.5 * -0.5 + 0.5 * -1.5 + 1.0 * -3.0)) / 5
    torch.testing.assert_close(default, torch.tensor(expected, dtype=torch.float64))
    assert stats["clip_ratio/high_mean"] == 0


@pytest.mark.parametrize("estimator", ["k2", "k3"])
def test_kl_term_gradient_pulls_towards_the_reference_in_expectation(estimator: str) -> None:
    """Exact expectation over a 5-token vocabulary: each token weighted by its probability under the policy.
    The KL term's expected gradient is the KL's own for k2, the reverse KL's for k3 (Schulman 2020); k1's
    would be 0 (E[grad log pi] = 0), which is why the loss refuses k1."""
    theta = torch.tensor([0.5, -1.0, 2.0, 0.0, 1.0], dtype=torch.float64, requires_grad=True)
    ref_logprobs = torch.log_softmax(torch.tensor([0.0, 1.0, 0.5, -0.5, 0.2], dtype=torch.float64), -1)
    logprobs = torch.log_softmax(theta, -1)  # [V]
    probs = logprobs.exp().detach()
    weighted = torch.zeros((), dtype=torch.float64)
    for token in range(5):  # the per-token KL loss of a one-token completion, weighted by pi(token)
        lp = logprobs[token].view(1, 1)
        loss, _ = grpo_loss(
            lp,
            torch.zeros(1, dtype=torch.float64),
            torch.ones(1, 1),
            ref_logprobs=ref_logprobs[token].view(1, 1),
            beta=1.0,
            kl_estimator=estimator,
        )
        weighted = weighted + probs[token] * loss
    (expected_grad,) = torch.autograd.grad(weighted, theta, retain_graph=True)
    if estimator == "k2":
        kl = (logprobs.exp() * (logprobs - ref_logprobs)).sum()  # KL(pi || ref)
    else:
        kl = (ref_logprobs.exp() * (ref_logprobs - logprobs)).sum()  # KL(ref || pi)
    (true_grad,) = torch.autograd.grad(kl, theta)
    torch.testing.assert_close(expected_grad, true_grad)
    assert true_grad.abs().max() > 0.1


def test_sequence_level_hand_values() -> None:
    loss, stats = grpo_loss(**HAND, loss_type="grpo", importance_sampling_level="sequence")
    # Geometric-mean ratios: row 0 (1.5 * 0.5) ** (1/2), row 1 (1.5 * 0.5 * 1.0) ** (1/3), both unclipped.
    expected = (-(0.75**0.5) + 0.75 ** (1 / 3)) / 2
    torch.testing.assert_close(loss, torch.tensor(expected, dtype=torch.float64))
    assert stats["clip_ratio/region_mean"] == 0


def test_on_policy_default_and_stats_detached() -> None:
    logprobs = HAND["logprobs"].clone().requires_grad_()
    inputs = HAND | {"logprobs": logprobs, "old_logprobs": None}
    loss, stats = grpo_loss(**inputs, entropies=torch.ones(2, 3), ref_logprobs=HAND["old_logprobs"])
    torch.testing.assert_close(loss, torch.tensor(-(2 - 3) / 5, dtype=torch.float64))  # ratio 1: -sum(A) / 5
    assert all(not value.requires_grad and value.dim() == 0 for value in stats.values())
    assert stats["kl"] > 0 and stats["entropy"] == 1  # kl reported whenever ref_logprobs is given


# ----------------------------------------------------------------------------------------------------------
# grpo_loss: per-element reference
# ----------------------------------------------------------------------------------------------------------

CONFIGS = [
    {},
    {"delta": 1.3},
    {"epsilon_high": 0.28},
    {"beta": 0.04, "kl_estimator": "k2"},
    {"beta": 0.1, "kl_estimator": "k3", "delta": 1.5},
    {"entropy_coef": 0.01},
    {"beta": 0.04, "entropy_coef": 0.05, "epsilon": 0.1},
]


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_matches_reference(loss_type: str, level: str, config: dict) -> None:
    data = _batch(3)
    options = _options(loss_type, importance_sampling_level=level, **config)
    loss, stats = grpo_loss(**data, **options)
    torch.testing.assert_close(loss, torch.tensor(_reference_loss(**data, **options), dtype=torch.float64))
    mask = data["mask"]
    torch.testing.assert_close(stats["entropy"], (data["entropies"][mask].mean()).float())
    kl = kl_penalty(data["logprobs"], data["ref_logprobs"], options.get("kl_estimator", "k3"))
    torch.testing.assert_close(stats["kl"], kl[mask].mean().float())


def test_advantages_per_token_match_reference() -> None:
    data = _batch(4)
    data["advantages"] = torch.randn(data["logprobs"].shape, generator=torch.Generator().manual_seed(5))
    data["advantages"] = data["advantages"].double()
    for level in LEVELS:
        loss, _ = grpo_loss(**data, loss_type="grpo", importance_sampling_level=level)
        expected = _reference_loss(**data, loss_type="grpo", importance_sampling_level=level)
        torch.testing.assert_close(loss, torch.tensor(expected, dtype=torch.float64))


def test_beta_adds_kl_and_entropy_bonus_subtracts_mean_entropy() -> None:
    data = _batch(6)
    mask = data["mask"]
    base, _ = grpo_loss(**data, loss_type="dapo")
    for estimator in ("k2", "k3"):
        with_kl, _ = grpo_loss(**data, loss_type="dapo", beta=0.5, kl_estimator=estimator)
        kl = kl_penalty(data["logprobs"], data["ref_logprobs"], estimator)
        torch.testing.assert_close(with_kl - base, 0.5 * kl[mask].mean())
    with_entropy, stats = grpo_loss(**data, loss_type="dapo", entropy_coef=0.3)
    torch.testing.assert_close(with_entropy, base - 0.3 * data["entropies"][mask].mean())
    torch.testing.assert_close(stats["policy_loss"], base)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"loss_type": "ppo"}, "loss_type='ppo': must be one of grpo, bnpo, dapo, dr_grpo, cispo"),
        (
            {"importance_sampling_level": "batch"},
            "importance_sampling_level='batch': must be one of token, sequence",
        ),
        ({"kl_estimator": "k5"}, "kl_estimator='k5'"),
        ({"beta": 0.1, "ref_logprobs": None}, "ref_logprobs"),
        ({"entropy_coef": 0.1, "entropies": None}, "entropies"),
        ({"loss_type": "dr_grpo", "max_completion_length": None}, "max_completion_length"),
        ({"beta": 0.1, "kl_estimator": "k1"}, "k1.*regularises nothing.*use_kl_in_reward"),
    ],
)
def test_grpo_loss_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        grpo_loss(**(_batch(0) | kwargs))


# ----------------------------------------------------------------------------------------------------------
# grpo_loss: TRL 1.16 GRPOTrainer._compute_loss on the same tensors
# ----------------------------------------------------------------------------------------------------------


def _trl_compute_loss(data: dict, options: dict) -> tuple[torch.Tensor, dict]:
    """Run TRL's real ``GRPOTrainer._compute_loss`` with a stand-in ``self`` (1 process, no accumulation)."""
    trainer_cls = pytest.importorskip("trl.trainer.grpo_trainer").GRPOTrainer
    logprobs, mask = data["logprobs"], data["mask"].to(data["logprobs"].dtype)
    batch, length = logprobs.shape
    epsilon = options.get("epsilon", 0.2)
    entropy_coef = options.get("entropy_coef", 0.0)
    trainer = SimpleNamespace(
        loss_type=options["loss_type"],
        beta=options.get("beta", 0.0),
        epsilon_low=epsilon,
        epsilon_high=options.get("epsilon_high", epsilon),
        importance_sampling_level=options.get("importance_sampling_level", "token"),
        max_completion_length=options.get("max_completion_length"),
        args=SimpleNamespace(
            delta=options.get("delta"), use_bias_correction_kl=False, steps_per_generation=1
        ),
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        use_vllm=False,
        aux_loss_enabled=False,
        _entropy_bonus_enabled=entropy_coef != 0.0,
        entropy_coef=entropy_coef,
        use_adaptive_entropy=False,
        current_gradient_accumulation_steps=1,
        model=SimpleNamespace(training=True),
        accelerator=SimpleNamespace(
            num_processes=1,
            sync_gradients=True,
            reduce=lambda tensor, reduction: tensor,
            gather=lambda tensor: tensor,
        ),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (logprobs, data["entropies"], None),
    )
    inputs = {
        "prompt_ids": torch.zeros(batch, 2, dtype=torch.long),
        "prompt_mask": torch.ones(batch, 2, dtype=torch.long),
        "completion_ids": torch.zeros(batch, length, dtype=torch.long),
        "completion_mask": mask,
        "advantages": data["advantages"],
        "old_per_token_logps": data["old_logprobs"],
        "ref_per_token_logps": data["ref_logprobs"],
        "num_items_in_batch": mask.sum(),
    }
    loss = trainer_cls._compute_loss(trainer, None, inputs)
    return loss, trainer._metrics["train"]


@pytest.mark.parametrize("delta", [None, 1.3])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_matches_trl(loss_type: str, level: str, beta: float, delta: float | None) -> None:
    data = _batch(7, batch=6, length=7)
    options = _options(
        loss_type,
        importance_sampling_level=level,
        beta=beta,
        delta=delta,
        epsilon_high=1.1 if loss_type == "cispo" else 0.28,
        entropy_coef=0.02 if beta else 0.0,
    )

    logprobs = data["logprobs"].clone().requires_grad_()
    loss, stats = grpo_loss(**(data | {"logprobs": logprobs}), **options)
    trl_logprobs = data["logprobs"].clone().requires_grad_()
    trl_loss, metrics = _trl_compute_loss(data | {"logprobs": trl_logprobs}, options)

    torch.testing.assert_close(loss, trl_loss, atol=1e-6, rtol=0)
    loss.backward()
    trl_loss.backward()
    torch.testing.assert_close(logprobs.grad, trl_logprobs.grad, atol=1e-6, rtol=0)
    assert stats["entropy"].item() == pytest.approx(metrics["entropy"][0], abs=1e-6)
    if beta:
        assert stats["kl"].item() == pytest.approx(metrics["kl"][0], abs=1e-6)
        assert stats["policy_loss"].item() == pytest.approx(metrics["policy_loss"][0], abs=1e-6)
    if loss_type == "cispo":
        assert stats["clip_ratio/high_mean"].item() == pytest.approx(metrics["cispo_clip_ratio"][0], abs=1e-6)
    else:
        for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
            assert stats[key].item() == pytest.approx(metrics[key][0], abs=1e-6)
    assert stats["clip_ratio/region_mean"] > 0 or level == "sequence"


# ----------------------------------------------------------------------------------------------------------
# grpo_loss: invariances and properties
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_padding_invariance(loss_type: str, level: str) -> None:
    data = _batch(8)
    gen = torch.Generator().manual_seed(9)
    extra = 3
    padded = {
        key: torch.cat(
            [value, torch.randn(value.shape[0], extra, generator=gen, dtype=value.dtype) * 50], dim=1
        )
        for key, value in data.items()
        if key not in ("advantages", "mask")
    }
    padded["mask"] = torch.cat([data["mask"], torch.zeros(data["mask"].shape[0], extra, dtype=torch.bool)], 1)
    padded["logprobs"][:, -1] = -torch.inf  # padding may hold anything, even -inf
    padded["advantages"] = data["advantages"]
    options = _options(loss_type, importance_sampling_level=level, beta=0.04, entropy_coef=0.01)

    logprobs = data["logprobs"].clone().requires_grad_()
    loss, stats = grpo_loss(**(data | {"logprobs": logprobs}), **options)
    loss.backward()
    padded_logprobs = padded["logprobs"].clone().requires_grad_()
    padded_loss, padded_stats = grpo_loss(**(padded | {"logprobs": padded_logprobs}), **options)
    padded_loss.backward()

    torch.testing.assert_close(padded_loss, loss)
    torch.testing.assert_close(padded_logprobs.grad[:, :-extra], logprobs.grad)
    assert torch.equal(
        padded_logprobs.grad[:, -extra:], torch.zeros(data["mask"].shape[0], extra, dtype=torch.float64)
    )
    for key, value in stats.items():
        torch.testing.assert_close(padded_stats[key], value)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_zero_variance_group_gives_zero_gradient(loss_type: str, level: str) -> None:
    data = _batch(10, batch=6)
    data["advantages"] = group_advantages(
        torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.5], dtype=torch.float64), 3
    )
    logprobs = data["logprobs"].clone().requires_grad_()
    loss, stats = grpo_loss(
        **(data | {"logprobs": logprobs}), **_options(loss_type, importance_sampling_level=level)
    )
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(value) for value in stats.values())
    assert torch.equal(logprobs.grad[:3], torch.zeros_like(logprobs.grad[:3]))
    assert logprobs.grad[3:].abs().sum() > 0


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_micro_batches_sum_to_full_batch(loss_type: str, level: str) -> None:
    data = _batch(11, batch=6, length=6)
    data["mask"][3] = False  # an empty completion must not break the totals
    options = _options(loss_type, importance_sampling_level=level, beta=0.04, entropy_coef=0.01)

    logprobs = data["logprobs"].clone().requires_grad_()
    full_loss, _ = grpo_loss(**(data | {"logprobs": logprobs}), **options)
    full_loss.backward()

    micro_logprobs = data["logprobs"].clone().requires_grad_()
    totals = {"total_tokens": data["mask"].sum().double(), "total_sequences": 6}
    micro_losses = [
        grpo_loss(
            **{key: value[rows] for key, value in (data | {"logprobs": micro_logprobs}).items()},
            **options,
            **totals,
        )[0]
        for rows in (slice(0, 1), slice(1, 4), slice(4, 6))
    ]
    summed = torch.stack(micro_losses).sum()
    summed.backward()
    torch.testing.assert_close(summed, full_loss)
    torch.testing.assert_close(micro_logprobs.grad, logprobs.grad)


def test_all_zero_mask_gives_zero_loss() -> None:
    data = _batch(12) | {"mask": torch.zeros(4, 5, dtype=torch.bool)}
    for loss_type in LOSS_TYPES:
        for level in LEVELS:
            loss, stats = grpo_loss(**data, **_options(loss_type, importance_sampling_level=level, beta=0.1))
            assert loss == 0
            assert all(torch.isfinite(value) for value in stats.values())


@settings(max_examples=30, deadline=None)
@given(
    data=st.data(),
    batch=st.integers(1, 3),
    length=st.integers(1, 4),
    loss_type=st.sampled_from(LOSS_TYPES),
    level=st.sampled_from(LEVELS),
)
def test_loss_finite_for_finite_inputs(
    data: st.DataObject, batch: int, length: int, loss_type: str, level: str
) -> None:
    def tensor(low: float, high: float) -> torch.Tensor:
        values = st.lists(st.floats(low, high, width=32), min_size=batch * length, max_size=batch * length)
        return torch.tensor(data.draw(values)).view(batch, length)

    logprobs = tensor(-1e4, 0.0).requires_grad_()
    mask = torch.tensor(data.draw(st.lists(st.booleans(), min_size=batch * length, max_size=batch * length)))
    loss, stats = grpo_loss(
        logprobs,
        torch.tensor(data.draw(st.lists(st.floats(-10, 10), min_size=batch, max_size=batch))),
        mask.view(batch, length).int(),
        old_logprobs=tensor(-1e4, 0.0),
        ref_logprobs=tensor(-1e4, 0.0),
        entropies=tensor(0.0, 20.0),
        **_options(loss_type, importance_sampling_level=level, beta=0.04, entropy_coef=0.01, delta=2.0),
    )
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(logprobs.grad).all()
    assert all(torch.isfinite(value) for value in stats.values())
