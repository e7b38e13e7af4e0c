"""Answer extraction, reward functions and the reward audit, against hand cases and real GSM8K."""

from __future__ import annotations

import json
import math
import re
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_lightning.core.rewards.audit import AnswerForm, audit_reward_funcs, audit_rewards
from grpo_lightning.core.rewards.verifiable import (
    LengthPenalty,
    accuracy_reward,
    completion_text,
    extract_answer,
    format_reward,
    normalize_number,
    reference_answer,
    reward_name,
    strict_accuracy_reward,
)

GSM8K = Path(__file__).resolve().parent.parent / "data" / "gsm8k"


def _rows(split: str) -> list[dict[str, str]]:
    with (GSM8K / f"{split}.jsonl").open(encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("5", "5"),
        ("5.0", "5"),
        ("-3", "-3"),
        ("0.50", "0.5"),
        (".5", "0.5"),
        ("1,000", "1000"),
        ("109,200,000", "109200000"),
        ("$1,234.50", "1234.5"),
        ("-$5", "-5"),
        ("$-5", "-5"),
        ("50%", "50"),
        ("18.", "18"),
        (" +7 ", "7"),
        ("-0", "0"),
        ("1/2", "0.5"),
        ("2/6", "1/3"),
        ("1,00", None),
        ("5 apples", None),
        ("1e5", None),
        ("1/0", None),
        ("", None),
        ("-", None),
        ("$", None),
        ("+-5", None),
    ],
)
def test_normalize_number(text: str, expected: str | None) -> None:
    assert normalize_number(text) == expected


def test_reference_answer() -> None:
    assert reference_answer("She has 2 + 3 = 5.\n#### 1,000") == "1000"
    assert reference_answer("-2.50") == "-2.5"
    with pytest.raises(ValueError, match="five"):
        reference_answer("#### five")


# (completion, lenient answer, strict answer)
EXTRACTION_CASES = [
    # The GSM8K form.
    ("Two plus three is 5.\n#### 5", "5", "5"),
    ("#### 1,000", "1000", "1000"),
    ("#### -3", "-3", "-3"),
    ("#### $72", "72", "72"),
    ("#### 72 clips", "72", "72"),
    ("#### 0.50", "0.5", "0.5"),
    ("#### 5\n<|endoftext|>", "5", "5"),
    ("It is 5.\n#### 5\n#### 5.0", "5", "5"),  # the same answer twice is fine
    ("Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 24", "24", "24"),  # calculator annotation
    # \boxed.
    ("So the total is \\boxed{42}.", "42", None),
    ("\\boxed{\\$5}", "5", None),
    ("\\boxed{1,000}", "1000", None),
    ("\\boxed{\\frac{1}{2}}", "0.5", None),
    ("\\boxed{x = 7}", "7", None),
    ("\\boxed{18 \\text{ apples}}", "18", None),
    ("$\\boxed{5}$ and #### 5", "5", "5"),
    # Answer phrases.
    ("The answer is $5.00.", "5", None),
    ("The answer is 18", "18", None),
    ("So the final answer is: 1,250.", "1250", None),
    ("Answer: $12", "12", None),
    ("answer: -4", "-4", None),
    ("The answer is **18**.", "18", None),
    ("The final answer is 15 gallons * 8 pints / gallon = 120 pints.", "120", None),
    ("To get the answer: multiply 3 by 4. That gives 12 apples.", "12", None),  # prose, not a statement
    ("The answer is 50%.", "50", None),
    ("Answer:\n\n18", "18", None),
    ("Final Answer: The final answer is 18. I hope it is correct.", "18", None),
    ("The answer is therefore 3.\n#### 3", "3", "3"),  # a phrase not followed by a number is prose
    # A: lines.
    ("Q: how many?\nA: -3", "-3", None),
    ("A: She has 18 apples.", "18", None),  # prose after `A:`: not a statement, the fallback reads 18
    ("Q: 2 + 3?\nA: Let's think step by step.\n2 + 3 = 5\n#### 5", "5", "5"),
    ("A: 15 * 8 = 120", "120", None),
    # Last-number fallback.
    ("50%", "50", None),
    ("She had 20 apples and ate 2, so she has 18 apples.", None, None),  # last sentence: two numbers
    ("She had 20 apples and ate 2. So she has 18 apples.", "18", None),
    ("20 - 2 = 18", "18", None),
    ("So she has **18**", "18", None),
    ("It costs $3.50.", "3.5", None),
    ("The cake is cut into 8 pieces.\nEach costs $2.\nThat's all.", "2", None),
    ("Numbers:\n1\n2\n3", None, None),
    ("No numbers here.", None, None),
    ("18<|im_end|>", "18", None),
]

