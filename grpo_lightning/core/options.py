"""How options are checked: one `Rule` per option (type, bounds, choices), one error format naming the
option. Used by every option dataclass (`GRPOConfig`, `ModelOptions`, `LoraOptions`), the data modules and
the loss functions' string arguments."""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, is_dataclass

_COMPARE = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}
_KIND_WORDS = {
    int: "an integer",
    float: "a number",
    bool: "true or false",
    str: "a string",
    list: "a list of names",
}


@dataclass(frozen=True)
class Rule:
    """What one option accepts: its type, bounds such as "> 0, <= 1", or a set of choices.

    Args:
        kind: int, float (ints accepted, NaN and inf refused), bool, str, or list (a list of strings); a
            tuple of them for an option of several types.
        bounds: comma-separated comparisons that the value must pass, e.g. ">= 2" or "> 0, <= 1".
        choices: the only values allowed.
        none: None is allowed (it means what the option's docstring says).
        why: the reason, shown after the rule.
    """

    kind: type | tuple[type, ...]
    bounds: str = ""
    choices: tuple[str, ...] = ()
    none: bool = False
    why: str = ""

    def problem(self, value: object) -> str | None:
        """None when `value` is allowed, else the rule it breaks ("must be > 0 and <= 1 (why)")."""
        if value is None:
            return None if self.none else self.expected(type_too=False)
        if not any(_is_kind(value, kind) for kind in self.kinds):
            return self.expected(type_too=True)
        if self.choices and value not in self.choices:
            return self.expected(type_too=False)
        for text in filter(None, (b.strip() for b in self.bounds.split(","))):
            op, bound = text.split()
            if not _COMPARE[op](value, float(bound)):
                return self.expected(type_too=False)
        return None

    @property
    def kinds(self) -> tuple[type, ...]:
        return self.kind if isinstance(self.kind, tuple) else (self.kind,)

    def expected(self, type_too: bool) -> str:
        if self.choices:
            text = "one of " + ", ".join(self.choices)
        else:
            bounds = " and ".join(b.strip() for b in self.bounds.split(",") if b.strip())
            if bounds and not type_too:
                text = bounds
            else:
                kind = " or ".join(_KIND_WORDS[k] for k in self.kinds)
                kind = kind.replace("a number", "a finite number")
                text = f"{kind} {bounds}".rstrip()
        text = f"must be {text}" + (" or None" if self.none else "")
        return f"{text} ({self.why})" if self.why else text


def _is_kind(value: object, kind: type) -> bool:
    if kind is float:  # ints are numbers too, booleans are not; NaN and inf pass no bound: refused
        return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is list:
        return isinstance(value, list) and bool(value) and all(isinstance(v, str) and v for v in value)
    return isinstance(value, kind)


def option_error(options: object | str, option: str, value: object, rule: str) -> ValueError:
    """The one message format of a bad option: `Owner.option=value: rule`; the owner is the options object's
    class name, or a name such as "data"."""
    owner = options if isinstance(options, str) else type(options).__name__
    return ValueError(f"{owner}.{option}={value!r}: {rule}")


def check_value(owner: str, option: str, value: object, rule: Rule) -> None:
    """Raise `option_error` when `value` of `owner.option` breaks `rule`."""
    problem = rule.problem(value)
    if problem is not None:
        raise option_error(owner, option, value, problem)


def option_differences(
    saved: Mapping, current: Mapping, prefix: str = ""
) -> list[tuple[str, object, object]]:
    """(dotted name, saved value, current value) for each option of `saved` whose value differs in `current`;
    option dataclasses and dicts on both sides are compared option by option ("grpo.top_p"). Names starting
    with "_" are Lightning's bookkeeping (`_instantiator`), not options."""
    rows = []
    for key, theirs in saved.items():
        if key.startswith("_"):
            continue
        theirs, ours = plain_options(theirs), plain_options(current.get(key))
        if isinstance(theirs, dict) and isinstance(ours, dict):
            rows += option_differences(theirs, ours, f"{prefix}{key}.")
        elif theirs != ours:
            rows.append((prefix + key, theirs, ours))
    return rows


def plain_options(value: object) -> object:
    """An option dataclass as a dict (nested), anything else as it is."""
    return asdict(value) if is_dataclass(value) and not isinstance(value, type) else value


def check_options(options: object, rules: dict[str, Rule]) -> None:
    """Raise `option_error` for the first option of the dataclass `options` that breaks its rule."""
    for field in fields(options):
        check_value(type(options).__name__, field.name, getattr(options, field.name), rules[field.name])
