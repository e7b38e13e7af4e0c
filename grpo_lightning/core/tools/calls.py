"""Tool calls from a completion's text to the results the model reads next, and the options that bound them.

The calls are in the Hermes format that Qwen2.5's chat template teaches (and `schemas.hermes_system_prompt`
teaches where a template has none): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per
call. Whatever goes wrong reaches the model as the call's result, `{"error": "..."}`, never the trainer as an
exception: malformed JSON, an unknown tool, arguments that do not fit the tool's schema, a tool that raises.
Async tools are awaited, all of one batch's together.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Annotated

from grpo_lightning.core.options import Alias, Range, check_fields
from grpo_lightning.core.tools.schemas import Tool, is_async_tool, tool_schema, tools_by_name


@dataclass(frozen=True, kw_only=True)
class ToolOptions:
    """How far a multi-turn rollout with tools may go, and how much of each result the model reads
    (`GRPOConfig.tools`). Read with `tools` or `environment_factory` only: a `rollout_func` samples its own
    turns."""

    max_calling_iterations: Annotated[int | None, Alias("max_tool_calling_iterations"), Range(">= 1")] = None
    """Tool turns per sample at most: after this many rounds of calls the sample ends with the model's last
    turn. None: no limit (the sample ends with a turn that calls nothing, or at `max_completion_length`).
    TRL: `GRPOConfig.max_tool_calling_iterations` (None there too); verl: `max_assistant_turns`.
    Read by `ToolRunner.may_call`."""

    max_response_length: Annotated[int, Alias("max_tool_response_length"), Range(">= 1")] = 256
    """Characters of each tool result the model reads: a longer one keeps its start and end, this many
    characters in all, with `TRUNCATION_MARK` between them. verl:
    `actor_rollout_ref.rollout.multi_turn.max_tool_response_length` (256, with `tool_response_truncate_side:
    middle`); TRL does not cut results."""

    def __post_init__(self) -> None:
        check_fields(self)


TRUNCATION_MARK = "...(truncated)..."


def truncate_middle(text: str, limit: int) -> str:
    """`text` if it has at most `limit` characters, else its first and last `limit // 2`-ish characters (the
    start gets the odd one) joined by `TRUNCATION_MARK`."""
    if len(text) <= limit:
        return text
    head = (limit + 1) // 2
    tail = limit - head
    return text[:head] + TRUNCATION_MARK + (text[-tail:] if tail else "")


@dataclass(frozen=True)
class ToolCall:
    """One `<tool_call>` block of a completion: the tool's name and arguments, or why it cannot run."""

    name: str | None
    arguments: dict
    error: str | None = None  # set: the call is not run and this is its result