ADVERSARIAL_CASES = [
    ("", None, None),
    ("   \n ", None, None),
    ("#### ", None, None),
    ("Some reasoning with 5 apples.\n#### ", None, None),  # an empty final answer is not a last-number guess
    ("#### 5\n#### 7", None, None),
    ("\\boxed{5} so... The answer is 7.", None, None),
    ("\\boxed{5}\n#### 7", None, None),  # strict too: a contradicting statement voids the `####`
    ("The answer is 5 or 6 or 7.", None, None),
    ("The answer is 3, 4, 5, 6 or 7", None, None),
    ("Answer: 5\nAnswer: 6", None, None),
    ("\\boxed{5, 6}", None, None),
    ("\\boxed{}", None, None),
    ("#### 5 or 6", None, None),
    ("A: 5 or 6", None, None),
    (" ".join(str(i) for i in range(1, 101)), None, None),
    ("\n".join(str(i) for i in range(1, 101)), None, None),
    ("It might be 5, 6, 7, 8 or 9.", None, None),
]


@pytest.mark.parametrize(("completion", "lenient", "strict"), EXTRACTION_CASES + ADVERSARIAL_CASES)
def test_extract_answer(completion: str, lenient: str | None, strict: str | None) -> None:
    assert extract_answer(completion) == lenient
    assert extract_answer(completion, strict=True) == strict


@pytest.mark.parametrize("completion", [case[0] for case in ADVERSARIAL_CASES])
def test_adversarial_completions_get_no_reward(completion: str) -> None:
    for answer in ("5", "7", "100"):
        assert accuracy_reward([completion], answer=[answer]) == [0.0]
        assert strict_accuracy_reward([completion], answer=[answer]) == [0.0]


@settings(max_examples=200, deadline=None)
@given(st.decimals(min_value=-(10**9), max_value=10**9, places=2))
def test_number_round_trip(value: Decimal) -> None:
    """Any decimal, written with thousands separators, is read back exactly and canonically."""
    canonical = normalize_number(f"{value:f}")
    assert canonical is not None and Fraction(canonical) == Fraction(value)
    assert normalize_number(canonical) == canonical
    assert extract_answer(f"Adding 3 + 4 = 7 apples.\n#### {value:,}", strict=True) == canonical
    assert extract_answer(f"So the answer is \\boxed{{{value:,}}}.") == canonical


def test_accuracy_rewards() -> None:
    completions = [
        "2 + 3 = 5\n#### 5",
        "The answer is 5.0",
        "We found 5 earlier, but 2 + 4 = 6.\n#### 6",  # reference only mid-text
        "\\boxed{5}",
    ]
    answers = ["blah\n#### 5"] * 4
    # Extra TRL keywords are accepted and ignored.
    kwargs = {"prompts": ["q"] * 4, "completion_ids": [[1]] * 4, "question": ["q"] * 4}
    assert accuracy_reward(completions, answer=answers, **kwargs) == [1.0, 1.0, 0.0, 1.0]
    assert strict_accuracy_reward(completions, answer=answers, **kwargs) == [1.0, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="2 completions but 1 answers"):
        accuracy_reward(["a", "b"], answer=["5"])


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("Reasoning 2 + 3 = 5.\n#### 5", 1.0),
        ("#### 5", 1.0),
        ("Reasoning.\n#### 1,000  \n\n", 1.0),
        ("Reasoning.\n#### 5<|endoftext|>", 1.0),
        ("Reasoning.\n#### 5\n</s>", 1.0),
        ("Reasoning.\n  #### -2.5.", 1.0),
        ("Reasoning.\n#### 5\nMore text.", 0.0),  # not the final line
        ("Reasoning. #### 5", 0.0),  # not on its own line
        ("#### 5\n#### 5", 0.0),  # not exactly one
        ("#### 5\n#### 7", 0.0),
        ("Reasoning.\n#### 5 apples", 0.0),
        ("Reasoning.\n#### ", 0.0),
        ("The answer is 7.\n#### 5", 0.0),  # contradicted elsewhere
        ("\\boxed{5}", 0.0),
        ("", 0.0),
    ],
)
def test_format_reward(completion: str, expected: float) -> None:
    assert format_reward([completion], answer=["5"], prompts=["q"]) == [expected]


