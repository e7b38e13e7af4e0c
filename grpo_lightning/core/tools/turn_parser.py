"""An assistant turn's text read into the chat message TRL builds from it: regions (the thinking, each tool
call, the content) that open and close on the markers a chat template writes, each region's text read by
its own reader, the tool calls' arguments typed by the tools' JSON schemas.

This is the reading `transformers`' response parser does with the response templates TRL sets
(`trl.chat_template_utils.add_response_schema`), on the whole turn at once: the earliest marker wins (the
longer one on a tie, an opening before a closing), text outside every region goes to the one region that
needs no opening marker (the content), a region seen twice keeps its last text unless it repeats (the tool
calls). A turn that cannot be read (a call that is not valid JSON, a call without a name) is TRL's plain
turn: its text without special tokens as the content, no calls, so the sample ends there.

The work is bounded: markers are found by regular expressions without nested quantifiers over the same
text, each found at most once per position, and JSON nested deeper than `MAX_NESTING` is a turn that cannot
be read, never a `RecursionError`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

MAX_NESTING = 200
"""Brackets a tool call's JSON may nest: deeper is a turn that cannot be read (Python's JSON reader would
raise `RecursionError` a few hundred levels further)."""


class UnreadableTurn(ValueError):
    """A region whose text its reader cannot read: the turn falls back to plain text."""


@dataclass(frozen=True)
class Found:
    """Where a marker was found in the text, and what its named groups captured."""

    start: int
    end: int
    groups: dict[str, str] = field(default_factory=dict)


Finder = Callable[[str, int], Found | None]  # (text, position) -> the first marker at or after it


def pattern(regex: str) -> Finder:
    """A marker found by `regex` (`.` matches newlines, as in the response templates)."""
    compiled = re.compile(regex, re.DOTALL)

    def find(text: str, position: int) -> Found | None:
        match = compiled.search(text, position)
        if match is None:
            return None
        groups = {k: v for k, v in match.groupdict().items() if v is not None}
        return Found(match.start(), match.end(), groups)

    return find


def literal(marker: str) -> Finder:
    """A marker that is this exact text."""
    return pattern(re.escape(marker))


def before(marker: str) -> Finder:
    """An empty marker at the position itself when `marker` occurs anywhere after it (a thinking region
    whose opening the prompt wrote: it holds the text up to the closing marker, when the turn has one)."""

    def find(text: str, position: int) -> Found | None:
        return Found(position, position) if text.find(marker, position) >= 0 else None

    return find


Reader = Callable[[str, dict[str, str]], Any]  # (the region's text, its opening's groups) -> its value


def stripped_text(text: str, groups: dict[str, str]) -> str:
    """A region's text as it reads: stripped of the whitespace around it."""
    return text.strip()


@dataclass(frozen=True)
class Region:
    """One field of the assistant message: the markers around it and how its text is read.

    `opens` None: the region text falls into when no other is open (at most one per turn layout).
    `repeats`: each occurrence is appended to a list (the tool calls); else the last one is kept.
    `typed`: the reader keeps JSON's own types, so that a parameter the schema allows to be a string is
    left as written; else every string value is typed by the schema.
    """

    name: str
    closes: Finder
    opens: Finder | None = None
    read: Reader = stripped_text
    repeats: bool = False
    typed: bool = False


@dataclass(frozen=True)
class TurnLayout:
    """How one family's assistant turns are laid out: the marker the prompt's last assistant header ends
    with (`anchor`: what the prompt wrote after it is read as the turn's start) and the regions."""

    anchor: Finder
    regions: tuple[Region, ...]

    def __post_init__(self) -> None:
        if sum(region.opens is None for region in self.regions) > 1:
            raise ValueError("a turn layout has at most one region without an opening marker")


