"""Step-level verifiable rewards: find the arithmetic claims in a solution and check each one.

A *step* is a claim ``expression = result`` where the expression has at least one binary operator.
Two forms are recognised:

* plain text, e.g. ``48/2 = 24``, ``0.2 x 50 = $10``, ``$12 × 3 = $36``, ``3 * (4 + 5) = 27``,
  ``1,200 + 300 = 1,500``, ``20% * 40 = 8``, ``50% of 40 = 20``;
* the GSM8K calculator annotation ``<<48/2=24>>24``. A plain claim whose result is stated through an
  annotation (``48/2 = <<48/2=24>>24``) is the same claim and is counted once, as the annotation.

Reading rules (chosen to avoid bogus steps in prose rather than to catch every claim):

* Operators: ``+ - * / x X × ÷ ·`` (also ``−``, ``\\times``, ``\\cdot``, ``\\div``) and parentheses.
  ``x`` is an operator only between operands (``3 x 4``, ``3x4``); in ``2x - 5`` or ``x = 5`` it is a
  variable. There is no implicit multiplication, and a fraction written tight (``3/4``) is one
  quantity, so ``60 / 3/4 = 80`` (GSM8K authors write ``a / b/c`` for a ÷ (b/c)).
* Numbers may carry a leading ``$``, thousands separators (``1,000``), decimals and a trailing ``%``.
  A number glued to letters (``2nd``, ``10am``, ``5B``) is a word; one with a leading zero (``0900``) is
  a clock time or a code, not a quantity.
* Percent: ``N%`` always means ``N/100`` (so ``20% * 40 = 8`` and ``168 / 20% = 840``), and ``of`` after a
  percentage is a multiplication. A *claimed* ``N%`` is also accepted when the expression computes the
  percentage number itself (``60/100 x 100 = 60%``).
* Words, line breaks and other punctuation (``:``, ``,`` outside a number, ``?``...) end an expression, so
  ``5 apples + 3 apples = 8`` is skipped and ``3:00`` or a year never form a step. A minus sign is unary
  only when glued to its operand (``-3``, not ``- 3``). An expression that starts with a binary operator
  (``the cost - 5 + 3 = 8``, ``X*2 - $40 = $250``) continues over a word (a dash in prose, a variable),
  so it is not a step; nor is a result that goes on with more maths (``22 - 16 = 16 + x``).
* Limits: a number of more than ``MAX_DIGITS`` digits is not a quantity, and an expression nested more than
  ``MAX_DEPTH`` parentheses deep is not verifiable; neither forms a step. The verifier never raises on any
  text (it runs on whatever a policy writes), and its time grows linearly with the text.
* Results are a number or a simple fraction (``3/4``). In a chain ``a + b = c + d = e`` every expression
  is claimed equal to the next result (``a + b = e`` and ``c + d = e``): equality read literally, so the
  sloppy continuation ``2*3 = 6*2 = 12`` flags ``2*3``.

Correctness: the evaluated value (exact ``Fraction``; ``None`` on division by zero, which is never correct)
must equal the claimed number up to rounding of its last written digit: ``|value - claimed| <=
0.5 * 10**-d`` with ``d`` the decimals written (two more for a percentage). So ``10/3 = 3.33`` and
``10/3 = 3`` are correct, ``10/3 = 4`` is not, and an integer value must be matched exactly by an integer
claim. A fraction result (``3/4``) must match exactly.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, NamedTuple

from grpo_lightning.core.rewards.verifiable import completion_text


@dataclass(frozen=True)
class Step:
    """One arithmetic claim found in a text.

    ``text[start:end]`` is the whole claim: ``48/2 = 24`` for a plain one, ``<<48/2=24>>24`` (with the
    result repeated after the annotation, when it is) for a calculator annotation.
    """

    expression: str
    claimed: Fraction
    value: Fraction | None
    correct: bool
    start: int
    end: int


class _Token(NamedTuple):  # a NamedTuple: tokenizing real data creates many, and it is the fastest to build
    kind: str  # "num", "op", "(", ")", "=" or "break"
    start: int
    end: int
    op: str = ""  # normalised operator: + - * /
    number: Fraction = Fraction(0)  # as written, before applying a percent sign
    decimals: int = 0
    percent: bool = False

    @property
    def value(self) -> Fraction:
        return self.number / 100 if self.percent else self.number


_NUMBER = r"(?:\$ ?)?(?P<digits>(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)(?P<pct> ?%)?"
_TOKEN_RE = re.compile(
    r"(?P<ws>\*\*|[ \t\r\f\v]+)"  # markdown bold markers are layout, not a power operator
    rf"|(?P<num>{_NUMBER})"
    # x only between operands: in "2x-5" or "x = 5" it is a variable.
    r"|(?P<op>[-+*/×÷·−]|\\times|\\cdot|\\div|[xX](?=\s*[\d.$(]))"
    r"|(?P<paren>[()])|(?P<eq>=)"
    r"|(?P<of>of\b)"  # "50% of 40"
    r"|(?P<word>[^\W\d_][\w']*(?:[ \t]+[^\W\d_][\w']*)*)"  # a run of words: one match is faster
    r"|(?P<other>\n|.)"
)
_NUMBER_RE = re.compile(_NUMBER)
# Letters glued to a number make it a word ("2nd", "10am", "2x"), except an operator x as in "3x4".
_GLUED_WORD_RE = re.compile(r"(?![xX]\s*[\d.$(])[^\W\d_][\w']*")
# Leading zeros ("0900", "007") mark clock times and codes, not quantities.
_LEADING_ZERO_RE = re.compile(r"0\d")
_OPS = {
    "×": "*",
    "·": "*",
    "x": "*",
    "X": "*",
    "\\times": "*",
    "\\cdot": "*",
    "÷": "/",
    "\\div": "/",
    "−": "-",
}
_ANNOTATION_RE = re.compile(r"<<([^<>]*)>>")
MAX_DIGITS = 100  # longer digit runs are not quantities (Python refuses int() of over 4300 digits)
MAX_DEPTH = 32  # deeper parenthesis nesting is not a claim anyone writes: "not verifiable"


def _tokenize(text: str, pos: int = 0, end: int | None = None) -> list[_Token]:
    """Split ``text[pos:end]`` into maths tokens; everything that is not maths becomes a "break"."""
    end = len(text) if end is None else end
    tokens: list[_Token] = []
    while pos < end:
        m = _TOKEN_RE.match(text, pos, end)
        assert m is not None  # the "other" alternative matches any single character
        kind, pos = m.lastgroup, m.end()
        if kind == "num":
            glued = _GLUED_WORD_RE.match(text, pos, end)
            digits = m.group("digits").replace(",", "")
            if glued or _LEADING_ZERO_RE.match(digits) or len(digits) > MAX_DIGITS:
                pos = glued.end() if glued else pos
                tokens.append(_Token("break", m.start(), pos))
                continue
            tokens.append(
                _Token(
                    "num",
                    m.start(),
                    pos,
                    number=Fraction(digits),
                    decimals=len(digits.partition(".")[2]),
                    percent=m.group("pct") is not None,
                )
            )
        elif kind == "op":
            tokens.append(_Token("op", m.start(), pos, op=_OPS.get(m.group(), m.group())))
        elif kind in ("paren", "eq"):
            tokens.append(_Token(m.group(), m.start(), pos))
        elif kind == "of" and tokens and tokens[-1].percent:
            tokens.append(_Token("op", m.start(), pos, op="*"))  # "50% of 40"
        elif kind != "ws" and (not tokens or tokens[-1].kind != "break"):  # one break ends a run
            tokens.append(_Token("break", m.start(), pos))
    return tokens


class _ParseError(Exception):
    pass


class _TooDeep(Exception):
    """Parentheses nested beyond `MAX_DEPTH`: the run of text holds no verifiable step. Not a
    `_ParseError`, so that no backtracking retries it at every level."""


class _Parser:
    """Recursive descent over tokens: expr := term (+|- term)*, term := unary (*|/ unary)*, unary := -unary
    | atom, atom := number | number/number (written without spaces) | ( expr ).

    A failed operand after a binary operator backtracks to just before that operator, so parsing stops
    at the longest valid prefix; callers that need the whole segment check ``pos``. Signs are counted in a
    loop and parentheses recurse at most ``MAX_DEPTH`` deep (then `_TooDeep`), so no text can exhaust
    Python's recursion limit.
    """

    def __init__(self, tokens: list[_Token]) -> None:
        self.tokens = tokens
        self.pos = 0
        self.binops = 0
        self.depth = 0

    def _peek(self, offset: int = 0) -> _Token | None:
        i = self.pos + offset
        return self.tokens[i] if i < len(self.tokens) else None

    def expr(self) -> Fraction | None:
        return self._binary(("+", "-"), self._term)

    def _term(self) -> Fraction | None:
        return self._binary(("*", "/"), self._unary)

    def _binary(self, ops: tuple[str, str], operand: Any) -> Fraction | None:
        value = operand()
        while (tok := self._peek()) is not None and tok.kind == "op" and tok.op in ops:
            saved = (self.pos, self.binops)
            self.pos += 1
            try:
                right = operand()
            except _ParseError:
                self.pos, self.binops = saved
                break
            self.binops += 1
            value = _apply(tok.op, value, right)
        return value

    def _unary(self) -> Fraction | None:
        negative = False
        # A minus is a sign only when glued to its operand: "- 5" after a word is a dash in prose.
        while (
            (tok := self._peek()) is not None
            and tok.op == "-"
            and (nxt := self._peek(1)) is not None
            and tok.end == nxt.start
        ):
            self.pos += 1
            negative = not negative
        value = self._atom()
        return -value if negative and value is not None else value

    def _atom(self) -> Fraction | None:
        tok = self._peek()
        if tok is not None and tok.kind == "num":
            self.pos += 1
            slash, denominator = self._peek(), self._peek(1)
            if (
                slash is not None
                and denominator is not None
                and slash.op == "/"
                and denominator.kind == "num"
                and tok.end == slash.start
                and slash.end == denominator.start
            ):
                # A tight fraction is one quantity: people write "60 / 3/4" for 60 ÷ (3/4).
                self.pos += 2
                self.binops += 1
                return _apply("/", tok.value, denominator.value)
            return tok.value
        if tok is not None and tok.kind == "(":
            if self.depth == MAX_DEPTH:
                raise _TooDeep
            self.pos += 1
            self.depth += 1
            value = self.expr()
            self.depth -= 1
            closing = self._peek()
            if closing is None or closing.kind != ")":
                raise _ParseError
            self.pos += 1
            return value
        raise _ParseError


def _apply(op: str, left: Fraction | None, right: Fraction | None) -> Fraction | None:
    """One binary operation; ``None`` (from a division by zero) propagates."""
    if left is None or right is None or (op == "/" and right == 0):
        return None
    if op == "+":
        return left + right
    if op == "-":
        return left - right
    return left * right if op == "*" else left / right


@dataclass(frozen=True)
class _Segment:
    """A parsed stretch of tokens between ``=`` signs."""

    tokens: list[_Token]  # the tokens actually parsed
    value: Fraction | None
    binops: int
    full: bool  # whether the parse used the whole stretch

    def readings(self) -> list[tuple[Fraction, Fraction]] | None:
        """(claimed value, tolerance) pairs if this segment is a result, else None."""
        toks = self.tokens
        if toks and toks[0].op == "-":  # a glued sign (the parser only accepts it as such)
            sign, toks = -1, toks[1:]
        else:
            sign = 1
        if len(toks) == 1 and toks[0].kind == "num":
            num = toks[0]
            raw = sign * num.number
            half_unit = Fraction(1, 2 * 10**num.decimals)
            if num.percent:
                return [(raw / 100, half_unit / 100), (raw, half_unit)]
            return [(raw, half_unit)]
        simple = all(t.kind == "num" and not t.percent and t.decimals == 0 for t in toks[::2])
        if len(toks) == 3 and toks[1].op == "/" and simple and self.value is not None:
            return [(self.value, Fraction(0))]
        return None


def _parse(tokens: list[_Token]) -> _Segment | None:
    parser = _Parser(tokens)
    try:
        value = parser.expr()
    except _ParseError:
        return None
    return _Segment(tokens[: parser.pos], value, parser.binops, parser.pos == len(tokens))


def _parse_lhs(tokens: list[_Token]) -> _Segment | None:
    """Parse a whole left-hand side; an unmatched leading ``(`` belongs to the prose and is dropped.

    A left-hand side that starts with a binary operator continues an expression over a word, as in
    ``X*2 - $40 = $250`` or ``the cost - 5 + 3 = 8``: its number-only tail is not the claim, so no step.
    """
    for k in range(len(tokens)):
        seg = _parse(tokens[k:])
        if seg is not None and seg.full:
            return seg
        if tokens[k].kind != "(":
            return None
    return None


def _parse_rhs(tokens: list[_Token]) -> _Segment | None:
    """Parse the last right-hand side, which may trail off (``= 8 (apples)``) but not continue the maths.

    ``= 16 + x`` or ``= $409 500`` go on with a word or another number, so they state no plain result.
    """
    seg = _parse(tokens)
    if seg is None or seg.full or tokens[len(seg.tokens)].kind not in ("op", "num"):
        return seg
    return None


def _judge(value: Fraction | None, readings: list[tuple[Fraction, Fraction]]) -> tuple[Fraction, bool]:
    """The claimed value (the reading that matched, else the first) and whether the claim holds."""
    if value is not None:
        for claimed, tolerance in readings:
            if abs(value - claimed) <= tolerance:
                return claimed, True
    return readings[0][0], False


def _split(tokens: list[_Token], kind: str) -> Iterator[list[_Token]]:
    part: list[_Token] = []
    for tok in tokens:
        if tok.kind == kind:
            yield part
            part = []
        else:
            part.append(tok)
    yield part


def _chain_segments(parts: list[list[_Token]]) -> list[_Segment | None]:
    """The parsed segments of ``a = b = ... = z``; middle segments must parse whole."""
    last = len(parts) - 1
    segments = [_parse_lhs(parts[0])]
    segments += [s if s is not None and s.full else None for s in map(_parse, parts[1:last])]
    segments.append(_parse_rhs(parts[last]))
    return segments


def _plain_steps(text: str) -> Iterator[Step]:
    for run in _split(_tokenize(text), "break"):
        parts = list(_split(run, "="))
        if len(parts) < 2:
            continue
        try:
            segments = _chain_segments(parts)
        except _TooDeep:
            continue
        for i, seg in enumerate(segments):
            if seg is None or seg.binops == 0:
                continue
            for later in segments[i + 1 :]:
                if later is None or not later.tokens:
                    break
                readings = later.readings()
                if readings is not None:
                    claimed, correct = _judge(seg.value, readings)
                    start, expr_end = seg.tokens[0].start, seg.tokens[-1].end
                    yield Step(text[start:expr_end], claimed, seg.value, correct, start, later.tokens[-1].end)
                    break


def _annotation_steps(text: str) -> Iterator[Step]:
    for m in _ANNOTATION_RE.finditer(text):
        eq = m.group(1).rfind("=")
        if eq < 0:
            continue
        eq += m.start(1)
        try:
            left, right = _parse(_tokenize(text, m.start(1), eq)), _parse(_tokenize(text, eq + 1, m.end(1)))
        except _TooDeep:
            continue
        if left is None or right is None or not (left.full and right.full) or left.binops == 0:
            continue
        readings = right.readings()
        if readings is None:
            continue
        claimed, correct = _judge(left.value, readings)
        # The result is usually repeated right after the annotation; it is part of the claim's span.
        repeated = _NUMBER_RE.match(text, m.end())
        end = repeated.end() if repeated else m.end()
        yield Step(text[m.start(1) : eq].strip(), claimed, left.value, correct, m.start(), end)


def find_steps(text: str) -> list[Step]:
    """All arithmetic claims in ``text``, in order of position (see the module docstring for the rules)."""
    annotated = list(_annotation_steps(text))
    # Blank annotations out (same length, so offsets stay valid) before reading the plain text.
    blanked = _ANNOTATION_RE.sub(lambda m: " " * len(m.group()), text)
    # Kept plain claims do not overlap any annotation, so their text is the same in both copies.
    plain = [
        s for s in _plain_steps(blanked) if not any(s.start < a.end and a.start < s.end for a in annotated)
    ]
    return sorted(annotated + plain, key=lambda s: s.start)


def wrong_step_spans(text: str) -> list[tuple[int, int]]:
    """Character spans ``(start, end)`` of the claims in ``text`` that do not verify."""
    return [(s.start, s.end) for s in find_steps(text) if not s.correct]


class StepReward:
    """TRL-style reward: the fraction of verified steps in each completion.

    ``no_steps`` is returned for a completion without any step (``None`` lets TRL ignore it).
    """

    __name__ = "step_reward"  # TRL names reward functions (logs, metrics) by ``__name__``

    def __init__(self, no_steps: float | None = 0.0) -> None:
        self.no_steps = no_steps

    def score(self, text: str) -> float | None:
        """Fraction of correct steps in ``text``, or ``no_steps`` when it states none."""
        steps = find_steps(text)
        if not steps:
            return self.no_steps
        return sum(s.correct for s in steps) / len(steps)

    def __call__(self, completions: list[Any], **kwargs: Any) -> list[float | None]:
        """Score each completion; extra dataset columns (``answer``, ``prompts``...) are ignored."""
        return [self.score(completion_text(c)) for c in completions]


step_reward = StepReward()
