"""Tests for grpo_lightning.core.algorithm.loss's kl_penalty and grpo_loss: hand-computed values and a
per-element reference. Advantages are in test_advantages.py, TRL 1.16's loss in test_loss_vs_trl.py, the
loss's properties in test_loss_properties.py; those use this file's random batches and options."""

import math
from typing import get_args

import pytest
import torch

from grpo_lightning.core.algorithm.kl import KLOptions, kl_penalty
from grpo_lightning.core.algorithm.loss import LossType, PolicyLossOptions, grpo_loss
from grpo_lightning.core.config import GRPOConfig

LOSS_TYPES = get_args(LossType)
LEVELS = ("token", "sequence")
MAX_LEN = 8  # max_completion_length used for dr_grpo throughout


def loss_options(loss_type: str, **kwargs) -> dict:
    """Options by their flat (TRL) names, as the reference and TRL's code read them; cispo gets a raw ratio
    bound for epsilon_high, as in TRL. `sections` turns them into grpo_loss's arguments."""
    options = {"loss_type": loss_type, "max_completion_length": MAX_LEN}
    if loss_type == "cispo":
        options["epsilon_high"] = 1.3
    return options | kwargs


def sections(options: dict) -> dict:
    """grpo_loss's option arguments (its sections and max_completion_length) from flat names, through
    GRPOConfig's alias table."""
    config = GRPOConfig(**options)
    return {
        "options": config.loss,
        "kl": config.kl,
        "max_completion_length": config.sampling.max_completion_length,
    }


def random_batch(seed: int = 0, batch: int = 4, length: int = 5, dtype: torch.dtype = torch.float64) -> dict:
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
    use_bias_correction_kl=True,
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
                kl = _kl_reference(float(logprobs[b, t]), float(ref_logprobs[b, t]), kl_estimator)
                loss += beta * kl * (ratio if use_bias_correction_kl else 1.0)
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
# kl_penalty
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_penalty_formula(estimator: str) -> None:
    data = random_batch(2)
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
    loss, stats = grpo_loss(**HAND, **sections(loss_options(loss_type, delta=delta)))
    torch.testing.assert_close(loss, torch.tensor(expected, dtype=torch.float64))
    torch.testing.assert_close(stats["clip_ratio/high_mean"], torch.tensor(0.2))
    torch.testing.assert_close(stats["clip_ratio/low_mean"], torch.tensor(0.2))
    torch.testing.assert_close(stats["clip_ratio/region_mean"], torch.tensor(0.4))
    assert stats["kl"] == 0 and stats["entropy"] == 0


def test_clipped_gradient_hand_values() -> None:
    logprobs = HAND["logprobs"].clone().requires_grad_()
    loss, _ = grpo_loss(**(HAND | {"logprobs": logprobs}), options=PolicyLossOptions("dapo"))
    loss.backward()
    # d(-ratio * A)/d logprob = -ratio * A on unclipped tokens, 0 on clipped tokens and padding; / 5 tokens.
    expected = torch.tensor([[0.0, -0.5, 0.0], [1.5, 0.0, 1.0]], dtype=torch.float64) / 5
    torch.testing.assert_close(logprobs.grad, expected)


def test_bnpo_is_each_micro_batch_token_mean_over_their_number_hand_values() -> None:
    """HAND's rows as two micro-batches of 2 and 3 tokens (losses -1.7 and 3.3 summed): bnpo gives each
    its own token mean / 2, whatever total_tokens says; dapo divides both by the step's 5 tokens."""
    rows = (slice(0, 1), slice(1, 2))
    totals = {"total_tokens": 5.0, "total_sequences": 2, "num_micro_batches": 2}
    options = {loss_type: PolicyLossOptions(loss_type) for loss_type in ("bnpo", "dapo")}
    bnpo, dapo = (
        [grpo_loss(**{key: value[r] for key, value in HAND.items()}, options=o, **totals)[0] for r in rows]
        for o in options.values()
    )
    expected = torch.tensor([-1.7 / 2 / 2, 3.3 / 3 / 2], dtype=torch.float64)
    torch.testing.assert_close(torch.stack(bnpo), expected)
    torch.testing.assert_close(torch.stack(dapo), torch.tensor([-1.7 / 5, 3.3 / 5], dtype=torch.float64))
    without_total = grpo_loss(**{key: value[rows[1]] for key, value in HAND.items()}, options=options["bnpo"])
    torch.testing.assert_close(without_total[0], expected[1] * 2)  # one micro-batch: its token mean


def test_cispo_hand_values() -> None:
    logprobs = HAND["logprobs"].clone().requires_grad_()
    loss, stats = grpo_loss(
        **(HAND | {"logprobs": logprobs}), options=PolicyLossOptions("cispo", epsilon_high=1.3)
    )
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
    default, stats = grpo_loss(**HAND, options=PolicyLossOptions("cispo"))
    explicit, _ = grpo_loss(**HAND, options=PolicyLossOptions("cispo", epsilon_high=5.0))
    torch.testing.assert_close(default, explicit)
    # -ratio * A * logprob with no ratio capped (a cap of 0.2 would give 0.2 in place of 1.5 and 0.5).
    expected = -(1.5 * -1.0 + 0.5 * -2.0 - (1.5 * -0.5 + 0.5 * -1.5 + 1.0 * -3.0)) / 5
    torch.testing.assert_close(default, torch.tensor(expected, dtype=torch.float64))
    assert stats["clip_ratio/high_mean"] == 0


