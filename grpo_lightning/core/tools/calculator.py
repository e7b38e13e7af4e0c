"""A calculator tool for arithmetic word problems (GSM8K): the model's expression is parsed, never `eval`ed.

Only a whitelist of the expression's syntax tree is evaluated: numbers, `+ - * / // % **`, unary `-` and
`+`, parentheses, and the functions of `FUNCTIONS`. The cost of each operation is bounded before it runs,
so that `9**9**9`, a product of huge numbers or `round(1, -10**15)` (which makes CPython compute
`10**(10**15)`) is refused at once instead of computing for hours: every value, operand and result, stays
within `MAX_MAGNITUDE`, `round`'s digits within `MAX_ROUND_DIGITS`, and an expression within
`MAX_EXPRESSION_LENGTH` characters.

`calculator` evaluates in a child process of its own (started at its first call, reused after), which is
killed and replaced where an expression takes more than `EVALUATION_SECONDS`: a big-number operation holds
CPython's global lock for its whole length, so a runaway that the bounds above missed could not be stopped
from a thread of the trainer, nor would the trainer's own threads run meanwhile. This module uses the
standard library only: the child runs it as a script.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import resource
import select
import subprocess
import sys
import threading
from collections.abc import Callable

MAX_EXPRESSION_LENGTH = 300
MAX_MAGNITUDE = 10**15  # beyond any GSM8K answer; products of two such values stay cheap
MAX_ROUND_DIGITS = 30  # round(x, n): |n| beyond the digits any value within MAX_MAGNITUDE has
EVALUATION_SECONDS = 2.0  # an expression's evaluation in the child process, at most
Number = int | float


def _round(value: Number, digits: Number | None = None) -> Number:
    """`round(value, digits)`, with `digits` an integer within `MAX_ROUND_DIGITS` (an integer rounded to
    -10**15 digits builds 10**(10**15) first)."""
    if digits is None:
        return round(value)
    if not isinstance(digits, int):
        raise ValueError(f"the digits must be an integer, got {digits!r}")
    if abs(digits) > MAX_ROUND_DIGITS:
        raise ValueError(f"the digits must be within {MAX_ROUND_DIGITS} of 0, got {digits}")
    return round(value, digits)


FUNCTIONS: dict[str, Callable[..., Number]] = {
    "sqrt": math.sqrt,
    "abs": abs,
    "round": _round,
    "min": min,
    "max": max,
    "floor": math.floor,
    "ceil": math.ceil,
}

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def _bounded(value: Number) -> Number:
    if isinstance(value, complex) or (isinstance(value, float) and not math.isfinite(value)):
        raise ValueError("the result is not a finite real number")
    if abs(value) > MAX_MAGNITUDE:
        raise ValueError(f"a value exceeds {MAX_MAGNITUDE:.0e} in magnitude")
    return value


def _power(base: Number, exponent: Number) -> Number:
    """`base ** exponent`, refused before it runs when its magnitude would pass `MAX_MAGNITUDE`."""
    if abs(base) > 1 and exponent > 0 and exponent * math.log10(abs(base)) > math.log10(MAX_MAGNITUDE):
        raise ValueError(f"{base}**{exponent} exceeds {MAX_MAGNITUDE:.0e} in magnitude")
    if base == 0 and exponent < 0:
        raise ValueError("0 cannot be raised to a negative power")
    if abs(base) < 1 and base != 0 and exponent < 0:  # 0.001 ** -100 grows too
        if -exponent * -math.log10(abs(base)) > math.log10(MAX_MAGNITUDE):
            raise ValueError(f"{base}**{exponent} exceeds {MAX_MAGNITUDE:.0e} in magnitude")
    return base**exponent


def _evaluate(node: ast.AST) -> Number:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            return _bounded(_power(left, right))
        if isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and right == 0:
            raise ValueError("division by zero")
        return _bounded(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS:
        if node.keywords:
            raise ValueError(f"{node.func.id}() takes no keyword arguments")
        arguments = [_evaluate(argument) for argument in node.args]
        try:
            return _bounded(FUNCTIONS[node.func.id](*arguments))
        except (TypeError, ValueError) as error:
            raise ValueError(f"{node.func.id}(): {error}") from None
    what = f"{node.func.id}()" if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) else None
    raise ValueError(
        f"{what or type(node).__name__} is not allowed (only numbers, + - * / // % **, "
        f"parentheses and {', '.join(FUNCTIONS)})"
    )


def evaluate_arithmetic(expression: str) -> Number:
    """The value of an arithmetic `expression`; ValueError naming what is not allowed or too large."""
    if len(expression) > MAX_EXPRESSION_LENGTH:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_LENGTH} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as error:
        raise ValueError(f"not an arithmetic expression: {error.msg}") from None
    except (RecursionError, MemoryError):  # the parser's own bound on nesting
        raise ValueError("the expression is nested too deeply") from None
    try:
        return _evaluate(tree)
    except RecursionError:
        raise ValueError("the expression is nested too deeply") from None


def format_number(value: Number) -> str:
    """An integral value without a decimal point (`6/2` -> "3"), others to 12 significant digits."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value) if isinstance(value, int) else format(value, ".12g")


def _answer(expression: str) -> tuple[bool, str]:
    """`(True, the formatted value)` of `expression`, or `(False, why not)`."""
    try:
        return True, format_number(evaluate_arithmetic(expression))
    except ValueError as error:
        return False, str(error)


class _Evaluator:
    """A child process that answers one expression per line (JSON in, `[ok, text]` JSON out), started
    where there is none, and killed (then started again at the next call) past `EVALUATION_SECONDS`."""

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None
        self.lock = threading.Lock()

    def __call__(self, expression: str) -> str:
        with self.lock:
            if self.process is None or self.process.poll() is not None:
                self.process = subprocess.Popen(
                    [sys.executable, "-I", "-S", __file__],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    bufsize=1,
                )
            process = self.process
            process.stdin.write(json.dumps(expression) + "\n")
            process.stdin.flush()
            ready, _, _ = select.select([process.stdout], [], [], EVALUATION_SECONDS)
            line = process.stdout.readline() if ready else ""
            if not line:
                process.kill()
                process.wait()
                self.process = None
                raise ValueError(f"the expression took more than {EVALUATION_SECONDS:g} s to evaluate")
        ok, text = json.loads(line)
        if not ok:
            raise ValueError(text)
        return text


_EVALUATOR = _Evaluator()


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: numbers with + - * / // % ** and parentheses, and the functions sqrt, abs, round, min,
            max, floor and ceil, e.g. "(48 / 2) * 3 + 5".
    """
    return _EVALUATOR(expression)


def _serve() -> None:
    """The child process: answers each line of stdin, its memory bounded."""
    resource.setrlimit(resource.RLIMIT_AS, (512 * 2**20, 512 * 2**20))
    for line in sys.stdin:
        print(json.dumps(_answer(json.loads(line))), flush=True)


if __name__ == "__main__":
    _serve()
