"""How options are declared and checked, in one place each: an option's type, its choices (`Literal`) and its
range (`Annotated[float, Range("> 0, <= 1")]`) are its annotation, which jsonargparse reads for the CLI and
`--help` prints; `check_fields` checks a built options object against the same annotations, with one error
format naming the option. Rules between options stay in the owner's `__post_init__`.

Used by every option dataclass (`GRPOConfig`, `ModelOptions`, `LoraOptions`) and the data modules' arguments.
`Choices` are the registries of the loss functions' string arguments (verl's style): the choice set is the
registry's keys, and looking up a value it lacks names the argument and its choices.
"""

from __future__ import annotations

import inspect
import math
import operator
import sys
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields, is_dataclass, replace
from functools import cache
from typing import Annotated, Literal, TypeVar

_COMPARE = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}
_KIND_WORDS = {
    int: "an integer",
    float: "a number",
    bool: "true or false",
    str: "a string",
    list: "a list of names",
}


@dataclass(frozen=True)
class Range:
    """The bounds of a number option, as the metadata of its annotation: `Annotated[int, Range(">= 2")]`.

    Args:
        bounds: comma-separated comparisons that the value must pass, e.g. ">= 2" or "> 0, <= 1".
        why: the reason, shown after the rule in the error.
    """

    bounds: str
    why: str = ""

    def __repr__(self) -> str:  # what `--help` prints inside the type: "Annotated[float, > 0, <= 1]"
        return self.bounds


@dataclass(frozen=True)
class Rule:
    """What one annotation allows: its kinds, bounds, choices, and whether None is allowed."""

    kinds: tuple[type, ...]
    bounds: str = ""
    choices: tuple = ()
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

    def expected(self, type_too: bool) -> str:
        if self.choices:
            text = "one of " + ", ".join(map(str, self.choices))
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


def rule_of(annotation: object) -> Rule:
    """The `Rule` an annotation declares: `X | None`, `Annotated[X, Range(...)]`, `Literal[...]`, `list[str]`,
    a union of those, or a plain `int`, `float`, `bool` or `str`."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        rules = [rule_of(a) for a in args if a is not type(None)]
        rule = rules[0] if len(rules) == 1 else Rule(tuple(k for r in rules for k in r.kinds))
        return replace(rule, none=type(None) in args)
    if origin is Annotated:
        base, *metadata = typing.get_args(annotation)
        ranges = [m for m in metadata if isinstance(m, Range)]
        rule = rule_of(base)
        return replace(rule, bounds=ranges[0].bounds, why=ranges[0].why) if ranges else rule
    if origin is Literal:
        choices = typing.get_args(annotation)
        return Rule((type(choices[0]),), choices=choices)
    if origin is list:
        return Rule((list,))
    if annotation not in _KIND_WORDS:
        raise TypeError(f"no rule for the annotation {annotation!r}")
    return Rule((annotation,))


def _is_kind(value: object, kind: type) -> bool:
    if kind is float:  # ints are numbers too, booleans are not; NaN and inf pass no bound: refused
        return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is list:
        return isinstance(value, list) and bool(value) and all(isinstance(v, str) and v for v in value)
    return isinstance(value, kind)


@cache
def declared_rule(owner: Callable | type, option: str) -> Rule:
    """The `Rule` of a dataclass's field, or of a function's argument, from its annotation. A postponed
    annotation (a string) is evaluated in the owner's module, this one alone: another argument's may name a
    type imported only for type checkers."""
    annotation = inspect.get_annotations(owner)[option]
    if isinstance(annotation, str):
        annotation = eval(annotation, vars(sys.modules[owner.__module__]))  # as typing.get_type_hints does
    return rule_of(annotation)


def option_error(options: object | str, option: str, value: object, rule: str) -> ValueError:
    """The one message format of a bad option: `Owner.option=value: rule`; the owner is the options object's
    class name, or a name such as "data"."""
    owner = options if isinstance(options, str) else type(options).__name__
    return ValueError(f"{owner}.{option}={value!r}: {rule}")


def check_fields(options: object) -> None:
    """Raise `option_error` for the first field of the dataclass `options` that breaks its annotation."""
    for field in fields(options):
        value = getattr(options, field.name)
        problem = declared_rule(type(options), field.name).problem(value)
        if problem is not None:
            raise option_error(options, field.name, value, problem)


def check_arguments(owner: str, function: Callable, values: Mapping, names: list[str]) -> None:
    """Raise `option_error` (`owner.name=...`) for the first of `names` whose value in `values` breaks the
    annotation of `function`'s argument of that name."""
    for name in names:
        problem = declared_rule(function, name).problem(values[name])
        if problem is not None:
            raise option_error(owner, name, values[name], problem)


V = TypeVar("V")


class Choices(dict[str, V]):
    """A registry keyed by an argument's choices; a value it lacks raises naming the argument and the choices.

    `Literal[tuple(choices)]` is the argument's type, for the options that take one of them.
    """

    def __init__(self, argument: str, entries: Mapping[str, V]) -> None:
        super().__init__(entries)
        self.argument = argument

    def __missing__(self, key: object) -> V:
        raise ValueError(f"{self.argument}={key!r}: must be one of {', '.join(self)}")


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
