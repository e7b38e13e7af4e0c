"""Invariances and properties of grpo_loss: padding changes nothing, a zero-variance group gives no
gradient, micro-batches sum to the full batch (bnpo's when they hold as many tokens), an all-zero mask
gives zero loss, finite inputs give a finite loss."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_lightning.core.algorithm.advantages import group_advantages
from grpo_lightning.core.algorithm.loss import grpo_loss
from tests.test_loss import LEVELS, LOSS_TYPES, loss_options, random_batch, sections


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_padding_invariance(loss_type: str, level: str) -> None:
    data = random_batch(8)
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
    options = sections(loss_options(loss_type, importance_sampling_level=level, beta=0.04, entropy_coef=0.01))

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
    data = random_batch(10, batch=6)
    data["advantages"] = group_advantages(
        torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.5], dtype=torch.float64), 3
    )
    logprobs = data["logprobs"].clone().requires_grad_()
    loss, stats = grpo_loss(
        **(data | {"logprobs": logprobs}),
        **sections(loss_options(loss_type, importance_sampling_level=level)),
    )
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(value) for value in stats.values())
    assert torch.equal(logprobs.grad[:3], torch.zeros_like(logprobs.grad[:3]))
    assert logprobs.grad[3:].abs().sum() > 0


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", [loss_type for loss_type in LOSS_TYPES if loss_type != "bnpo"])
def test_micro_batches_sum_to_full_batch(loss_type: str, level: str) -> None:
    """bnpo's micro-batches weigh their tokens by their own counts (TRL's): they sum to the full batch only
    when they hold as many tokens each (the next test)."""
    data = random_batch(11, batch=6, length=6)
    data["mask"][3] = False  # an empty completion must not break the totals
    options = sections(loss_options(loss_type, importance_sampling_level=level, beta=0.04, entropy_coef=0.01))

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


@pytest.mark.parametrize("level", LEVELS)
def test_bnpo_micro_batches_of_equal_token_counts_sum_to_full_batch(level: str) -> None:
    data = random_batch(11, batch=4, length=6)
    data["mask"] = torch.arange(6) < torch.tensor([[6], [2], [3], [5]])  # micro-batches of 8 tokens each
    options = sections(loss_options("bnpo", importance_sampling_level=level, beta=0.04, entropy_coef=0.01))

    logprobs = data["logprobs"].clone().requires_grad_()
    full_loss, _ = grpo_loss(**(data | {"logprobs": logprobs}), **options)
    full_loss.backward()
    micro_logprobs = data["logprobs"].clone().requires_grad_()
    micro_losses = [
        grpo_loss(
            **{key: value[rows] for key, value in (data | {"logprobs": micro_logprobs}).items()},
            **options,
            total_tokens=16.0,
            total_sequences=4,
            num_micro_batches=2,
        )[0]
        for rows in (slice(0, 2), slice(2, 4))
    ]
    summed = torch.stack(micro_losses).sum()
    summed.backward()
    torch.testing.assert_close(summed, full_loss)
    torch.testing.assert_close(micro_logprobs.grad, logprobs.grad)


def test_all_zero_mask_gives_zero_loss() -> None:
    data = random_batch(12) | {"mask": torch.zeros(4, 5, dtype=torch.bool)}
    for loss_type in LOSS_TYPES:
        for level in LEVELS:
            loss, stats = grpo_loss(
                **data, **sections(loss_options(loss_type, importance_sampling_level=level, beta=0.1))
            )
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
        **sections(
            loss_options(loss_type, importance_sampling_level=level, beta=0.04, entropy_coef=0.01, delta=2.5)
        ),
    )
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(logprobs.grad).all()
    assert all(torch.isfinite(value) for value in stats.values())