_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The calls in `text`, in order: each `<tool_call>` block's JSON object `{"name": str, "arguments":
    object}` (arguments may also be a string holding that object); a block that is not such JSON, or that
    is never closed, is a call carrying its error."""
    calls = []
    for match in _CALL.finditer(text):
        body = match.group(1).strip()
        if not match.group(0).endswith("</tool_call>"):
            calls.append(ToolCall(None, {}, "the <tool_call> block is not closed by </tool_call>"))
            continue
        try:
            call = json.loads(body)
        except json.JSONDecodeError as error:
            calls.append(ToolCall(None, {}, f"the tool call is not valid JSON: {error}"))
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            calls.append(ToolCall(None, {}, 'a tool call must be a JSON object with a string "name"'))
            continue
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as error:
                arguments = error
        if not isinstance(arguments, dict):
            message = f'the "arguments" of {call["name"]!r} must be a JSON object'
            calls.append(ToolCall(call["name"], {}, message))
            continue
        calls.append(ToolCall(call["name"], arguments))
    return calls


def assistant_message(text: str) -> dict:
    """A model turn's text as the assistant message TRL hands reward functions: its text without the
    `<tool_call>` blocks as `content`, and the well-formed calls as `tool_calls` (when it made any)."""
    message = {"role": "assistant", "content": _CALL.sub("", text).strip()}
    calls = [call for call in parse_tool_calls(text) if call.error is None]
    if calls:
        message["tool_calls"] = [
            {"type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            for call in calls
        ]
    return message


_JSON_TYPES = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


def _type_matches(value: object, spec: dict) -> bool:
    kinds = spec.get("type")
    if kinds is None:
        return True
    for kind in kinds if isinstance(kinds, list) else [kinds]:
        allowed = _JSON_TYPES.get(kind, (object,))
        if isinstance(value, bool) and bool not in allowed:  # JSON's true is not an integer
            continue
        if isinstance(value, allowed):
            return True
    return False


def argument_error(arguments: dict, schema: dict) -> str | None:
    """Why `arguments` do not fit a tool's JSON `schema`, or None: an argument it lacks, one it requires that
    is missing, or a value of another JSON type (an integer passes for a number)."""
    function = schema["function"]
    parameters = function.get("parameters", {})
    properties = parameters.get("properties", {})
    unknown = sorted(set(arguments) - set(properties))
    if unknown:
        takes = ", ".join(properties)
        return f"{function['name']} takes no argument {', '.join(unknown)} (it takes: {takes})"
    missing = [name for name in parameters.get("required", []) if name not in arguments]
    if missing:
        return f"{function['name']} needs the argument {', '.join(missing)}"
    for name, value in arguments.items():
        spec = properties[name]
        if not _type_matches(value, spec):
            return f"{function['name']}'s argument {name} must be of type {spec['type']}, got {value!r}"
    return None


def result_text(result: object) -> str:
    """A tool's result as the model reads it: a string as it is, anything else as JSON (`str` of what JSON
    cannot hold)."""
    if isinstance(result, str):
        return result
    return json.dumps(result, ensure_ascii=False, default=str)


ERROR_PREFIX = '{"error": '  # how every failed call's result begins (`error_text`), cut or not


def error_text(message: str) -> str:
    """A failed call's result: `{"error": message}` as JSON."""
    return result_text({"error": message})


@dataclass
class ToolCallCounts:
    """Calls made and failed, over the rows of a rollout: TRL's `tools/call_frequency` (calls per row) and
    `tools/failure_frequency` (failed calls per call, 0 without calls)."""

    calls: int = 0
    failures: int = 0

    def metrics(self, rows: int) -> dict[str, float]:
        return {
            "tools/call_frequency": self.calls / max(rows, 1),
            "tools/failure_frequency": self.failures / self.calls if self.calls else 0.0,
        }


def _run_coroutines(coroutines: list) -> list:
    """The coroutines' results (or the exceptions they raised), awaited together; from a thread of its own
    when this one already runs an event loop (a notebook's)."""

    async def gathered() -> list:
        return await asyncio.gather(*coroutines, return_exceptions=True)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(gathered())
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, gathered()).result()


class ToolRunner:
    """Runs the tool calls of a batch of completions: `tools` by name, their schemas checked once here.

    Each result is a string (`result_text`) cut to `options.max_response_length` (`truncate_middle`);
    a call that cannot run or raises gives `{"error": ...}`, and `counts` adds up calls and failures.
    """

    def __init__(self, tools: Sequence[Tool], options: ToolOptions | None = None) -> None:
        self.tools = tools_by_name(tools)
        self.schemas = {name: tool_schema(tool) for name, tool in self.tools.items()}
        self.options = options or ToolOptions()
        self.counts = ToolCallCounts()

    def __call__(
        self, calls_per_row: Sequence[Sequence[ToolCall]], rows: Sequence[int] | None = None
    ) -> list[list[tuple[str, str]]]:
        """Each row's `(tool name, result text)` per call, in the calls' order; the async tools of every row
        awaited together. `rows`: the rollout rows the calls come from (their own tools, `RowToolRunner`)."""
        results: list[list[tuple[str, str] | None]] = [[None] * len(calls) for calls in calls_per_row]
        pending = []  # (row, index, name, coroutine)
        for row, calls in enumerate(calls_per_row):
            tools, schemas = self.tools_of(None if rows is None else rows[row])
            for index, call in enumerate(calls):
                self.counts.calls += 1
                name = call.name or "unknown"
                problem = call.error
                if problem is None and call.name not in tools:
                    problem = f"no tool is named {call.name!r} (tools: {', '.join(tools)})"
                if problem is None:
                    problem = argument_error(call.arguments, schemas[call.name])
                if problem is not None:
                    results[row][index] = self._failed(name, problem)
                    continue
                try:
                    outcome = tools[name](**call.arguments)
                except Exception as error:  # the model's call failed: it reads why, the trainer goes on
                    results[row][index] = self._failed(name, _describe(error))
                    continue
                if is_async_tool(tools[name]):
                    pending.append((row, index, name, outcome))
                else:
                    results[row][index] = (name, self._cut(result_text(outcome)))
        outcomes = _run_coroutines([coroutine for *_, coroutine in pending]) if pending else []
        for (row, index, name, _), outcome in zip(pending, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                results[row][index] = self._failed(name, _describe(outcome))
            else:
                results[row][index] = (name, self._cut(result_text(outcome)))
        return results  # type: ignore[return-value]  every slot is filled above

    def may_call(self, rounds: int) -> bool:
        """Whether a sample that has had `rounds` rounds of tool calls may have another
        (`ToolOptions.max_calling_iterations`)."""
        limit = self.options.max_calling_iterations
        return limit is None or rounds < limit

    def tools_of(self, row: int | None) -> tuple[dict[str, Tool], dict[str, dict]]:
        """The tools rollout row `row` calls, by name, and their schemas: the runner's, for every row."""
        return self.tools, self.schemas

    def _failed(self, name: str, message: str) -> tuple[str, str]:
        self.counts.failures += 1
        return name, self._cut(error_text(message))

    def _cut(self, text: str) -> str:
        return truncate_middle(text, self.options.max_response_length)


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


class RowToolRunner(ToolRunner):
    """A `ToolRunner` whose rollout rows call tools of their own: row i calls `row_tools[i]` (TRL's
    `environment_factory`: the shared tools and the methods of that sample's environment). `tools` and
    `schemas` hold every row's, for what the chat template is shown once."""

    def __init__(self, row_tools: Sequence[Sequence[Tool]], options: ToolOptions | None = None) -> None:
        self.row_tools = [tools_by_name(tools) for tools in row_tools]
        # A schema is the function's, whichever instance a method is bound to: read once per function.
        by_function: dict[object, dict] = {}

        def schema(tool: Tool) -> dict:
            function = getattr(tool, "__func__", tool)
            if function not in by_function:
                by_function[function] = tool_schema(tool)
            return by_function[function]

        self.row_schemas = [{name: schema(tool) for name, tool in tools.items()} for tools in self.row_tools]
        self.tools = {name: tool for tools in self.row_tools for name, tool in tools.items()}
        self.schemas = {name: found for schemas in self.row_schemas for name, found in schemas.items()}
        self.options = options or ToolOptions()
        self.counts = ToolCallCounts()

    def tools_of(self, row: int | None) -> tuple[dict[str, Tool], dict[str, dict]]:
        if row is None:
            raise ValueError("a RowToolRunner runs the calls of known rows: pass rows=")
        return self.row_tools[row], self.row_schemas[row]
