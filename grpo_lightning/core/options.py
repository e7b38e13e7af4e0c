"""How options are declared and checked, in one place each: an option's type, its choices (`Literal`) and its
range (`Annotated[float, Range("> 0, <= 1")]`) are its annotation, which jsonargparse reads for the CLI and
`--help` prints; `check_fields` checks a built options object against the same annotations, with one error
format naming the option. Rules between options stay in the owner's `__post_init__`.

Sections: an options dataclass may hold others (`GRPOConfig` holds one per unit of the algorithm, each
declared beside the code that reads it), an optional one (`X | None`) being a feature that is off. A field
may declare another name it answers to (`Alias`, TRL's or an earlier flat name); `core.flat_names` derives
the one table of those names, and files options given by them into their sections.

Used by every option dataclass (`GRPOConfig` and its sections, `ModelOptions`, `LoraOptions`) and the data
modules' arguments.
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
import warnings
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
    dict: "a mapping of names to values",
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


# The ranges several options share.
PositiveInt = Annotated[int, Range("> 0")]
NonNegativeInt = Annotated[int, Range(">= 0")]
AtLeastOne = Annotated[int, Range(">= 1")]
PositiveFloat = Annotated[float, Range("> 0")]
NonNegativeFloat = Annotated[float, Range(">= 0")]


@dataclass(frozen=True)
class Alias:
    """The other name of an option, as the metadata of its annotation: `Annotated[float | None,
    Alias("advantage_clip")]` on `AdvantageOptions.clip` makes `advantage_clip` (TRL's name) set
    `advantages.clip`. On an optional section (`X | None`) the alias is its switch: true is the section with
    its defaults, false None (`Alias("sync_ref_model")` on `reference_sync`).
    """

    name: str

    def __repr__(
        self,
    ) -> str:  # what `--help` prints inside the type: "Annotated[float, alias advantage_clip]"
        return f"alias {self.name}"


@dataclass(frozen=True)
class TRLValues:
    """TRL's spellings of an option's values, as the metadata of its annotation: `(TRL's value, ours)` pairs,
    e.g. `TRLValues((False, "none"), (True, "group"))` on `scale_rewards`, which TRL also takes as a bool.
    `cli.py from-trl` converts by them (`trl_value`)."""

    pairs: tuple[tuple[object, object], ...]

    def __init__(self, *pairs: tuple[object, object]) -> None:
        object.__setattr__(self, "pairs", pairs)

    def __repr__(self) -> str:  # what `--help` prints inside the type
        return "TRL's " + ", ".join(f"{theirs!r} is {ours!r}" for theirs, ours in self.pairs)


def trl_value(owner: type, option: str, value: object) -> tuple[object, bool]:
    """`value` of TRL's as ours, by the `TRLValues` of `owner`'s field `option` (bools and numbers told
    apart: TRL's `True` is not its `1`), and whether it was one of TRL's spellings."""
    annotation = declared_annotation(owner, option)
    candidates = [annotation, *typing.get_args(annotation)]
    for candidate in candidates:
        if typing.get_origin(candidate) is Annotated:
            for meta in candidate.__metadata__:
                if isinstance(meta, TRLValues):
                    for theirs, ours in meta.pairs:
                        if type(theirs) is type(value) and theirs == value:
                            return ours, True
    return value, False


@dataclass(frozen=True)
class Rule:
    """What one annotation allows: its kinds, bounds, choices, and whether None is allowed."""

    kinds: tuple[type, ...]
    bounds: str = ""
    choices: tuple = ()
    none: bool = False
    why: str = ""
    spellings: tuple[tuple[object, object], ...] = ()  # TRL's spellings of the values (`TRLValues`)

    def problem(self, value: object) -> str | None:
        """None when `value` is allowed, else the rule it breaks ("must be > 0 and <= 1 (why)"), and what it
        is here where it is one of TRL's spellings."""
        broken = self._broken(value)
        ours = next((o for t, o in self.spellings if type(t) is type(value) and t == value), broken)
        if broken is None or ours is broken:
            return broken
        return f"{broken}; TRL's {value!r} is {ours!r} here, which its flat name also takes"

    def _broken(self, value: object) -> str | None:
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
    `dict[str, ...]`, a union of those, or a plain `int`, `float`, `bool` or `str`."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        rules = [rule_of(a) for a in args if a is not type(None)]
        rule = rules[0] if len(rules) == 1 else Rule(tuple(k for r in rules for k in r.kinds))
        return replace(rule, none=type(None) in args)
    if origin is Annotated:
        base, *metadata = typing.get_args(annotation)
        if section_class(base) is not None:
            raise TypeError(f"{annotation!r} is a section: its own fields carry the rules")
        ranges = [m for m in metadata if isinstance(m, Range)]
        spellings = tuple(pair for m in metadata if isinstance(m, TRLValues) for pair in m.pairs)
        rule = replace(rule_of(base), spellings=spellings)
        return replace(rule, bounds=ranges[0].bounds, why=ranges[0].why) if ranges else rule
    if origin is Literal:
        choices = typing.get_args(annotation)
        return Rule((type(choices[0]),), choices=choices)
    if origin in (list, dict):
        return Rule((origin,))
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
def declared_annotation(owner: Callable | type, option: str) -> object:
    """The annotation of a dataclass's field, or of a function's argument. A postponed annotation (a string)
    is evaluated in the owner's module, this one alone: another argument's may name a type imported only for
    type checkers."""
    for cls in owner.__mro__ if isinstance(owner, type) else (owner,):
        annotation = inspect.get_annotations(cls).get(option)
        if annotation is not None:
            break
    if isinstance(annotation, str):
        annotation = eval(annotation, vars(sys.modules[cls.__module__]))  # as typing.get_type_hints does
    return annotation


@cache
def declared_rule(owner: Callable | type, option: str) -> Rule:
    """The `Rule` of a dataclass's field, or of a function's argument, from its annotation."""
    return rule_of(declared_annotation(owner, option))


def declared_alias(owner: type, option: str) -> str | None:
    """The `Alias` that the annotation of `owner`'s field `option` declares, or None."""
    annotation = declared_annotation(owner, option)
    if typing.get_origin(annotation) is not Annotated:
        return None
    return next((m.name for m in annotation.__metadata__ if isinstance(m, Alias)), None)


def section_class(annotation: object) -> type | None:
    """The options dataclass that an annotation (`X`, `X | None`, `Annotated[X | None, ...]`) holds, or None
    for an option of a plain type."""
    if typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        annotation = args[0] if len(args) == 1 else None
    return annotation if isinstance(annotation, type) and is_dataclass(annotation) else None


def may_be_off(annotation: object) -> bool:
    """Whether an annotation admits None (`X | None`, also inside `Annotated`): a section that may be off."""
    if typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    return union and type(None) in typing.get_args(annotation)


# Where each section sits in the options that compose it ("GRPOConfig.kl"), for its messages.
_SECTION_PLACES: dict[type, str] = {}


def option_error(options: object | str, option: str, value: object, rule: str) -> ValueError:
    """The one message format of a bad option: `Owner.option=value: rule`; the owner is the options object's
    place (`GRPOConfig.kl` for a section of `GRPOConfig`, else its class name), or a name such as "data". An
    option with an `Alias` names it after the value: `GRPOConfig.kl.estimator='k1' (kl_estimator): ...`."""
    if isinstance(options, str):
        return ValueError(f"{options}.{option}={value!r}: {rule}")
    owner = _SECTION_PLACES.get(type(options), type(options).__name__)
    alias = declared_alias(type(options), option) if option in _field_names(type(options)) else None
    named = f" ({alias})" if alias and alias != option else ""
    return ValueError(f"{owner}.{option}={value!r}{named}: {rule}")


def _field_names(cls: type) -> set[str]:
    return {f.name for f in fields(cls)} if is_dataclass(cls) else set()


def check_fields(options: object) -> None:
    """Raise `option_error` for the first field of the dataclass `options` that breaks its annotation. A
    section's fields are its own to check (its `__post_init__`)."""
    for field in fields(options):
        value = getattr(options, field.name)
        annotation = declared_annotation(type(options), field.name)
        section = section_class(annotation)
        if section is not None:
            optional = may_be_off(annotation)
            if not isinstance(value, section) and not (optional and value is None):
                switch = " or true/false" if declared_alias(type(options), field.name) else ""
                rule = f"must be a mapping of {section.__name__}'s options" + (
                    " or None" + switch if optional else ""
                )
                raise option_error(options, field.name, value, rule)
            continue
        problem = declared_rule(type(options), field.name).problem(value)
        if problem is not None:
            raise option_error(options, field.name, value, problem)


def warn_inert(options: object, option: str, needed: str) -> None:
    """Warn that `options.option`, set away from its default, does nothing without `needed`."""
    value = getattr(options, option)
    default = next(f.default for f in fields(options) if f.name == option)
    if value != default:
        owner = _SECTION_PLACES.get(type(options), type(options).__name__)
        warnings.warn(f"{owner}.{option}={value!r} has no effect without {needed}", stacklevel=4)


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
