"""Verifiable rewards for GSM8K-style maths answers.

Reward functions follow TRL's signature, ``fn(completions, **columns) -> list[float | None]``: dataset
columns such as ``answer`` arrive as keyword lists aligned with ``completions``, and any other keyword
(``prompts``, ``completion_ids``, ``trainer_state``, ...) is accepted and ignored. Completions may be text or,
for chat prompts, TRL's list of one assistant message (``completion_text`` reads both); see
``grpo_lightning.core.rewards.scoring`` for how the trainer calls them.

Extraction is deliberately conservative, because a reward that can be gamed will be gamed by RL:

* every explicit answer statement (``#### N``, ``\\boxed{N}``, ``The answer is N`` / ``answer: N``, a line
  ``A: N``) must state exactly one number, and all of them must agree, otherwise there is no answer;
* inside an answer statement only the part after its last ``=`` counts, so ``answer is 15 * 8 = 120`` states
  120, while ``The answer is 5 or 6 or 7`` is ambiguous;
* the lenient last-number fallback reads the last sentence that contains a number, and only if that
  sentence holds a single distinct number; a completion that is a list of numbers gets no fallback.
"""

from __future__ import annotations

import functools
import math
import numbers
import re
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

__all__ = [
    "WORKED_SOLUTION",
    "LengthPenalty",
    "accuracy_reward",
    "completion_text",
    "extract_answer",
    "format_reward",
    "normalize_number",
    "reference_answer",
    "reward_name",
    "strict_accuracy_reward",
]

# The GSM8K preset's column of each row's worked solution, ending in `#### N`; its `answer` is the final N.
WORKED_SOLUTION = "worked_solution"
# A whole string that is a number: optional sign and `$` in either order (-$5, $-5), thousands groups,
# decimals (also `.5`), or a simple fraction of integers.
_NUMBER_STRING_RE = re.compile(
    r"(?P<sign>[-+]?)\$?(?P<sign2>[-+]?)\s*"
    r"(?:(?P<num>\d+)/(?P<den>\d+)|(?P<int>\d{1,3}(?:,\d{3})+|\d*)(?P<dec>\.\d+)?)"
)
# A number inside free text. The look-behind keeps digits glued to words (`x2`) or following a decimal
# point or slash out; a minus only counts when not preceded by a word character, so `5-3` is 5 and 3.
_NUMBER_RE = re.compile(
    r"(?<![\w./])(?:-\$?|\$-?)?"
    r"(?:\d+/\d+(?!\d|[.,]\d)|(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)"
)
# GSM8K calculator annotations `<<48/2=24>>`: the result always follows them, so they only add noise.
CALCULATOR_RE = re.compile(r"<<[^<>]*>>")
# End-of-text markers of common chat templates, which may trail a decoded completion.
_SPECIAL_TOKEN_RE = re.compile(r"<\|[^|<>\s]+\|>|</s>|<eos>|<end_of_turn>")
_LATEX_FRAC_RE = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_LATEX_TEXT_RE = re.compile(r"\\(?:text|textbf|mathrm|mathbf)\{([^{}]*)\}")
_HASH_RE = re.compile(r"####([^\n]*)")
_BOXED_OPEN_RE = re.compile(r"\\(?:boxed|fbox)\{")
_PHRASE_RE = re.compile(r"\banswer\s*(?:is|:)", re.IGNORECASE)
_A_LINE_RE = re.compile(r"^[ \t]*A:([^\n]*)", re.MULTILINE)
# A phrase or `A:` line only states an answer when a number comes first (`The answer is $18`, `A: -3`),
# not for prose such as `to get the answer: multiply 3 by 4` or a few-shot `A: Let's think step by step`.
_STARTS_WITH_NUMBER_RE = re.compile(r"(?:[\s:$({]|\\\(|\\boxed\{)*[-+]?\$?\.?\d")
# Sentence ends: a newline, or . ! ? ; followed by whitespace or the end (so `5.00` is not split).
_SENTENCE_END_RE = re.compile(r"\n|[.!?;](?=\s|$)")
_FINAL_LINE_RE = re.compile(r"[ \t]*####(?P<value>[^\n]*)")


