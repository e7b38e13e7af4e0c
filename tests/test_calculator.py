"""The calculator tool: GSM8K arithmetic right, everything outside its whitelist refused, and blowups
(`9**9**9`, huge products, long expressions) refused at once, never computed."""

import re
import time

import pytest

from grpo_lightning.core.tools.calculator import MAX_MAGNITUDE, calculator, evaluate_arithmetic
from grpo_lightning.core.tools.calls import ToolCall, ToolRunner


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("(48 / 2) * 3 + 5", "77"),
        ("6 / 4", "1.5"),
        ("7 // 2 + 7 % 2", "4"),
        ("-3 + +2", "-1"),
        ("2 ** 10", "1024"),
        ("2 ** -2", "0.25"),
        ("sqrt(16) + abs(-2) + round(2.6) + min(4, 1, 9) + max(2, 3) + floor(1.5) + ceil(1.2)", "16"),
        ("1 / 3", "0.333333333333"),
        (" 10 * 0.1 ", "1"),
    ],
)
def test_arithmetic(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(
    ("expression", "why"),
    [
        ("__import__('os').system('true')", "Call is not allowed"),
        ("__import__('os')", "__import__() is not allowed"),
        ("open('/etc/passwd')", "open() is not allowed"),
        ("x + 1", "Name is not allowed"),
        ("(1).real", "Attribute is not allowed"),
        ("[1, 2]", "List is not allowed"),
        ("'a' * 3", "Constant is not allowed"),
        ("True + 1", "Constant is not allowed"),
        ("1 if 1 else 2", "IfExp is not allowed"),
        ("lambda: 1", "Lambda is not allowed"),
        ("1 < 2", "Compare is not allowed"),
        ("round(2.5, ndigits=1)", "takes no keyword arguments"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("0 ** -1", "negative power"),
        ("(-8) ** 0.5", "not a finite real number"),
        ("sqrt(-1)", "sqrt(): math domain error"),
        ("2 +", "not an arithmetic expression"),
    ],
)
def test_refused(expression, why):
    with pytest.raises(ValueError, match=re.escape(why)):
        evaluate_arithmetic(expression)


@pytest.mark.parametrize(
    "expression",
    [
        "9**9**9",
        "10**16",
        "2**100000000",
        "0.5 ** -1000000",
        "(10**15) * (10**15) * (10**15)",
        "99999999 * 99999999 * 99999999 * 99999999",
        "1" * 20,
        "max(10**15, 10**15) * 2",
        "1+" * 200 + "1",
    ],
)
def test_blowups_are_refused_at_once(expression):
    start = time.perf_counter()
    with pytest.raises(ValueError, match="exceeds|longer than"):
        evaluate_arithmetic(expression)
    assert time.perf_counter() - start < 0.05
    assert evaluate_arithmetic(str(MAX_MAGNITUDE)) == MAX_MAGNITUDE  # the bound itself passes


def test_the_model_reads_a_refusal_as_an_error():
    [[(name, result)]] = ToolRunner([calculator])([[ToolCall("calculator", {"expression": "9**9**9"})]])
    assert name == "calculator" and result.startswith("{'error': '9**387420489 exceeds")
