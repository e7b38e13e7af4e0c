"""The reward audit: the reward functions scored on the data's own reference solutions and on corrupted
copies of them (a changed final number, two different final answers, no answer), so that a reward a policy
can earn without the answer shows before training starts.

- `audit_reward_funcs` / `AuditReport`: the audit of any reward functions, and its table;
- `audit_module_rewards`: the audit of a module's `reward_funcs` on data rows (for `cli.py audit` and the
  pre-flight);
- `audit_rewards`: the mean reward of each function per case, the audit's raw numbers.

No Lightning here: the callback that runs the audit when `fit` starts is `audit_callback.RewardAuditCallback`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from grpo_lightning.core.rewards.scoring import RewardInputs, call_reward
from grpo_lightning.core.rewards.verifiable import (
    CALCULATOR_RE,
    canonical_number,
    reference_answer,
    reward_name,
)

__all__ = [
    "AUDIT_CASES",
    "AuditReport",
    "audit_module_rewards",
    "audit_reward_funcs",
    "audit_rewards",
    "auditable",
]


AUDIT_CASES = ("reference", "wrong_number", "two_answers", "no_answer")


def _corruptions(solution: str) -> dict[str, str]:
    """The reference solution and corrupted copies that any sound reward must score differently."""
    reference = Fraction(reference_answer(solution))
    wrong = canonical_number(reference + 1)
    reasoning = solution.rpartition("####")[0].rstrip()
    return {
        "reference": solution,
        # The correct number usually still appears in the reasoning: only the final answer is wrong.
        "wrong_number": f"{reasoning}\n#### {wrong}",
        "two_answers": f"{solution}\n#### {wrong}",
        "no_answer": re.sub(r"\d", "N", CALCULATOR_RE.sub("", reasoning)),
    }


def audit_rewards(
    reward_funcs: Sequence[Callable[..., Sequence[float | None]]],
    questions: Sequence[str],
    answers: Sequence[str],
    prompts: Sequence[Any] | None = None,
    tokenizer: Any = None,
) -> dict[str, dict[str, float]]:
    """Mean reward of each function on reference solutions and on corrupted copies of them.

    `answers` are GSM8K solutions (reasoning ending in `#### N`); each is scored as a completion against
    itself, then as `wrong_number` (final answer + 1), `two_answers` (a second, different `#### M` line
    appended) and `no_answer` (reasoning only, every digit replaced). The functions are called as in
    training (`grpo_lightning.core.rewards.scoring`), with the columns `question` and `answer`; `prompts`
    are the
    rows' prompts, by default each question as a user message (so completions arrive as chat messages);
    `completion_ids` come from `tokenizer` (a Hugging Face tokenizer), and are None without one. Sound
    accuracy rewards give 1.0 on `reference` and 0.0 on the rest. None rewards are left out of the mean; all
    None gives nan. Returns `{reward_name: {case: mean}}`.
    """
    if len(questions) != len(answers):
        raise ValueError(f"got {len(questions)} questions but {len(answers)} answers")
    if not answers:
        raise ValueError("the reward audit needs at least one row")
    if prompts is None:
        prompts = [[{"role": "user", "content": q}] for q in questions]
    cases = [_corruptions(a) for a in answers]
    columns = {"question": list(questions), "answer": list(answers)}
    result: dict[str, dict[str, float]] = {}
    for fn in reward_funcs:
        means = {}
        for case in AUDIT_CASES:
            completions = [c[case] for c in cases]
            ids = None if tokenizer is None else tokenizer(completions, add_special_tokens=False)["input_ids"]
            inputs = RewardInputs(list(prompts), completions, ids, columns)
            try:
                rewards = call_reward(fn, inputs)
            except RuntimeError as err:
                raise RuntimeError(f"{err} (in the reward audit, {case} case)") from err
            scored = [r for r in rewards if r is not None]
            means[case] = sum(scored) / len(scored) if scored else float("nan")
        result[reward_name(fn)] = means
    return result


@dataclass
class AuditReport:
    """The reward functions on reference solutions and corrupted copies (see `audit_reward_funcs`)."""

    num_rows: int
    means: dict[str, dict[str, float]]  # {function: {case: mean reward}}, NaN where every value was None
    totals: dict[str, float]  # {case: mean weighted total reward}
    rates: dict[str, float]  # reference: share at full marks; corrupted cases: share scoring >= reference

    @property
    def perfect(self) -> bool:
        """Every reference at full marks and no corrupted copy scoring as well as its reference."""
        return self.rates["reference"] == 1.0 and all(self.rates[c] == 0.0 for c in AUDIT_CASES[1:])

    def table(self) -> str:
        width = max(len("total (weighted)"), *(len(name) for name in self.means))
        lines = [
            f"reward audit on {self.num_rows} reference solutions: mean reward per case",
            f"{'':<{width}}" + "".join(f"{case:>14}" for case in AUDIT_CASES),
        ]
        rows = [*self.means.items(), ("total (weighted)", self.totals)]
        rows.append(("rate", self.rates))
        for name, values in rows:
            lines.append(f"{name:<{width}}" + "".join(f"{values[case]:>14.3f}" for case in AUDIT_CASES))
        lines.append(
            "rate: for reference, the share at full marks (should be 1); for a corruption, the share scoring "
            "at least as much as its reference (should be 0)"
        )
        verdict = "OK" if self.perfect else "NOT PERFECT: a policy can earn reward without the answer"
        lines.append(f"verdict: {verdict}")
        return "\n".join(lines)


def audit_reward_funcs(
    reward_funcs: Sequence[Callable],
    questions: Sequence[str],
    answers: Sequence[str],
    weights: Sequence[float] | None = None,
    prompts: Sequence | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> AuditReport:
    """Score the reference solutions and their corrupted copies (`audit_rewards`) row by row, and total
    them with `weights` as training does (a None reward counts 0).

    The functions are called as in training: `prompts` are the rows' prompts (by default each question as a
    user message) and `completion_ids` come from `tokenizer` when given. Full marks are the highest total
    the audit sees anywhere. A sound reward gives every reference full marks, and every corrupted copy
    (changed final number, two different final answers, no answer) less than its own reference: a
    corruption that scores as well is a way to earn reward without the answer.
    """
    weights = list(weights) if weights is not None else [1.0] * len(reward_funcs)
    prompts = list(prompts) if prompts is not None else [[{"role": "user", "content": q}] for q in questions]
    per_row = [
        audit_rewards(reward_funcs, [q], [a], [p], tokenizer)
        for q, a, p in zip(questions, answers, prompts, strict=True)
    ]
    names = list(per_row[0])
    scores = torch.tensor(
        [[[row[name][case] for name in names] for case in AUDIT_CASES] for row in per_row]
    )  # [R, C, F] NaN where None
    totals = (scores.nan_to_num(0.0) * torch.tensor(weights)).sum(dim=-1)  # [R, C]
    at_full_marks = totals[:, 0] >= totals.max() - 1e-6  # [R]
    as_good_as_reference = totals[:, 1:] >= totals[:, :1] - 1e-6  # [R, C-1]
    rates = [at_full_marks.float().mean().item(), *as_good_as_reference.float().mean(dim=0).tolist()]
    means = scores.nanmean(dim=0).T.tolist()  # [F][C]
    return AuditReport(
        num_rows=len(per_row),
        means={name: dict(zip(AUDIT_CASES, means[f], strict=True)) for f, name in enumerate(names)},
        totals=dict(zip(AUDIT_CASES, totals.mean(dim=0).tolist(), strict=True)),
        rates=dict(zip(AUDIT_CASES, rates, strict=True)),
    )


def auditable(rows: Sequence[dict]) -> bool:
    """Whether the audit can corrupt these rows: each has a `question` and a GSM8K `answer` (`#### N`)."""
    return bool(rows) and all(
        isinstance(r.get("question"), str) and "####" in str(r.get("answer", "")) for r in rows
    )


def audit_module_rewards(pl_module: Any, rows: Sequence[dict]) -> AuditReport:
    """`audit_reward_funcs` on data rows with a module's `reward_funcs` (and `reward_weights`, if any), the
    rows' own prompts when they have them and the module's tokenizer for `completion_ids`."""
    if not auditable(rows):
        raise ValueError(
            "the reward audit corrupts GSM8K-style reference solutions: it needs a `question` column and an "
            "`answer` column ending in '#### <number>' on every row"
        )
    weights = getattr(pl_module, "reward_weights", None)
    return audit_reward_funcs(
        pl_module.reward_funcs,
        [r["question"] for r in rows],
        [r["answer"] for r in rows],
        None if weights is None else weights.tolist(),
        [r["prompt"] for r in rows] if all("prompt" in r for r in rows) else None,
        getattr(pl_module, "tokenizer", None),
    )
