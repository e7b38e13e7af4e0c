"""Tests for the step-level verifier: a table of claims, the GSM8K references, corruptions, token credit."""

from __future__ import annotations

import json
import random
import re
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_lightning.core.algorithm.credit import step_token_penalties
from grpo_lightning.core.rewards.steps import (
    MAX_DEPTH,
    Step,
    StepReward,
    find_steps,
    step_reward,
    wrong_step_spans,
)

DATA = Path(__file__).resolve().parent.parent / "data" / "gsm8k"

# text -> (evaluated value, correct); every text holds exactly one step.
CLAIMS: list[tuple[str, Fraction | None, bool]] = [
    ("48/2 = 24", Fraction(24), True),
    ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.", Fraction(24), True),
    ("she earned 0.2 x 50 = $<<0.2*50=10>>10.", Fraction(10), True),
    ("she earned 0.2 x 50 = $10.", Fraction(10), True),
    ("$12 × 3 = $36", Fraction(36), True),
    ("3 * (4 + 5) = 27", Fraction(27), True),
    ("1,200 + 300 = 1,500", Fraction(1500), True),
    ("1,200 + 300 = 1,600", Fraction(1500), False),
    ("20% * 40 = 8", Fraction(8), True),
    ("50% of 40 = 20", Fraction(20), True),
    ("60/100 x 100 = 60%", Fraction(60), True),  # a claimed percentage number
    ("168 / 20% = 840", Fraction(840), True),
    ("10/3 = 3.33", Fraction(10, 3), True),  # rounded to the written decimals
    ("10/3 = 3.3", Fraction(10, 3), True),
    ("10/3 = 3.4", Fraction(10, 3), False),
    ("10/3 = 4", Fraction(10, 3), False),
    ("<<2/3=.67>>.67 of them", Fraction(2, 3), True),
    ("6/2 = 3.0", Fraction(3), True),
    ("7 - 2 = 4", Fraction(5), False),
    ("<<7-2=4>>4", Fraction(5), False),
    ("5/0 = 1", None, False),  # division by zero is never correct
    ("<<5/(2-2)=3>>3", None, False),
    ("-6 + 3 = -3 degrees", Fraction(-3), True),
    ("He paid 12 ÷ 4 = 3 dollars each.", Fraction(3), True),
    ("3x4 = 12", Fraction(12), True),
    ("1/2 * 3 = 3/2", Fraction(3, 2), True),  # a fraction result must match exactly
    ("60 / 3/4 = 80", Fraction(80), True),  # a tight fraction is one quantity
    ("so 3 + 4 = **7** apples", Fraction(7), True),  # markdown bold
    ("(5 + 3 = 8)", Fraction(8), True),
]

NON_STEPS = [
    "x = 5",
    "Total = 24",
    "Let x be the number of apples - we know it is positive.",
    "The store is open from 3:00 - 5:00 every day.",
    "It was founded in 2020.",
    "In 2020 - the year of the pandemic - sales fell.",
    "5 apples + 3 apples = 8 apples",  # words break an expression (documented)
    "2x - 5 = 13",  # algebra: x is a variable
    "X*2 - $40 = $250",  # the tail of an expression over a variable is not a claim
    "22 - 16 = 16 + x - 16",
    "#### 72",
]


def _only_step(text: str) -> Step:
    steps = find_steps(text)
    assert len(steps) == 1, steps
    return steps[0]


@pytest.mark.parametrize(("text", "value", "correct"), CLAIMS)
def test_claims(text: str, value: Fraction | None, correct: bool) -> None:
    step = _only_step(text)
    assert step.value == value
    assert step.correct is correct
    assert "=" in text[step.start : step.end]


@pytest.mark.parametrize("text", NON_STEPS)
def test_non_steps(text: str) -> None:
    assert find_steps(text) == []


def test_step_fields_and_span() -> None:
    text = "So 12 x 3 = $37 in all."
    step = _only_step(text)
    assert (step.expression, step.claimed, step.value, step.correct) == ("12 x 3", 37, 36, False)
    assert text[step.start : step.end] == "12 x 3 = $37"
    assert wrong_step_spans(text) == [(step.start, step.end)]