def canonical_number(value: Fraction) -> str:
    """Unique text of a rational: a plain decimal when it terminates (`0.5`, `-3`), else `p/q`."""
    den = value.denominator
    twos = fives = 0
    while den % 2 == 0:
        den //= 2
        twos += 1
    while den % 5 == 0:
        den //= 5
        fives += 1
    if den != 1:
        return f"{value.numerator}/{value.denominator}"
    places = max(twos, fives)
    # Lowest terms with denominator 2^a 5^b has exactly max(a, b) decimals, the last one non-zero.
    digits = str(abs(value.numerator) * 10**places // value.denominator).rjust(places + 1, "0")
    text = f"{digits[:-places]}.{digits[-places:]}" if places else digits
    return f"-{text}" if value < 0 else text


def _to_fraction(text: str) -> Fraction | None:
    """Exact value of a number string as `normalize_number` accepts it, or None."""
    text = text.strip().rstrip(".").strip()
    text = text.removesuffix("%").strip()
    match = _NUMBER_STRING_RE.fullmatch(text)
    if match is None or (match["sign"] and match["sign2"]):
        return None
    negative = "-" in (match["sign"] + match["sign2"])
    if match["den"] is not None:
        if int(match["den"]) == 0:
            return None
        value = Fraction(int(match["num"]), int(match["den"]))
    elif match["int"] or match["dec"]:
        value = Fraction((match["int"] or "0").replace(",", "") + (match["dec"] or ""))
    else:
        return None
    return -value if negative else value


def normalize_number(text: str) -> str | None:
    """Canonical form of a number string, or None if `text` is not a number.

    Strips surrounding whitespace, a `$`, thousands separators (only in valid 3-digit groups, so `1,2` is
    not a number), a trailing `%` and a trailing `.`; `5.0` -> `5`, `0.50` -> `0.5`, `.5` -> `0.5`,
    `1,000` -> `1000`, `-$3` -> `-3`. Simple fractions are exact: `1/2` -> `0.5`, `2/6` -> `1/3`. Units
    or other words make it not a number (`5 apples` -> None); finding numbers in prose is the extractor's job.
    Equal numbers always get the same string, so comparing strings compares values.
    """
    value = _to_fraction(text)
    return None if value is None else canonical_number(value)


def reference_answer(answer: str | float) -> str:
    """The normalised number after GSM8K's last `####`, or of the whole string when there is none; a number
    (an int or float column, as TRL-format data sets often hold) as it is: `5` and `"5"` give "5".

    Raises ValueError naming the value when it is not a number.
    """
    if isinstance(answer, numbers.Real) and not isinstance(answer, bool) and math.isfinite(answer):
        return canonical_number(Fraction(str(answer)))  # shortest text: 0.1 is 1/10
    if not isinstance(answer, str):
        raise ValueError(f"reference answer is not a number: {answer!r}")
    _, marker, tail = answer.rpartition("####")
    value = normalize_number(tail if marker else answer)
    if value is None:
        raise ValueError(f"reference answer is not a number: {answer!r}")
    return value


def _clean(text: str) -> str:
    """Remove markup that would hide or split numbers: calculator annotations, end tokens, LaTeX, bold."""
    text = CALCULATOR_RE.sub("", text)
    text = _SPECIAL_TOKEN_RE.sub(" ", text)
    text = _LATEX_FRAC_RE.sub(r"\1/\2", text)
    text = _LATEX_TEXT_RE.sub(r"\1", text)
    # `\,` and `\!` are LaTeX thin spaces, used as thousands separators (`1\,000`).
    for old, new in (("\\$", "$"), ("\\%", "%"), ("\\,", ""), ("\\!", ""), ("**", "")):
        text = text.replace(old, new)
    return text


def _span_numbers(span: str) -> set[str]:
    """Distinct normalised numbers an answer span states; only the part after its last `=` counts."""
    tail = span.rsplit("=", 1)[-1]
    return {value for value in map(normalize_number, _NUMBER_RE.findall(tail)) if value is not None}


def _boxed_spans(text: str) -> list[str]:
    """Contents of every `\\boxed{...}`, with balanced braces; an unclosed box runs to the end."""
    spans = []
    for match in _BOXED_OPEN_RE.finditer(text):
        depth, end = 1, match.end()
        while end < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            end += 1
        spans.append(text[match.end() : end - 1 if depth == 0 else end])
    return spans


def _phrase_spans(text: str) -> list[str]:
    """The clause after each `answer is` / `answer:` that starts with a number, up to the sentence end."""
    spans = []
    for match in _PHRASE_RE.finditer(text):
        # The number may sit on the next line (`Answer:\n18`), so the clause starts after leading blanks.
        rest = text[match.end() :].lstrip(" \t\n:")
        if _STARTS_WITH_NUMBER_RE.match(rest):
            end = _SENTENCE_END_RE.search(rest)
            spans.append(rest[: end.start() if end else len(rest)])
    return spans


def _last_number(text: str) -> str | None:
    """Lenient fallback: the number of the last sentence that has numbers, if it has exactly one.

    Number lists are not reasoning and get None: `1 2 3 ... 100` fails the one-number rule, and a text
    with 3+ lines that are each a bare, different number (`1\n2\n...\n100`) is refused outright.
    """
    bare_lines = {value for line in text.splitlines() if (value := normalize_number(line)) is not None}
    if len(bare_lines) >= 3:
        return None
    for sentence in reversed(_SENTENCE_END_RE.split(text)):
        numbers = _span_numbers(sentence)
        if numbers:
            return numbers.pop() if len(numbers) == 1 else None
    return None


def extract_answer(completion: str, strict: bool = False) -> str | None:
    """The completion's final numeric answer, normalised, or None when it has none or is ambiguous.

    Strict: only the `#### N` form counts. Lenient: `#### N`, `\\boxed{N}`, `The answer is N` /
    `answer: N`, a line `A: N`, and else the last number (see `_last_number`). In both modes every explicit
    answer statement present must state exactly one number and all must agree; several different
    answers, or an explicit statement with no number (`#### ` alone), give None rather than a guess.
    """
    text = _clean(completion)
    if not text.strip():
        return None
    hash_spans = [match[1] for match in _HASH_RE.finditer(text)]
    a_spans = [match[1] for match in _A_LINE_RE.finditer(text) if _STARTS_WITH_NUMBER_RE.match(match[1])]
    spans = hash_spans + _boxed_spans(text) + _phrase_spans(text) + a_spans
    statements = [_span_numbers(span) for span in spans]
    if any(len(numbers) != 1 for numbers in statements):
        return None
    answers = set().union(*statements)
    if len(answers) > 1:
        return None
    if strict:
        return answers.pop() if hash_spans else None
    return answers.pop() if answers else _last_number(text)


# A completion as TRL passes it: text, or a list of chat messages for conversational data.
Completion = str | Sequence[dict[str, Any]]


def completion_text(completion: Completion) -> str:
    """The text of a completion: itself, or the content of TRL's chat completion ``[{"role", "content"}]``
    (the messages' contents joined, should there be several). A multi-turn completion's tool results
    (``role: "tool"``) are left out: they are not the policy's writing, and a reward reading them would pay
    for an answer the tool printed."""
    if isinstance(completion, str):
        return completion
    return "".join(str(m.get("content") or "") for m in completion if m.get("role") != "tool")


def _check_lengths(completions: Sequence[str], column: Sequence[Any], name: str = "answers") -> None:
    if len(completions) != len(column):
        raise ValueError(f"got {len(completions)} completions but {len(column)} {name}")


def accuracy_reward(
    completions: Sequence[Completion], answer: Sequence[str | float], **kwargs: Any
) -> list[float]:
    """1.0 when the lenient extracted answer equals the reference answer, else 0.0."""
    _check_lengths(completions, answer)
    return [
        float(extract_answer(completion_text(c)) == reference_answer(a))
        for c, a in zip(completions, answer, strict=True)
    ]


def strict_accuracy_reward(
    completions: Sequence[Completion], answer: Sequence[str], **kwargs: Any
) -> list[float]:
    """1.0 when the strict (`#### N` only) extracted answer equals the reference answer, else 0.0."""
    _check_lengths(completions, answer)
    return [
        float(extract_answer(completion_text(c), strict=True) == reference_answer(a))
        for c, a in zip(completions, answer, strict=True)
    ]


def _well_formatted(completion: str) -> bool:
    text = _SPECIAL_TOKEN_RE.sub("", completion).rstrip()
    if text.count("####") != 1:
        return False
    final = _FINAL_LINE_RE.fullmatch(text.rpartition("\n")[2])
    # The strict extraction also rejects a `#### N` contradicted by another answer statement.
    return (
        final is not None
        and normalize_number(final["value"]) is not None
        and extract_answer(completion, strict=True) is not None
    )


def format_reward(completions: Sequence[Completion], **kwargs: Any) -> list[float]:
    """1.0 if the completion ends with its only `#### N` line (trailing whitespace or end token allowed)."""
    return [float(_well_formatted(completion_text(c))) for c in completions]


class LengthPenalty:
    """Penalty of `per_100_tokens` per 100 tokens beyond `limit`: `-per_100_tokens * max(0, n - limit) / 100`.

    Token counts come from `completion_ids` when the trainer passes them; otherwise the whitespace word
    count of the completion stands in for them.
    """

    def __init__(self, limit: int = 200, per_100_tokens: float = 0.1) -> None:
        if limit < 0 or per_100_tokens < 0:
            raise ValueError(f"limit and per_100_tokens must be >= 0, got {limit} and {per_100_tokens}")
        self.limit = limit
        self.per_100_tokens = per_100_tokens
        # Rewards are logged per function by `__name__`, which instances do not have by default.
        self.__name__ = "length_penalty"

    def __call__(
        self,
        completions: Sequence[Completion],
        completion_ids: Sequence[Sequence[int]] | None = None,
        **kwargs: Any,
    ) -> list[float]:
        if completion_ids is None:
            lengths = [len(completion_text(c).split()) for c in completions]
        else:
            _check_lengths(completions, completion_ids, "completion_ids")
            lengths = [len(ids) for ids in completion_ids]
        # `if excess` avoids returning -0.0, which would log as a negative zero.
        excesses = [max(0, n - self.limit) for n in lengths]
        return [-self.per_100_tokens * excess / 100 if excess else 0.0 for excess in excesses]

    def __repr__(self) -> str:
        return f"LengthPenalty(limit={self.limit}, per_100_tokens={self.per_100_tokens})"


def reward_name(fn: Callable[..., Any]) -> str:
    """`fn.__name__` if it has one; a `functools.partial` (Hydra's `_partial_: true`) without one of its own,
    its function's name; else its class name in snake_case (`MyReward` -> `my_reward`)."""
    name = getattr(fn, "__name__", None)
    if isinstance(name, str):
        return name
    if isinstance(fn, functools.partial):
        return reward_name(fn.func)
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", type(fn).__name__).lower()
