"""pass_at_k, majority vote and GSM8KAccuracy, including the DDP-style merge of two metric states."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torchmetrics.utilities.data import dim_zero_sum

from grpo_lightning.core.metrics import GSM8KAccuracy, majority_vote, pass_at_k
from tests.helpers import ACCURACY_KEYS


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_matches_closed_form(n: int) -> None:
    for c in range(n + 1):
        for k in range(1, n + 1):
            expected = 1.0 - math.comb(n - c, k) / math.comb(n, k)
            assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12), (n, c, k)


def test_pass_at_k_edges() -> None:
    assert pass_at_k(10, 0, 3) == 0.0
    assert pass_at_k(10, 8, 3) == 1.0  # k > n - c: every 3-subset holds a correct sample
    assert pass_at_k(1, 1, 1) == 1.0
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    # The product form stays finite where the binomials would be astronomically large.
    assert 0.0 < pass_at_k(10_000, 5, 100) < 1.0
    for n, c, k in ((3, 4, 1), (3, -1, 1), (3, 1, 0), (3, 1, 4)):
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)


def test_majority_vote() -> None:
    assert majority_vote(["5", "7", "7", None, None, None]) == "7"  # None never wins
    assert majority_vote(["5", "7", "7", "5"]) == "5"  # tie: first to appear wins
    assert majority_vote(["7", "5", "5", "7"]) == "7"
    assert majority_vote([None, "3", "4"]) == "3"
    assert majority_vote([None, None]) is None
    assert majority_vote([]) is None


def _values(metric: GSM8KAccuracy) -> dict[str, float]:
    result = metric.compute()
    assert set(result) == set(ACCURACY_KEYS)
    return {key: value.item() for key, value in result.items()}


def test_k1() -> None:
    metric = GSM8KAccuracy(k=1)
    completions = [
        "2 + 3 = 5\n#### 5",  # strict and lenient right
        "The answer is 7.",  # lenient right only
        "#### 3",  # wrong
        "I don't know.",  # no answer
    ]
    metric.update(completions, ["#### 5", "Reasoning.\n#### 7", "4", "#### 1,000"])
    assert _values(metric) == pytest.approx(
        {
            "accuracy": 2 / 4,
            "accuracy_strict": 1 / 4,
            "pass_at_k": 2 / 4,
            "pass_at_k_strict": 1 / 4,
            "maj_at_k": 2 / 4,
            "maj_at_k_strict": 1 / 4,
            "format": 2 / 4,
        }
    )


# Two problems, k = 4 samples each.
K4_COMPLETIONS = [
    # Problem 1, reference 5: 1 strict right, 1 lenient-only right, 2 agreeing wrong.
    "#### 5",
    "\\boxed{5}",
    "#### 6",
    "#### 6",
    # Problem 2, reference 10: 1 lenient-only right, 2 unanswered, 1 strict wrong.
    "The answer is 10.",
    "Hmm.",
    "",
    "#### 11",
]
K4_ANSWERS = ["#### 5", "#### 10"]
K4_EXPECTED = {
    "accuracy": (2 / 4 + 1 / 4) / 2,
    "accuracy_strict": (1 / 4 + 0 / 4) / 2,
    "pass_at_k": (1 + 1) / 2,
    "pass_at_k_strict": (1 + 0) / 2,
    # Lenient votes tie 2-2 (5 vs 6) and 1-1 (10 vs 11): the first to appear, the right one, wins both.
    "maj_at_k": (1 + 1) / 2,
    # Strict votes: 6 beats 5 two to one; 11 is the only strict answer.
    "maj_at_k_strict": (0 + 0) / 2,
    "format": 4 / 8,
}


def test_k4() -> None:
    metric = GSM8KAccuracy(k=4)
    metric.update(K4_COMPLETIONS, K4_ANSWERS)
    assert _values(metric) == pytest.approx(K4_EXPECTED)


def test_k4_majority_beats_minority() -> None:
    metric = GSM8KAccuracy(k=4)
    metric.update(["#### 5", "#### 6", "#### 6", "#### 6"], ["#### 5"])
    values = _values(metric)
    assert values["pass_at_k"] == values["pass_at_k_strict"] == 1.0
    assert values["maj_at_k"] == values["maj_at_k_strict"] == 0.0
    assert values["accuracy"] == pytest.approx(0.25)


def test_updates_accumulate_and_reset() -> None:
    metric = GSM8KAccuracy(k=4)
    metric.update(K4_COMPLETIONS[:4], K4_ANSWERS[:1])
    metric.update(K4_COMPLETIONS[4:], K4_ANSWERS[1:])
    assert _values(metric) == pytest.approx(K4_EXPECTED)
    metric.reset()
    metric.update(["#### 5"] * 4, ["5"])
    assert all(value == 1.0 for value in _values(metric).values())


def test_merge_state_gives_global_value() -> None:
    """Two 'processes' each see one problem; combining their states equals one metric that saw both."""
    rank0, rank1 = GSM8KAccuracy(k=4), GSM8KAccuracy(k=4)
    rank0.update(K4_COMPLETIONS[:4], K4_ANSWERS[:1])
    rank1.update(K4_COMPLETIONS[4:], K4_ANSWERS[1:])
    # What a DDP sync does: gather each state from every process and apply its registered reduction.
    synced = copy.deepcopy(rank0)
    assert set(synced._reductions) == set(synced._defaults)
    for name, reduce in synced._reductions.items():
        assert reduce is dim_zero_sum
        setattr(synced, name, reduce(torch.stack([getattr(rank0, name), getattr(rank1, name)])))
    assert _values(synced) == pytest.approx(K4_EXPECTED)
    rank0.merge_state(rank1)
    assert _values(rank0) == pytest.approx(K4_EXPECTED)


def test_wrong_completion_count_raises() -> None:
    metric = GSM8KAccuracy(k=4)
    with pytest.raises(ValueError, match="4 \\* 2"):
        metric.update(["#### 1"] * 7, ["1", "2"])
    with pytest.raises(ValueError):
        GSM8KAccuracy(k=0)