def test_gsm8k_train_references_score_full_marks() -> None:
    """Reward audit ground truth: every reference solution, used as a completion, is correct and formatted."""
    answers = [row["answer"] for row in _rows("train")]
    assert len(answers) == 7473
    for name, fn in (("accuracy", accuracy_reward), ("strict", strict_accuracy_reward)):
        rewards = fn(answers, answer=answers)
        failures = [a for a, r in zip(answers, rewards, strict=True) if r != 1.0]
        assert not failures, f"{name}: {len(failures)} references fail, e.g. {failures[0]!r}"
    rewards = format_reward(answers)
    failures = [a for a, r in zip(answers, rewards, strict=True) if r != 1.0]
    assert not failures, f"format: {len(failures)} references fail, e.g. {failures[0]!r}"


def test_length_penalty() -> None:
    penalty = LengthPenalty(limit=200, per_100_tokens=0.1)
    assert penalty.__name__ == reward_name(penalty) == "length_penalty"
    ids = [[0] * 150, [0] * 200, [0] * 250, [0] * 400]
    assert penalty(["x"] * 4, completion_ids=ids, answer=["1"] * 4) == pytest.approx([0.0, 0.0, -0.05, -0.2])
    assert penalty(["x"] * 4, completion_ids=ids)[0] == 0.0
    assert math.copysign(1.0, penalty(["x"], completion_ids=[[0]])[0]) == 1.0  # no negative zero
    # Without token ids, whitespace words stand in for tokens.
    words = LengthPenalty(limit=2, per_100_tokens=1.0)(["a b", "a b  c\nd e"])
    assert words == pytest.approx([0.0, -0.03])
    with pytest.raises(ValueError):
        LengthPenalty(limit=-1)
    with pytest.raises(ValueError, match="2 completions but 1 completion_ids"):
        penalty(["a", "b"], completion_ids=[[1]])


def test_reward_name() -> None:
    class MyCustomReward:
        def __call__(self, completions: list[str], **kwargs: object) -> list[float]:
            return [0.0] * len(completions)

    class HTTPReward(MyCustomReward):
        pass

    assert reward_name(accuracy_reward) == "accuracy_reward"
    assert reward_name(lambda completions, **kwargs: []) == "<lambda>"
    assert reward_name(MyCustomReward()) == "my_custom_reward"
    assert reward_name(HTTPReward()) == "http_reward"


def test_audit_rewards_on_real_rows() -> None:
    rows = _rows("train")[:200]
    result = audit_rewards(
        [accuracy_reward, strict_accuracy_reward, format_reward, LengthPenalty(limit=10_000)],
        [row["question"] for row in rows],
        [row["answer"] for row in rows],
    )
    corrupted = {"wrong_number": 0.0, "two_answers": 0.0, "no_answer": 0.0}
    assert result["accuracy_reward"] == {"reference": 1.0, **corrupted}
    assert result["strict_accuracy_reward"] == {"reference": 1.0, **corrupted}
    # A wrong number is still well formatted; the other corruptions are not.
    assert result["format_reward"] == {
        "reference": 1.0,
        "wrong_number": 1.0,
        "two_answers": 0.0,
        "no_answer": 0.0,
    }
    assert result["length_penalty"] == dict.fromkeys(("reference", *corrupted), 0.0)


def test_audit_rewards_edge_cases() -> None:
    never_applies = audit_rewards(
        [lambda completions, **kwargs: [None] * len(completions)], ["q"], ["#### 3"]
    )
    assert list(never_applies) == ["<lambda>"]
    assert all(math.isnan(mean) for mean in never_applies["<lambda>"].values())
    # A decimal reference: the wrong answer is reference + 1, kept exact.
    assert audit_rewards([accuracy_reward], ["q"], ["Half of 5 is 2.5.\n#### 2.5"]) == {
        "accuracy_reward": {"reference": 1.0, "wrong_number": 0.0, "two_answers": 0.0, "no_answer": 0.0}
    }
    with pytest.raises(ValueError, match="1 questions but 2 answers"):
        audit_rewards([accuracy_reward], ["q"], ["#### 1", "#### 2"])


# A system prompt asking for the reasoning and the answer in tags, as unsloth's GSM8K notebook writes it.
TAGS_PROMPT = "Respond in the following format:\n<reasoning>\n...\n</reasoning>\n<answer>\n...\n</answer>"


