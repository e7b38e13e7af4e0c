"""The reward audit: the reward functions scored on the data's own reference solutions and on corrupted
copies of them (a changed final number, two different final answers, no answer), each written in the form
the row's prompt asks for (`AnswerForm`: GSM8K's `#### N`, `\\boxed{N}`, or `<answer>` tags), so that a
reward a policy can earn without the answer, or one that gives the right answer no more than a wrong one,
shows before training starts.

- `audit_reward_funcs` / `AuditReport`: the audit of any reward functions, and its table;
- `audit_module_rewards`: the audit of a module's `reward_funcs` on data rows (for `cli.py audit` and the
  pre-flight);
- `audit_rewards`: the mean reward of each function per case, the audit's raw numbers.

No Lightning here: the callback that runs the audit when `fit` starts is `audit_callback.RewardAuditCallback`.
"""

from __future__ import annotations

import inspect
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
    WORKED_SOLUTION,
    canonical_number,
    reference_answer,
    reward_name,
)

__all__ = [
    "AUDIT_CASES",
    "AnswerForm",
    "AuditReport",
    "audit_module_rewards",
    "audit_reward_funcs",
    "audit_rewards",
    "auditable",
]


AUDIT_CASES = ("reference", "wrong_number", "two_answers", "no_answer")


_TAG_RE = re.compile(r"<([A-Za-z_]\w*)>")


@dataclass(frozen=True)
class AnswerForm:
    """How a prompt asks for the final answer: "hash" (GSM8K's `#### N` line, also where the prompt asks for
    no form), "boxed" (`\\boxed{N}`) or "tags" (the reasoning in `<reasoning_tag>` and the answer in
    `<answer>` tags, as open-r1's and unsloth's system prompts ask)."""

    kind: str = "hash"
    reasoning_tag: str = "think"

    @classmethod
    def asked_by(cls, prompt: Any) -> AnswerForm:
        """The form that `prompt` (text, or chat messages: every message is read) asks for."""
        if isinstance(prompt, list):
            prompt = "\n".join(str(m.get("content", "")) for m in prompt if isinstance(m, dict))
        text = str(prompt)
        if "<answer>" in text:
            before = text[: text.index("<answer>")]
            tags = [tag for tag in _TAG_RE.findall(before) if tag != "answer"]
            return cls("tags", tags[0] if tags else "think")
        return cls("boxed") if "\\boxed" in text else cls()

    def write(self, reasoning: str, finals: Sequence[str]) -> str:
        """A completion in this form: the reasoning, then one answer statement per entry of `finals` (none:
        a completion without an answer)."""
        if self.kind == "tags":
            tag = self.reasoning_tag
            return f"<{tag}>\n{reasoning}\n</{tag}>" + "".join(f"\n<answer>\n{f}\n</answer>" for f in finals)
        if self.kind == "boxed":
            return reasoning + "".join(f"\nThe final answer is $\\boxed{{{f}}}$." for f in finals)
        return reasoning + "".join(f"\n#### {f}" for f in finals)


def _corruptions(solution: str, form: AnswerForm) -> dict[str, str]:
    """The reference solution and corrupted copies that any sound reward must score differently, in `form`
    (GSM8K's own form keeps the solution as it is written)."""
    right = reference_answer(solution)
    wrong = canonical_number(Fraction(right) + 1)
    reasoning = solution.rpartition("####")[0].rstrip()
    return {
        "reference": solution if form.kind == "hash" else form.write(reasoning, [right]),
        # The correct number usually still appears in the reasoning: only the final answer is wrong.
        "wrong_number": form.write(reasoning, [wrong]),
        "two_answers": f"{solution}\n#### {wrong}"
        if form.kind == "hash"
        else form.write(reasoning, [right, wrong]),
        "no_answer": form.write(re.sub(r"\d", "N", CALCULATOR_RE.sub("", reasoning)), []),
    }