def test_plain_claim_stated_through_an_annotation_counts_once() -> None:
    text = "Natalia sold 48/2 = <<48/2=24>>24 clips.\nShe sold 48+24 = <<48+24=72>>72 in all.\n#### 72"
    steps = find_steps(text)
    assert [text[s.start : s.end] for s in steps] == ["<<48/2=24>>24", "<<48+24=72>>72"]


def test_chained_claims() -> None:
    steps = find_steps("4/5 * 1/4 = 1/5 = 20%")
    assert [(s.expression, s.correct) for s in steps] == [("4/5 * 1/4", True), ("1/5", True)]
    # Equality is read literally: "2*3 = 6*2" is false even if "6*2 = 12" holds.
    assert [s.correct for s in find_steps("2*3 = 6*2 = 12")] == [False, True]


def test_step_reward() -> None:
    completions = ["3 + 4 = 7 and 2 * 5 = 11", "no arithmetic here", "<<2*3=6>>6"]
    assert step_reward(completions, answer=["7"] * 3, prompts=["q"] * 3) == [0.5, 0.0, 1.0]
    assert step_reward.__name__ == "step_reward"
    assert StepReward(no_steps=None)(completions) == [0.5, None, 1.0]
    conversational = [[{"role": "assistant", "content": "3 + 4 = 8"}]]
    assert step_reward(conversational) == [0.0]


def test_step_token_penalties() -> None:
    text = "3 + 4 = 8, so 2 * 5 = 10"
    # Tokens: "3", " +", " 4", " =", " 8", ",", " so", " 2", " *", " 5", " =", " 10", and a special (0, 0).
    offsets = [(0, 1), (1, 3), (3, 5), (5, 7), (7, 9), (9, 10), (10, 13), (13, 15), (15, 17), (17, 19)]
    offsets += [(19, 21), (21, 24), (0, 0)]
    expected = [-0.5] * 5 + [0.0] * 8
    assert step_token_penalties(offsets, text, 0.5) == expected
    assert step_token_penalties(offsets, "3 + 4 = 7, so 2 * 5 = 10", 0.5) == [0.0] * 13


@given(st.integers(-50, 50), st.integers(-50, 50), st.sampled_from(["+", "-", "*"]))
def test_random_integer_claims(a: int, b: int, op: str) -> None:
    true = {"+": a + b, "-": a - b, "*": a * b}[op]
    assert [s.correct for s in find_steps(f"{a} {op} {b} = {true}")] == [True]
    assert [s.correct for s in find_steps(f"{a} {op} {b} = {true + 1}")] == [False]


# GSM8K references (0-based line numbers) with a plain-text claim that is genuinely wrong or written
# sloppily ("600 x 30 = 18" for 18 thousand, "1/4 = $24" for "a quarter is $24", "192*100=$1920").
# All their calculator annotations verify; only the human prose around them does not.
KNOWN_WRONG = {
    "train": {
        167, 198, 502, 623, 716, 874, 2429, 2682, 3334, 3409, 3637, 3640, 3859, 4593, 4691, 4973, 5195, 5781,
        5815, 5963, 6049, 6157, 6256, 6267, 6700, 6713, 6760, 6842, 7075, 7178, 7411, 7444,
    },
    "test": {410, 724, 993, 1024},
}  # fmt: skip


@pytest.fixture(scope="module")
def references() -> dict[str, list[str]]:
    return {
        split: [json.loads(line)["answer"] for line in (DATA / f"{split}.jsonl").open(encoding="utf-8")]
        for split in ("train", "test")
    }


@pytest.fixture(scope="module")
def reference_steps(references: dict[str, list[str]]) -> dict[str, list[list[Step]]]:
    return {split: [find_steps(answer) for answer in answers] for split, answers in references.items()}


