"""Tool calls from a completion's text to the results the model reads next, and the options that bound them.

The calls are in the Hermes format that Qwen2.5's chat template teaches (and `schemas.hermes_system_prompt`
teaches where a template has none): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per
call. Whatever goes wrong reaches the model as the call's result, `{"error": "..."}`, never the trainer as an
exception: malformed or too deeply nested JSON, an unknown tool, arguments that do not fit the tool's
schema, a tool that raises (any exception, `SystemExit` and `KeyboardInterrupt` raised by the tool
included), a tool that does not return within `ToolOptions.call_timeout`, a result that cannot be turned
into text. Async tools are awaited, all of one batch's together.

Each call runs in a thread of its own (`run_bounded`), the trainer's thread waiting for it at most
`call_timeout` seconds: a signal to the trainer (SIGTERM, Ctrl-C) is handled while it waits, and a tool that
never returns costs that many seconds, not the run. A thread cannot be stopped from outside in Python: a sync
tool past its bound is abandoned, still running in the background (a daemon thread: it does not keep the
process alive at exit). A tool that must be stopped for good belongs in a process (`sandbox.PythonSandbox`).
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Callable, Sequence
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

    call_timeout: Annotated[float, Alias("tool_call_timeout"), Range("> 0")] = 60.0
    """Seconds a tool call may take, sync or async, its result's conversion to text included: past them its
    result is `{"error": "<tool> did not return within N s"}` and the rollout goes on. A sync tool past it is
    left running in a background thread (Python cannot stop a thread); see the module's description. TRL and
    verl set no bound; 60 s leaves room for a real tool (a web search, a code runner) and keeps a hung one
    from holding a step for long."""

    environment_timeout: Annotated[float, Range("> 0")] = 300.0
    """Seconds an environment's `reset(**row)` or `get_reward()` may take (`environment_factory`). A
    `get_reward` past it is that sample's missing reward (None, as a reward function's no-opinion); a `reset`
    past it ends the run with one line naming the class, as a `reset` that raises does (TRL's behaviour: it
    cannot draw a sample from an environment that is not set up). Its methods the policy calls are tools,
    bounded by `call_timeout`."""

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
        except RecursionError:  # `[[[...]]]` thousands deep: the decoder's recursion bound
            calls.append(ToolCall(None, {}, "the tool call's JSON is nested too deeply to read"))
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            calls.append(ToolCall(None, {}, 'a tool call must be a JSON object with a string "name"'))
            continue
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except (json.JSONDecodeError, RecursionError) as error:
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
    cannot hold); characters UTF-8 cannot hold (a lone surrogate) become `?`, as the tokenizer needs UTF-8.
    Raises what the conversion raises (a self-referencing list, a dict with tuple keys, a `__str__` that
    raises): `ToolRunner` makes that the call's error."""
    text = result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, default=str)
    return text.encode("utf-8", errors="replace").decode("utf-8")


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


class CallTimeout(Exception):
    """A call that did not return within its bound (`run_bounded`)."""


class CallFailed(Exception):
    """A call that raised (`run_bounded`): `error` is what it raised, any `BaseException`, held here as an
    ordinary exception so that a `SystemExit` or `KeyboardInterrupt` from user code never leaves as one."""

    def __init__(self, error: BaseException, message: str | None = None) -> None:
        super().__init__(message or type(error).__name__)
        self.error = error


def run_bounded(function: Callable[[], object], seconds: float, name: str) -> object:
    """`function()`'s value, run in a daemon thread of its own, this thread waiting at most `seconds`.

    Raises `CallFailed` holding whatever it raised, or `CallTimeout` past `seconds` (the thread is abandoned,
    still running). The wait is interruptible: a signal handler of this thread runs while it waits, and what
    it raises (an interrupt) leaves from here as itself.
    """
    outcome: dict[str, object] = {}
    done = threading.Event()

    def target() -> None:
        try:
            outcome["value"] = function()
        except BaseException as error:  # user code's SystemExit too: the caller's result, not an exit
            outcome["error"], outcome["message"] = error, describe(error)  # str() runs here, bounded too
        finally:
            done.set()

    threading.Thread(target=target, name=f"grpo-call-{name}", daemon=True).start()
    if not done.wait(seconds):
        raise CallTimeout(f"{name} did not return within {seconds:g} s")
    if "error" in outcome:
        raise CallFailed(outcome["error"], outcome.get("message"))  # type: ignore[arg-type]
    return outcome["value"]


