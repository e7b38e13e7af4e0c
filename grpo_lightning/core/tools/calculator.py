"""A calculator tool for arithmetic word problems (GSM8K): the model's expression is parsed, never `eval`ed.

Only a whitelist of the expression's syntax tree is evaluated: numbers, `+ - * / // % **`, unary `-` and
`+`, parentheses, and the functions of `FUNCTIONS`. Sizes are bounded before each operation runs, so that
`9**9**9` or a product of huge numbers is refused at once instead of computing for minutes: every value,
operand and result, stays within `MAX_MAGNITUDE`, and an expression within `MAX_EXPRESSION_LENGTH`
characters.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable

MAX_EXPRESSION_LENGTH = 300
MAX_MAGNITUDE = 10**15  # beyond any GSM8K answer; products of two such values stay cheap
Number = int | float

FUNCTIONS: dict[str, Callable[..., Number]] = {
    "sqrt": math.sqrt,
    "abs": abs,
    "round": round,
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
    return _evaluate(tree)


def format_number(value: Number) -> str:
    """An integral value without a decimal point (`6/2` -> "3"), others to 12 significant digits."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value) if isinstance(value, int) else format(value, ".12g")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: numbers with + - * / // % ** and parentheses, and the functions sqrt, abs, round, min,
            max, floor and ceil, e.g. "(48 / 2) * 3 + 5".
    """
    return format_number(evaluate_arithmetic(expression))