def test_every_calculator_annotation_verifies(
    references: dict[str, list[str]], reference_steps: dict[str, list[list[Step]]]
) -> None:
    checked = 0
    for split, answers in references.items():
        for answer, steps in zip(answers, reference_steps[split], strict=True):
            for step in steps:
                if answer.startswith("<<", step.start):
                    assert step.correct, (split, answer[step.start : step.end])
                    checked += 1
    assert checked > 27_000


def test_reference_solutions_verify(reference_steps: dict[str, list[list[Step]]]) -> None:
    total = sum(len(rows) for rows in reference_steps.values())
    failing = {
        split: {i for i, steps in enumerate(rows) if not all(s.correct for s in steps)}
        for split, rows in reference_steps.items()
    }
    for split, rows in failing.items():
        assert rows - KNOWN_WRONG[split] == set(), split
    assert 1 - sum(map(len, failing.values())) / total > 0.995


_INTEGER_ANNOTATION = re.compile(r"<<([^<>=]*)=(\d+)>>(\d+)")


def test_corrupted_annotation_is_flagged(references: dict[str, list[str]]) -> None:
    rng = random.Random(0)
    corrupted = 0
    for i, answer in enumerate(references["train"][:400]):
        matches = [
            m
            for m in _INTEGER_ANNOTATION.finditer(answer)
            if m.group(2) == m.group(3) and re.search(r"[-+*/]", m.group(1))  # "<<6=6>>" states no step
        ]
        if i in KNOWN_WRONG["train"] or not matches:
            continue
        m = rng.choice(matches)
        wrong = str(int(m.group(2)) + 1)
        text = f"{answer[: m.start()]}<<{m.group(1)}={wrong}>>{wrong}{answer[m.end() :]}"
        end = m.start() + len(f"<<{m.group(1)}={wrong}>>{wrong}")
        end += text.startswith("%", end)  # the repeated result's unit is part of the claim
        assert wrong_step_spans(text) == [(m.start(), end)], text
        score = step_reward([text])[0]
        assert score is not None and score < 1
        corrupted += 1
    assert corrupted > 300


# Pieces a degenerate completion is made of: runs of dashes and signs, deep nesting, numbers of thousands of
# digits, annotations, and arbitrary text in between.
_DEGENERATE = st.one_of(
    st.text(max_size=40),
    st.integers(1, 3000).map(lambda n: "-" * n),
    st.integers(1, 2000).map(lambda n: "- " * n),
    st.integers(1, 1500).map(lambda n: "(" * n + "5" + ")" * n),
    st.integers(1, 1500).map(lambda n: "(-" * n),
    st.integers(1, 6000).map(lambda n: "9" * n),
    st.integers(1, 3000).map(lambda n: "0." + "3" * n + "%"),
    st.sampled_from([" = ", " + ", " * ", " / ", "<<", ">>", "=", "$", ",", "\n", "1,000", " x ", " of "]),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(_DEGENERATE, max_size=12).map("".join))
def test_the_verifier_never_raises(text):
    steps = find_steps(text)
    assert all(0 <= s.start < s.end <= len(text) for s in steps)
    assert all(start < end for start, end in wrong_step_spans(text))
    score = step_reward([text])[0]
    assert score == 0.0 if not steps else 0.0 <= score <= 1.0
    assert len(step_token_penalties([(0, len(text))], text, 1.0)) == 1


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("-" * 1200 + "5 + 1 = 3", [False]),  # a glued sign per dash: recursed once per dash before
        ("(" * 300 + "5" + ")" * 300 + " + 1 = 6", []),  # deeper than MAX_DEPTH: not verifiable
        ("(" * MAX_DEPTH + "5" + ")" * MAX_DEPTH + " + 1 = 6", [True]),  # as deep as it goes
        ("<<" + "(" * 300 + "5" + ")" * 300 + "+1=6>>6", []),
        ("9" * 5000 + " + 1 = 2 and 2 + 2 = 4", [True]),  # int() refuses over 4300 digits
        ("1 + 2 = " + "3" * 5000, []),
    ],
)
def test_degenerate_completions(text, expected):
    assert [s.correct for s in find_steps(text)] == expected