def describe(error: BaseException) -> str:
    """`error` as `Type: message`, or its type alone where it has no message or its `str()` fails."""
    try:
        message = str(error)
    except BaseException:  # an exception whose __str__ raises still has a name
        message = ""
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


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
        awaited together. `rows`: the rollout rows the calls come from (their own tools, `RowToolRunner`).
        Whatever a call does, its slot gets a text (see the module's description)."""
        results: list[list[tuple[str, str] | None]] = [[None] * len(calls) for calls in calls_per_row]
        pending = []  # (row, index, name, the call's coroutine function)
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
                elif is_async_tool(tools[name]):
                    pending.append((row, index, name, _bind(tools[name], call.arguments)))
                else:
                    results[row][index] = self._sync_call(name, _bind(tools[name], call.arguments))
        for (row, index, name, _), (ok, text) in zip(pending, self._async_calls(pending), strict=True):
            results[row][index] = (name, text) if ok else self._failed(name, text)
        return results  # type: ignore[return-value]  every slot is filled above

    def may_call(self, rounds: int) -> bool:
        """Whether a sample that has had `rounds` rounds of tool calls may have another
        (`ToolOptions.max_calling_iterations`)."""
        limit = self.options.max_calling_iterations
        return limit is None or rounds < limit

    def parse(self, text: str) -> list[ToolCall]:
        """The tool calls of a model turn's `text` (`parse_tool_calls`); a turn the parser cannot read is one
        failed call saying why, never an exception out of the rollout."""
        try:
            return parse_tool_calls(text)
        except Exception as error:  # the model wrote it: whatever it wrote is its call's result
            return [ToolCall(None, {}, f"the tool calls cannot be read: {describe(error)}")]

    def _text(self, name: str, value: object) -> str:
        """`value` as the cut text the model reads; an error naming `name` where it has no text."""
        try:
            return self._cut(result_text(value))
        except Exception as error:  # a self-referencing list, tuple keys, a __str__ that raises...
            raise _NoText(f"the result of {name} cannot be turned into text: {describe(error)}") from None

    def _sync_call(self, name: str, call: Callable[[], object]) -> tuple[str, str]:
        seconds = self.options.call_timeout
        try:
            return name, run_bounded(lambda: self._text(name, call()), seconds, name)  # type: ignore[return-value]
        except CallTimeout as error:
            return self._failed(name, str(error))
        except CallFailed as error:  # the model reads why its call failed; training goes on
            return self._failed(name, str(error.error) if isinstance(error.error, _NoText) else str(error))

    def _async_calls(self, pending: list) -> list[tuple[bool, str]]:
        """`(ok, text)` for each pending async call, awaited together in an event loop of their own thread
        (this thread may run a loop already, a notebook's), each bounded by `call_timeout`; past the bound
        and a second (a tool that blocks the loop), all of them are timeouts."""
        if not pending:
            return []
        seconds = self.options.call_timeout

        async def one(name: str, call: Callable[[], object]) -> tuple[bool, str]:
            try:
                value = await asyncio.wait_for(call(), seconds)  # type: ignore[arg-type]
            except TimeoutError:
                return False, f"{name} did not return within {seconds:g} s"
            except BaseException as error:  # the tool's SystemExit is its result too
                return False, describe(error)
            try:
                return True, self._text(name, value)
            except _NoText as error:
                return False, str(error)

        async def together() -> list[tuple[bool, str]]:
            return list(await asyncio.gather(*(one(name, call) for *_, name, call in pending)))

        try:
            return run_bounded(lambda: asyncio.run(together()), seconds + 1.0, "async tools")  # type: ignore[return-value]
        except CallTimeout:  # one of them blocks the loop: none of them can be told apart
            return [(False, f"{name} did not return within {seconds:g} s") for *_, name, _ in pending]
        except CallFailed as error:
            return [(False, f"{name}: {error}") for *_, name, _ in pending]

    def tools_of(self, row: int | None) -> tuple[dict[str, Tool], dict[str, dict]]:
        """The tools rollout row `row` calls, by name, and their schemas: the runner's, for every row."""
        return self.tools, self.schemas

    def _failed(self, name: str, message: str) -> tuple[str, str]:
        self.counts.failures += 1
        return name, self._cut(error_text(message))

    def _cut(self, text: str) -> str:
        return truncate_middle(text, self.options.max_response_length)


class _NoText(Exception):
    """A tool's result that `result_text` cannot turn into text: the message names the tool."""


def _bind(tool: Tool, arguments: dict) -> Callable[[], object]:
    return lambda: tool(**arguments)


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