@pytest.mark.parametrize(
    ("estimator", "bias_correction", "direction"),
    [("k2", False, "reverse"), ("k3", False, "forward"), ("k3", True, "reverse")],
)
def test_kl_term_gradient_pulls_towards_the_reference_in_expectation(
    estimator: str, bias_correction: bool, direction: str
) -> None:
    """Exact expectation over a 5-token vocabulary: each token weighted by its probability under the policy.
    The KL term's expected gradient is the reverse KL's, KL(pi || ref), for k2; the forward KL's,
    KL(ref || pi), for k3, and the reverse KL's once the importance ratio weighs it (use_bias_correction_kl,
    TRL's default). k1's would be 0 (E[grad log pi] = 0), which is why the loss refuses k1."""
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
            kl=KLOptions(beta=1.0, estimator=estimator, bias_correction=bias_correction),
            ref_logprobs=ref_logprobs[token].view(1, 1),
        )
        weighted = weighted + probs[token] * loss
    (expected_grad,) = torch.autograd.grad(weighted, theta, retain_graph=True)
    if direction == "reverse":
        kl = (logprobs.exp() * (logprobs - ref_logprobs)).sum()  # KL(pi || ref)
    else:
        kl = (ref_logprobs.exp() * (ref_logprobs - logprobs)).sum()  # KL(ref || pi)
    (true_grad,) = torch.autograd.grad(kl, theta)
    torch.testing.assert_close(expected_grad, true_grad)
    assert true_grad.abs().max() > 0.1


def test_sequence_level_hand_values() -> None:
    loss, stats = grpo_loss(**HAND, options=PolicyLossOptions("grpo", importance_sampling_level="sequence"))
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
    {"beta": 0.1, "kl_estimator": "k3", "use_bias_correction_kl": False},
    {"entropy_coef": 0.01},
    {"beta": 0.04, "entropy_coef": 0.05, "epsilon": 0.1},
]


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_matches_reference(loss_type: str, level: str, config: dict) -> None:
    data = random_batch(3)
    if loss_type == "cispo":  # delta caps the clipped surrogate only; under cispo's cap it is refused
        config = {key: value for key, value in config.items() if key != "delta"}
    options = loss_options(loss_type, importance_sampling_level=level, **config)
    loss, stats = grpo_loss(**data, **sections(options))
    torch.testing.assert_close(loss, torch.tensor(_reference_loss(**data, **options), dtype=torch.float64))
    mask = data["mask"]
    torch.testing.assert_close(stats["entropy"], (data["entropies"][mask].mean()).float())
    kl = kl_penalty(data["logprobs"], data["ref_logprobs"], options.get("kl_estimator", "k3"))
    log_ratio = data["logprobs"] - data["old_logprobs"]  # [B, T]
    if level == "sequence":
        log_ratio = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)  # [B, 1]
    bias_corrected = options.get("use_bias_correction_kl", True)
    weighted = kl * log_ratio.exp() if bias_corrected else kl  # the KL as the loss weighs it
    torch.testing.assert_close(stats["kl"], weighted.expand_as(kl)[mask].mean().float())


def test_advantages_per_token_match_reference() -> None:
    data = random_batch(4)
    data["advantages"] = torch.randn(data["logprobs"].shape, generator=torch.Generator().manual_seed(5))
    data["advantages"] = data["advantages"].double()
    for level in LEVELS:
        loss, _ = grpo_loss(**data, options=PolicyLossOptions("grpo", importance_sampling_level=level))
        expected = _reference_loss(**data, loss_type="grpo", importance_sampling_level=level)
        torch.testing.assert_close(loss, torch.tensor(expected, dtype=torch.float64))


def test_beta_adds_kl_and_entropy_bonus_subtracts_mean_entropy() -> None:
    data = random_batch(6)
    mask = data["mask"]
    base, _ = grpo_loss(**data, options=PolicyLossOptions("dapo"))
    for estimator in ("k2", "k3"):
        with_kl, _ = grpo_loss(**data, kl=KLOptions(beta=0.5, estimator=estimator, bias_correction=False))
        kl = kl_penalty(data["logprobs"], data["ref_logprobs"], estimator)
        torch.testing.assert_close(with_kl - base, 0.5 * kl[mask].mean())
    with_entropy, stats = grpo_loss(**data, options=PolicyLossOptions("dapo", entropy_coef=0.3))
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
        ({"kl_estimator": "k5"}, r"kl.estimator='k5' \(kl_estimator\): must be one of k1, k2, k3"),
        ({"beta": 0.1, "kl_estimator": "k1"}, "k1.*regularises nothing.*use_kl_in_reward"),
    ],
)
def test_loss_options_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        sections(kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kl": KLOptions(beta=0.1), "ref_logprobs": None}, "ref_logprobs"),
        ({"options": PolicyLossOptions(entropy_coef=0.1), "entropies": None}, "entropies"),
        ({"options": PolicyLossOptions("dr_grpo")}, "max_completion_length"),
    ],
)
def test_grpo_loss_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        grpo_loss(**(random_batch(0) | kwargs))
