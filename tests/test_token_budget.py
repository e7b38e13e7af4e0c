"""The token-budget partition of a rollout into micro-batches: every row once, groups intact, the budget
held (a unit too long for it alone gets its own micro-batch), rows of similar length together."""

from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_lightning.core.token_budget import (
    over_budget,
    padded_tokens,
    padding_share,
    token_budget_micro_batches,
)


def unit_longest(lengths, rows, group_size):
    """The longest row of each unit (group) in `rows`."""
    starts = sorted({r - r % group_size for r in rows})
    return [max(lengths[s : s + group_size]) for s in starts]


@settings(max_examples=300, deadline=None)
@given(
    group_size=st.integers(1, 4),
    groups=st.integers(1, 12),
    budget=st.integers(1, 400),
    data=st.data(),
)
def test_partition_invariants(group_size, groups, budget, data):
    lengths = data.draw(
        st.lists(st.integers(1, 100), min_size=groups * group_size, max_size=groups * group_size)
    )
    micro_batches = token_budget_micro_batches(lengths, budget, group_size)

    rows = sorted(r for mb in micro_batches for r in mb)
    assert rows == list(range(len(lengths)))  # every row exactly once
    for mb in micro_batches:
        assert mb == sorted(mb)
        for r in mb:  # a group never straddles two micro-batches
            assert all(g in mb for g in range(r - r % group_size, r - r % group_size + group_size))
    too_long = over_budget(lengths, micro_batches, budget)
    for i, mb in enumerate(micro_batches):
        if i in too_long:  # over the budget only as one unit that does not fit it alone
            assert len(mb) == group_size and group_size * max(lengths[r] for r in mb) > budget
    # Longest first, and contiguous in length: no unit of a later micro-batch is longer than one before.
    for earlier, later in pairwise(micro_batches):
        assert min(unit_longest(lengths, earlier, group_size)) >= max(
            unit_longest(lengths, later, group_size)
        )
    # Padding each micro-batch to its own longest row never costs more than padding all to the longest.
    assert sum(lengths) <= padded_tokens(lengths, micro_batches) <= len(lengths) * max(lengths)


def test_a_worked_example():
    lengths = [300, 120, 110, 1000, 130, 100]
    # Budget 400: 1000 alone (over), 300 alone (300 + 130 padded to 300 would be 600), then
    # 130, 120, 110 (3 x 130 = 390), then 100.
    micro_batches = token_budget_micro_batches(lengths, 400)
    assert micro_batches == [[3], [0], [1, 2, 4], [5]]
    assert over_budget(lengths, micro_batches, 400) == [0]
    assert padded_tokens(lengths, micro_batches) == 1000 + 300 + 390 + 100
    assert padding_share(lengths, 6 * 1000) == pytest.approx(1 - 1760 / 6000)

    # Groups of 2 (shared prompts): rows (0, 1), (2, 3), (4, 5) move together.
    assert token_budget_micro_batches(lengths, 2000, group_size=2) == [[2, 3], [0, 1, 4, 5]]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="5 rows cannot be cut into groups of 2"):
        token_budget_micro_batches([1] * 5, 10, group_size=2)
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch=0: must be >= 1"):
        token_budget_micro_batches([1], 0)


def test_the_module_refuses_the_budget_until_the_step_uses_it(tiny_model_dir):
    from grpo_lightning.core.config import GRPOConfig
    from grpo_lightning.training.module import GRPOModule

    with pytest.raises(
        ValueError, match="^grpo.max_tokens_per_micro_batch: the training step does not use it yet"
    ):
        GRPOModule(tiny_model_dir, grpo=GRPOConfig(max_tokens_per_micro_batch=1024))