def read_regions(layout: TurnLayout, text: str, properties: dict[str, dict]) -> dict[str, Any]:
    """The message fields of `text` (the prompt's part after its last anchor, then the turn), typed by
    `properties` (each tool's parameters' schemas, by tool name). Raises `UnreadableTurn`."""
    implicit = next((region for region in layout.regions if region.opens is None), None)
    out: dict[str, Any] = {}
    cache: dict[
        tuple[str, str], Found | None
    ] = {}  # a marker's first match from a position stays valid later

    def first(kind: str, region: Region, position: int) -> Found | None:
        key = (kind, region.name)
        if key in cache and (cache[key] is None or cache[key].start >= position):
            return cache[key]
        finder = region.opens if kind == "open" else region.closes
        cache[key] = finder(text, position)
        return cache[key]

    current, body, opened, groups = implicit, [], False, {}

    def close() -> None:
        nonlocal current, body, opened, groups
        if current is not None and opened:
            value = current.read("".join(body), groups)
            if properties:
                value = _typed_call(value, properties, current.typed)
            if current.repeats:
                out.setdefault(current.name, []).append(value)
            else:
                out[current.name] = value
        current, body, opened, groups = implicit, [], False, {}

    position = 0
    while True:
        if current is not None and current is not implicit:
            watched = [("close", current)]
        else:
            watched = [("open", region) for region in layout.regions if region.opens is not None]
            if implicit is not None:
                watched.append(("close", implicit))
        best, best_key = None, None
        for kind, region in watched:
            found = first(kind, region, position)
            if found is None:
                continue
            key = (found.start, found.start - found.end, kind != "open", region.name)
            if best_key is None or key < best_key:
                best, best_key = (kind, region, found), key
        if best is None:  # the end of the turn closes what is open
            if position < len(text) and current is not None:
                body.append(text[position:])
                opened = True
            close()
            break
        kind, region, found = best
        if found.start > position and current is not None:
            body.append(text[position : found.start])
            opened = True
        position = found.end
        if kind == "open":
            close()
            current, body, opened, groups = region, [], True, dict(found.groups)
        else:
            had_text = opened
            groups.update(found.groups)
            close()
            if not had_text and found.start == found.end:
                break  # an empty closing marker of an empty region: nothing more to read
    return {name: value for name, value in out.items() if not _empty(value)}


def _empty(value: Any) -> bool:
    return value is None or (isinstance(value, (str, list, dict)) and not value)


