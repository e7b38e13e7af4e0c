"""The flat names of a composed options class (`GRPOConfig`): `flat_names` derives the one table of the names
its options answer to (each field's `Alias`, TRL's or an earlier flat name, else its own name; an optional
section's alias is its switch) from the sections' declarations, and `sectioned` files options given by those
names into their sections; `section_at`, `default_at` and `build_section` reach a section by its path.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, fields, is_dataclass
from functools import cache
from typing import Any

from grpo_lightning.core.options import (
    _SECTION_PLACES,
    _field_names,
    declared_alias,
    declared_annotation,
    declared_rule,
    section_class,
    trl_value,
)


@dataclass(frozen=True)
class FlatName:
    """Where a flat name (TRL's, or an option's own name) puts its value: the `path` of keys through the
    sections; a `switch` turns the optional section at `path` on (true) or off (false)."""

    path: tuple[str, ...]
    switch: bool = False

    @property
    def key(self) -> str:
        return ".".join(self.path)


@cache
def flat_names(composer: type) -> dict[str, FlatName]:
    """The alias table of a composed options class, derived from its sections' declarations: every option by
    its `Alias` where it declares one, else by its own name, and each optional section's switch by its alias.
    Two options of one flat name are a declaration error, raised here."""
    table: dict[str, FlatName] = {}

    def add(name: str, entry: FlatName) -> None:
        if name in table:
            raise TypeError(f"{composer.__name__}: {table[name].key} and {entry.key} both answer to {name!r}")
        table[name] = entry

    def walk(cls: type, prefix: tuple[str, ...], place: str) -> None:
        for field in fields(cls):
            annotation = declared_annotation(cls, field.name)
            path, alias = (*prefix, field.name), declared_alias(cls, field.name)
            section = section_class(annotation)
            if section is None:
                add(alias or field.name, FlatName(path))
                continue
            _SECTION_PLACES[section] = f"{place}.{field.name}"
            if alias is not None:
                add(alias, FlatName(path, switch=True))
            walk(section, path, f"{place}.{field.name}")

    walk(composer, (), composer.__name__)
    return table


def sectioned(composer: type, given: Mapping[str, Any], where: str) -> dict[str, Any]:
    """`given` (options by section key, or by flat name: `flat_names`) as keys of `composer` only, each
    section a dict (or the instance or None given for it). A flat name overrides its option in a section
    given as an instance (`dataclasses.replace(config, beta=0.1)`); given both ways otherwise, it is refused
    in one line naming `where` ("model.grpo"). An option of an optional section given by its flat name while
    the section is off is warned about and dropped, as it does nothing. Unknown keys are kept, for the
    caller to refuse."""
    table = flat_names(composer)
    result: dict[str, Any] = {}
    flat: dict[str, Any] = {}
    for name, value in given.items():
        entry = table.get(name)
        if entry is not None and entry.switch and entry.path != (name,) and not isinstance(value, bool):
            raise ValueError(f"{composer.__name__}.{entry.key}={value!r}: must be true or false, as {name}")
        by_flat = entry is not None and (isinstance(value, bool) if entry.switch else entry.path != (name,))
        (flat if by_flat else result)[name] = value  # else a section, a top-level option or unknown
    for name, on in flat.items():
        entry = table[name]
        if not entry.switch:
            continue
        (key,) = entry.path
        current = result.get(key)
        if not on and current is not None:
            raise ValueError(f"{where}: {name}: false and {key}: {current!r} disagree: give one")
        result[key] = (current if current is not None else {}) if on else None
    expanded: set[tuple[str, ...]] = set()
    for name, value in flat.items():
        entry = table[name]
        if entry.switch:
            continue
        value, _ = trl_value(section_at(composer, entry.path), entry.path[-1], value)  # TRL's name, its value
        switch = next((n for n, e in table.items() if e.switch and e.path == entry.path[:1]), None)
        if switch is not None and result.get(entry.path[0]) is None:
            section = section_at(composer, entry.path)
            problem = declared_rule(section, entry.path[-1]).problem(value)
            if problem is not None:  # refused, though it would do nothing
                place = _SECTION_PLACES.get(section, section.__name__)
                raise ValueError(f"{place}.{entry.path[-1]}={value!r} ({name}): {problem}")
            if value != default_at(composer, entry.path):
                warnings.warn(f"{where}.{name}={value!r} has no effect without {switch}: true", stacklevel=3)
            continue
        _place(result, entry.path, value, f"{where}: {name} and {entry.key}", expanded)
    return result


def section_at(composer: type, path: tuple[str, ...]) -> type:
    """The section class of `composer` that holds the option at `path`."""
    cls = composer
    for key in path[:-1]:
        cls = section_class(declared_annotation(cls, key))
    return cls


def default_at(composer: type, path: tuple[str, ...]) -> object:
    """The default of the option at `path` of the sections of `composer`."""
    return next(f.default for f in fields(section_at(composer, path)) if f.name == path[-1])


def _place(result: dict, path: tuple[str, ...], value: object, both: str, expanded: set) -> None:
    """Put `value` at `path` of the nested dict `result`, copying the dicts it passes and opening a section
    given as an instance into its values (`expanded`); a value a dict gives there already is refused."""
    node = result
    for depth, key in enumerate(path[:-1]):
        inner = node.get(key)
        if is_dataclass(inner):
            inner = {f.name: getattr(inner, f.name) for f in fields(inner)}
            expanded.add(path[: depth + 1])
        elif isinstance(inner, Mapping):
            inner = dict(inner)
        elif inner is None:
            inner = {}
        else:
            raise ValueError(f"{both} cannot both be given: {'.'.join(path[: depth + 1])} is {inner!r}")
        node[key] = inner
        node = inner
    if path[-1] in node and path[:-1] not in expanded:
        raise ValueError(f"{both} are one option, given twice: give one")
    node[path[-1]] = value


def build_section(owner: type, key: str, value: Mapping[str, Any]) -> object:
    """`owner`'s section `key` built from a dict of its options (its own sections as dicts too)."""
    cls = section_class(declared_annotation(owner, key))
    own = _field_names(cls)
    unknown = sorted(set(value) - own)
    if unknown:
        raise TypeError(
            f"{cls.__name__} has no option {unknown[0]!r} (its options: {', '.join(sorted(own))})"
        )
    return cls(**{k: build_section(cls, k, v) if _is_section(cls, k, v) else v for k, v in value.items()})


def _is_section(cls: type, key: str, value: object) -> bool:
    return isinstance(value, Mapping) and section_class(declared_annotation(cls, key)) is not None
