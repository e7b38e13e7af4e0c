"""Evaluation metrics: pass@k, majority vote, and DDP-syncable torchmetrics accuracies, for GSM8K answers
(`GSM8KAccuracy`) and for any reward function that judges completions (`RewardAccuracy`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric

from grpo_lightning.core.rewards.verifiable import extract_answer, reference_answer

__all__ = ["GSM8KAccuracy", "RewardAccuracy", "majority_vote", "pass_at_k"]

# Per-problem scores summed by GSM8KAccuracy, lenient then strict extraction.
_SCORES = ("mean", "mean_strict", "pass_k", "pass_k_strict", "maj_k", "maj_k_strict")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k estimate from `n` samples of which `c` are correct (Chen et al. 2021, Codex).

    Computes ``1 - C(n - c, k) / C(n, k)`` as ``1 - prod_{i=n-c+1}^{n} (1 - k / i)``, which avoids the
    huge binomials of the closed form.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        # Every k-subset contains a correct sample.
        return 1.0
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product


def majority_vote(answers: Sequence[str | None]) -> str | None:
    """The most common non-None answer; a tie goes to the tied answer that appears first in `answers`.

    None when every answer is None (or there are none).
    """
    counts = Counter(a for a in answers if a is not None)
    if not counts:
        return None
    # Counter keeps first-insertion order and max() returns the first maximum, hence the tie rule.
    return max(counts, key=counts.__getitem__)


class GSM8KAccuracy(Metric):
    """Accuracy of `k` sampled completions per GSM8K problem, strict (`#### N`) and lenient extraction.

    `update(completions, answers)` takes ``k * len(answers)`` completions, the `k` samples of problem `i`
    contiguous at ``[i * k, (i + 1) * k)``. States are sums reduced with ``"sum"``, so the metric syncs
    across DDP processes. `compute()` returns a dict of scalar tensors; the key names are literal
    (``"pass_at_k"``, not ``"pass_at_4"``) so logs keep one name whatever `k` is, and spell pass@k and
    maj@k without the "@" that MLflow rewrites in a metric name:

    - ``accuracy`` / ``accuracy_strict``: mean over problems of the fraction of correct samples (mean@k);
      with ``k=1`` and greedy decoding this is greedy pass@1.
    - ``pass_at_k`` / ``pass_at_k_strict``: fraction of problems with a correct sample among the `k`.
    - ``maj_at_k`` / ``maj_at_k_strict``: fraction of problems whose majority answer (`majority_vote`) is
      correct.
    - ``format``: fraction of completions with a strict `#### N` answer.
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False
    KEYS = (
        "accuracy",
        "accuracy_strict",
        "pass_at_k",
        "pass_at_k_strict",
        "maj_at_k",
        "maj_at_k_strict",
        "format",
    )

    def __init__(self, k: int = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.k = k
        for name in ("problems", "formatted", *_SCORES):
            # float32, not float64: MPS has no float64, and sums of k-ths stay exact far past GSM8K's size.
            self.add_state(name, default=torch.tensor(0.0), dist_reduce_fx="sum")

    def update(self, completions: Sequence[str], answers: Sequence[str]) -> None:
        """Score ``k * len(answers)`` grouped completions against GSM8K answers (or plain numbers)."""
        if len(completions) != self.k * len(answers):
            raise ValueError(
                f"expected k * len(answers) = {self.k} * {len(answers)} completions, got {len(completions)}"
            )
        totals = dict.fromkeys(_SCORES, 0.0)
        formatted = 0
        for i, answer in enumerate(answers):
            reference = reference_answer(answer)
            group = completions[i * self.k : (i + 1) * self.k]
            for suffix, strict in (("", False), ("_strict", True)):
                extracted = [extract_answer(c, strict=strict) for c in group]
                correct = sum(e == reference for e in extracted)
                totals["mean" + suffix] += correct / self.k
                totals["pass_k" + suffix] += pass_at_k(self.k, correct, self.k)
                totals["maj_k" + suffix] += float(majority_vote(extracted) == reference)
                if strict:
                    formatted += sum(e is not None for e in extracted)
        self.problems += len(answers)
        self.formatted += formatted
        for name, total in totals.items():
            setattr(self, name, getattr(self, name) + total)

    def compute(self) -> dict[str, Tensor]:
        """The metrics over all problems seen (nan before any update), under `KEYS`."""
        problems = self.problems
        return {
            "accuracy": self.mean / problems,
            "accuracy_strict": self.mean_strict / problems,
            "pass_at_k": self.pass_k / problems,
            "pass_at_k_strict": self.pass_k_strict / problems,
            "maj_at_k": self.maj_k / problems,
            "maj_at_k_strict": self.maj_k_strict / problems,
            "format": self.formatted / (problems * self.k),
        }


class RewardAccuracy(Metric):
    """Accuracy of `k` sampled completions per problem as a reward function judges them.

    `update(rewards)` takes one reward per completion, ``k`` contiguous per problem; a completion is right
    when its reward reaches `full_marks` (1.0, as a verifier such as math-verify's gives a right answer).
    `compute()` returns ``accuracy`` (mean over problems of the share right, mean@k) and ``pass_at_k`` (share
    of problems with a right sample). States are sums, so the metric syncs across DDP processes.
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False
    KEYS = ("accuracy", "pass_at_k")

    def __init__(self, k: int = 1, full_marks: float = 1.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.k = k
        self.full_marks = full_marks
        for name in ("problems", "mean", "pass_k"):
            self.add_state(name, default=torch.tensor(0.0), dist_reduce_fx="sum")

    def update(self, rewards: Sequence[float]) -> None:
        """Fold in ``k * N`` rewards, the `k` samples of problem `i` at ``[i * k, (i + 1) * k)``."""
        if len(rewards) % self.k:
            raise ValueError(f"expected a multiple of k = {self.k} rewards, got {len(rewards)}")
        right = (torch.tensor(rewards, dtype=torch.float32) >= self.full_marks).view(-1, self.k)  # [N, k]
        self.problems += right.size(0)
        self.mean += right.float().mean(dim=1).sum().to(self.mean.device)
        self.pass_k += right.any(dim=1).float().sum().to(self.pass_k.device)

    def compute(self) -> dict[str, Tensor]:
        """The metrics over all problems seen (nan before any update)."""
        return {"accuracy": self.mean / self.problems, "pass_at_k": self.pass_k / self.problems}