def nesting_depth(text: str) -> int:
    """The deepest bracket nesting of `text`, brackets inside JSON strings not counted."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


_SENTINEL_OPEN, _SENTINEL_CLOSE = "\x01", "\x02"  # stand-ins for a quoted string while keys are quoted


def read_json(
    text: str,
    *,
    string_quotes: Sequence[tuple[str, str]] = (),
    bare_keys: bool = False,
    or_text: bool = False,
) -> Any:
    """`text` as JSON, in the dialects models write: strings between `string_quotes` (Gemma 4's `<|"|>`,
    LFM2's single quotes), keys without quotes (`bare_keys`). `or_text`: text that is not JSON is the
    stripped text itself; else it raises `UnreadableTurn`, as does nesting over `MAX_NESTING`."""
    if string_quotes and (_SENTINEL_OPEN in text or _SENTINEL_CLOSE in text):
        raise UnreadableTurn("the text holds the characters that stand in for its strings")
    strings: list[str] = []

    def stand_in(match: re.Match) -> str:
        strings.append(match.group(1))
        return f"{_SENTINEL_OPEN}{len(strings) - 1}{_SENTINEL_CLOSE}"

    source = text
    for opening, closing in string_quotes:
        source = re.sub(re.escape(opening) + "(.*?)" + re.escape(closing), stand_in, source, flags=re.DOTALL)
    if bare_keys:  # quote `key:` after `{` or `,`, leaving quoted strings as they are
        source = re.sub(
            r'"(?:\\.|[^"\\])*"|(?<=[{,])(\s*)(\w+)(\s*):',
            lambda m: m.group(0) if m.group(2) is None else f'{m.group(1)}"{m.group(2)}"{m.group(3)}:',
            source,
        )
    for index, string in enumerate(strings):
        source = source.replace(f"{_SENTINEL_OPEN}{index}{_SENTINEL_CLOSE}", json.dumps(string))
    if nesting_depth(source) > MAX_NESTING:
        raise UnreadableTurn(f"JSON nested more than {MAX_NESTING} levels deep")
    try:
        return json.loads(source)
    except (json.JSONDecodeError, RecursionError) as error:
        if or_text:
            return text.strip()
        raise UnreadableTurn(f"not valid JSON: {error}") from None


def read_tags(tag: str, value: Callable[[str], Any]) -> Callable[[str], dict[str, Any]]:
    """A reader of `key`/`value` pairs written as tags (`tag`: a regular expression with the named groups
    `key` and `value`), each value read by `value`; a key written twice keeps its last value."""
    compiled = re.compile(tag, re.DOTALL)

    def read(text: str) -> dict[str, Any]:
        return {m.group("key"): value(m.group("value") or "") for m in compiled.finditer(text)}

    return read


# Typing arguments by the tools' schemas ------------------------------------------------------------


def schema_types(schema: object) -> tuple[str, ...]:
    """The JSON types a parameter's schema allows: its `type` (one or a list), those of its `anyOf` /
    `oneOf` choices, and `null` where it is `nullable` (an `Optional` argument)."""
    if not isinstance(schema, dict):
        return ()
    declared = schema.get("type")
    types = [declared] if isinstance(declared, str) else [t for t in declared or [] if isinstance(t, str)]
    for union in ("anyOf", "oneOf"):
        for choice in schema.get(union) or []:
            types.extend(schema_types(choice))
    if schema.get("nullable") and "null" not in types:
        types.append("null")
    return tuple(types)


def _as_integer(raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        number = float(raw)  # a whole number written as a float ("3.0") is an integer too
        if not number.is_integer():
            raise
        return int(number)


def _as_number(raw: str) -> int | float:
    number = float(raw)
    if number != number or number in (float("inf"), float("-inf")):
        raise ValueError("not a JSON number")
    return int(number) if number.is_integer() and "." not in raw else number


def _as_boolean(raw: str) -> bool:
    word = raw.strip().lower()
    if word not in ("true", "1", "false", "0"):
        raise ValueError("not a boolean")
    return word in ("true", "1")


def _as_null(raw: str) -> None:
    if raw.strip() not in ("null", "None"):
        raise ValueError("not null")


def _as_json(kind: type) -> Callable[[str], Any]:
    def read(raw: str) -> Any:
        value = json.loads(raw)
        if not isinstance(value, kind):
            raise ValueError(f"not a JSON {kind.__name__}")
        return value

    return read


_TYPE_READERS: dict[str, Callable[[str], Any]] = {
    "integer": _as_integer,
    "number": _as_number,
    "boolean": _as_boolean,
    "null": _as_null,
    "object": _as_json(dict),
    "array": _as_json(list),
}


def typed_value(raw: str, types: tuple[str, ...]) -> Any:
    """`raw` as the first of `types` it reads as (`"6"` for an integer: 6); the text itself when none
    does (a string parameter, an unknown type)."""
    for kind in types:
        reader = _TYPE_READERS.get(kind)
        if reader is None:
            continue
        try:
            return reader(raw)
        except (ValueError, RecursionError):
            continue
    return raw


def _typed_call(value: Any, properties: dict[str, dict], typed: bool) -> Any:
    """A tool call's arguments typed by its tool's parameters (`properties`, by tool name); anything that
    is not a call of a known tool as it is."""
    function = value.get("function") if isinstance(value, dict) else None
    if not isinstance(function, dict):
        return value
    name, arguments = function.get("name"), function.get("arguments")
    if not isinstance(name, str) or not isinstance(arguments, dict) or not properties.get(name):
        return value
    for key, argument in arguments.items():
        types = schema_types(properties[name].get(key)) if key in properties[name] else ()
        if not types or (typed and "string" in types):
            continue
        if isinstance(argument, str):
            arguments[key] = typed_value(argument, types)
        elif isinstance(argument, list) and "array" not in types:
            arguments[key] = [
                typed_value(item, types) if isinstance(item, str) else item for item in argument
            ]
    return value


def parameters_by_tool(schemas: Sequence[dict]) -> dict[str, dict]:
    """Each tool's parameters' schemas (`properties`), by name, from its JSON schema."""
    found: dict[str, dict] = {}
    for schema in schemas:
        function = schema.get("function", schema) if isinstance(schema, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            parameters = function.get("parameters")
            properties = parameters.get("properties") if isinstance(parameters, dict) else None
            found[function["name"]] = properties if isinstance(properties, dict) else {}
    return found