def audit_rewards(
    reward_funcs: Sequence[Callable[..., Sequence[float | None]]],
    questions: Sequence[str],
    answers: Sequence[str],
    prompts: Sequence[Any] | None = None,
    tokenizer: Any = None,
    columns: dict[str, Sequence] | None = None,
) -> dict[str, dict[str, float]]:
    """Mean reward of each function on reference solutions and on corrupted copies of them.

    `answers` are GSM8K solutions (reasoning ending in `#### N`); each is scored as a completion, then as
    `wrong_number` (final answer + 1), `two_answers` (a second, different final answer after the right
    one) and `no_answer` (reasoning only, every digit replaced), each written in the form its prompt asks
    for (`AnswerForm.asked_by`: in GSM8K's form, the solution as it is). The functions are called as in
    training (`grpo_lightning.core.rewards.scoring`), with `columns` (the rows' data columns, one value per
    row each; by default `question` and `answer`, the solution); `prompts` are the rows' prompts, by
    default each question as a user message (so completions arrive as chat messages); `completion_ids`
    come from `tokenizer` (a Hugging Face tokenizer), and are None without one. Sound accuracy rewards give
    1.0 on `reference` and 0.0 on the rest. None rewards are left out of the mean; all None gives nan.
    Returns `{reward_name: {case: mean}}`.
    """
    if len(questions) != len(answers):
        raise ValueError(f"got {len(questions)} questions but {len(answers)} answers")
    if not answers:
        raise ValueError("the reward audit needs at least one row")
    if prompts is None:
        prompts = [[{"role": "user", "content": q}] for q in questions]
    cases = [_corruptions(a, AnswerForm.asked_by(p)) for a, p in zip(answers, prompts, strict=True)]
    if columns is None:
        columns = {"question": questions, "answer": answers}
    columns = {name: list(values) for name, values in columns.items()}
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
    # The first row whose right answer scores no more than a wrong one, the rewards that read it named
    right_not_rewarded: str | None = None

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
        if self.right_not_rewarded:
            lines.append(self.right_not_rewarded)
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
    columns: dict[str, Sequence] | None = None,
) -> AuditReport:
    """Score the reference solutions and their corrupted copies (`audit_rewards`) row by row, and total
    them with `weights` as training does (a None reward counts 0).

    The functions are called as in training: `prompts` are the rows' prompts (by default each question as a
    user message), `columns` the rows' data columns (by default `question` and `answer`) and
    `completion_ids` come from `tokenizer` when given. Full marks are the highest total
    the audit sees anywhere. A sound reward gives every reference full marks, and every corrupted copy
    (changed final number, two different final answers, no answer) less than its own reference: a
    corruption that scores as well is a way to earn reward without the answer. Where the right final answer,
    in the form the prompt asks for, scores no more than the same with a wrong one, `right_not_rewarded`
    names the first such row and the rewards that read the data's columns.
    """
    weights = list(weights) if weights is not None else [1.0] * len(reward_funcs)
    prompts = list(prompts) if prompts is not None else [[{"role": "user", "content": q}] for q in questions]
    if columns is None:
        columns = {"question": questions, "answer": answers}
    per_row = [
        audit_rewards(reward_funcs, [q], [a], [p], tokenizer, {k: [v[r]] for k, v in columns.items()})
        for r, (q, a, p) in enumerate(zip(questions, answers, prompts, strict=True))
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
    wrong_as_good = as_good_as_reference[:, AUDIT_CASES.index("wrong_number") - 1].nonzero()  # [K, 1]
    return AuditReport(
        num_rows=len(per_row),
        means={name: dict(zip(AUDIT_CASES, means[f], strict=True)) for f, name in enumerate(names)},
        totals=dict(zip(AUDIT_CASES, totals.mean(dim=0).tolist(), strict=True)),
        rates=dict(zip(AUDIT_CASES, rates, strict=True)),
        right_not_rewarded=None
        if not len(wrong_as_good)
        else _right_not_rewarded(
            int(wrong_as_good[0, 0]), reward_funcs, names, scores, totals, answers, prompts, columns
        ),
    )


def _reads(fn: Callable, columns: Sequence[str]) -> list[str]:
    """The data columns that `fn` names as parameters (a reward that takes `**kwargs` alone names none)."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C callable without a signature
        return []
    return [name for name in columns if name in parameters]


def _right_not_rewarded(
    row: int,
    reward_funcs: Sequence[Callable],
    names: list[str],
    scores: torch.Tensor,
    totals: torch.Tensor,
    answers: Sequence[str],
    prompts: Sequence,
    columns: dict[str, Sequence],
) -> str:
    """The line naming `row`, where the right final answer scores no more than a wrong one, and the reward
    functions that read the data's columns (every one where none names a column), with their scores."""
    form = AnswerForm.asked_by(prompts[row])
    right = reference_answer(answers[row])
    reference, wrong = AUDIT_CASES.index("reference"), AUDIT_CASES.index("wrong_number")
    reading = [(f, _reads(fn, list(columns))) for f, fn in enumerate(reward_funcs)]
    named = [(f, read) for f, read in reading if read] or [(f, []) for f in range(len(names))]
    details = []
    for f, read in named:
        values = ", ".join(f"{column}={str(columns[column][row])[-60:]!r}" for column in read)
        right_score, wrong_score = scores[row, reference, f].item(), scores[row, wrong, f].item()
        details.append(
            f"{names[f]} gives it {right_score:g} and the wrong one {wrong_score:g}"
            + (f" (it reads {values})" if values else "")
        )
    return (
        f"row {row}: a completion with the reference's final answer {right} in the form the prompt asks for "
        f"({form.write('...', [right])!r}) scores {totals[row, reference].item():g}, no more than the same "
        f"with a wrong one ({totals[row, wrong].item():g}): {'; '.join(details)}. Check that the answer "
        "column holds what the reward compares completions with (a final number, not a worked solution)"
    )


def _worked_solution(row: dict) -> str:
    """A row's worked solution: its `worked_solution` (the GSM8K preset's, whose `answer` is the final
    number), else its `answer`."""
    return str(row.get(WORKED_SOLUTION, row.get("answer", "")))


def auditable(rows: Sequence[dict]) -> bool:
    """Whether the audit can corrupt these rows: each has a `question` and a GSM8K worked solution
    (`#### N`), in `worked_solution` or `answer`."""
    return bool(rows) and all(
        isinstance(r.get("question"), str) and "####" in _worked_solution(r) for r in rows
    )


def audit_module_rewards(pl_module: Any, rows: Sequence[dict]) -> AuditReport:
    """`audit_reward_funcs` on data rows with a module's `reward_funcs` (and `reward_weights`, if any), the
    rows' own prompts when they have them and the module's tokenizer for `completion_ids`."""
    if not auditable(rows):
        raise ValueError(
            "the reward audit corrupts GSM8K-style reference solutions: it needs a `question` column and a "
            f"`{WORKED_SOLUTION}` or `answer` column ending in '#### <number>' on every row"
        )
    weights = getattr(pl_module, "reward_weights", None)
    return audit_reward_funcs(
        pl_module.reward_funcs,
        [r["question"] for r in rows],
        [_worked_solution(r) for r in rows],
        None if weights is None else weights.tolist(),
        [r["prompt"] for r in rows] if all("prompt" in r for r in rows) else None,
        getattr(pl_module, "tokenizer", None),
        {name: [r[name] for r in rows] for name in rows[0] if name != "prompt"},
    )