def tagged_answer(completion: str) -> str:
    """The text of the last `<answer>` tag, stripped: the whole completion where it has none."""
    return completion.split("<answer>")[-1].split("</answer>")[0].strip()


def exact_match_reward(prompts, completions, answer, **kwargs) -> list[float]:
    """An exact-match reward in unsloth's style: 2.0 where the tagged answer is the answer column's text."""
    return [
        2.0 if tagged_answer(c[0]["content"]) == a else 0.0 for c, a in zip(completions, answer, strict=True)
    ]


def tags_format_reward(completions, **kwargs) -> list[float]:
    """0.5 for a completion with a reasoning and an answer tag, in that order."""
    pattern = re.compile(r"<reasoning>.*?</reasoning>\s*<answer>.*?</answer>", re.DOTALL)
    return [0.5 if pattern.search(c[0]["content"]) else 0.0 for c in completions]


def test_the_form_a_prompt_asks_for():
    assert AnswerForm.asked_by(TAGS_PROMPT) == AnswerForm("tags", "reasoning")
    open_r1 = "enclosed within <think> </think> and <answer> </answer> tags"
    assert AnswerForm.asked_by([{"role": "system", "content": open_r1}]) == AnswerForm("tags", "think")
    assert AnswerForm.asked_by("Put your final answer within \\boxed{}.") == AnswerForm("boxed")
    assert AnswerForm.asked_by("What is 2 + 2?") == AnswerForm("hash")
    assert AnswerForm("tags", "reasoning").write("2 + 2 = 4.", ["4"]) == (
        "<reasoning>\n2 + 2 = 4.\n</reasoning>\n<answer>\n4\n</answer>"
    )


def test_the_audit_fails_a_reward_that_scores_the_right_final_answer_0():
    """unsloth's rewards on rows whose `answer` is GSM8K's worked solution: `<answer>72</answer>` scores 0,
    as a wrong answer does. The audit fails, naming the reward and the row; with the final number in
    `answer` it passes."""
    rows = _rows("train")[:20]
    questions, solutions = [r["question"] for r in rows], [r["answer"] for r in rows]
    prompts = [
        [{"role": "system", "content": TAGS_PROMPT}, {"role": "user", "content": q}] for q in questions
    ]
    funcs = [exact_match_reward, tags_format_reward]

    worked = audit_reward_funcs(funcs, questions, solutions, prompts=prompts)
    assert not worked.perfect
    assert worked.means["exact_match_reward"]["reference"] == 0.0  # the right answer is never matched
    assert worked.rates["wrong_number"] == 1.0  # every wrong answer scores as much as the right one
    final = reference_answer(solutions[0])
    assert worked.right_not_rewarded.startswith(
        f"row 0: a completion with the reference's final answer {final} in the form the prompt asks for "
        f"('<reasoning>\\n...\\n</reasoning>\\n<answer>\\n{final}\\n</answer>') scores 0.5, no more than the "
        "same with a wrong one (0.5): exact_match_reward gives it 0 and the wrong one 0 (it reads answer="
    )
    assert f"#### {final}'" in worked.right_not_rewarded  # the worked solution it compared with
    assert worked.right_not_rewarded in worked.table()

    finals = [reference_answer(s) for s in solutions]
    columns = {"question": questions, "answer": finals}
    sound = audit_reward_funcs(funcs, questions, solutions, prompts=prompts, columns=columns)
    assert sound.perfect and sound.right_not_rewarded is None
    assert sound.means["exact_match_reward"] == {
        "reference": 2.0,
        "wrong_number": 0.0,
        "two_answers": 0.0,  # the last tag is read: the wrong one
        "no_answer": 0.0,
    }
    assert sound.table().splitlines()[-1] == "verdict: OK"


def test_a_tool_result_is_not_the_policy_s_answer():
    """A multi-turn completion whose calculator printed the answer, its last turn writing none: the rewards
    read the model's turns only, so the tool's number earns nothing; the model writing it does."""
    call = {"role": "assistant", "content": "Let me compute 6 * 7.", "tool_calls": [{"name": "calculator"}]}
    tool = {"role": "tool", "name": "calculator", "content": "42"}
    silent = [call, tool, {"role": "assistant", "content": "Done."}]
    answered = [call, tool, {"role": "assistant", "content": "#### 42"}]
    assert completion_text(silent) == "Let me compute 6 * 7.Done."
    assert accuracy_reward([silent, answered], ["42", "42"]) == [0.0, 1.0]
