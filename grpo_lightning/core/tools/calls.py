"""Tool calls from a model turn to the results the model reads next, and the options that bound them.

A turn's calls are read by the chat template's tool-call format (`tools.formats`), inside `ToolRunner.parse`;
each result reaches the model as TRL 1.16 renders it: a list (content blocks) as it is, anything else as
`str(result)`, so a dict result reads `{'sum': 6}`. Whatever goes wrong reaches the model as the call's
result, TRL's `{'error': '<what was raised>'}`, never the trainer as an exception: a turn the format cannot
read in any way, an unknown tool (`Tool NAME not found.`), arguments the function cannot take (what Python
raises, as TRL: `multiply() missing 1 required positional argument: 'b'`), a tool that raises (any exception,
`SystemExit` and `KeyboardInterrupt` raised by the tool included), a tool that does not return within
`ToolOptions.call_timeout`, a result that cannot be turned into text. Async tools are awaited, all of one
batch's together.

Each call runs in a thread of its own (`run_bounded`; with `call_timeout: null`, `call_within` calls a sync
tool in the trainer's thread, TRL's way), the trainer's thread waiting for it at most `call_timeout` seconds:
a signal to the trainer (SIGTERM, Ctrl-C) is handled while it waits, and a tool that never returns costs that
many seconds, not the run. A thread cannot be stopped from outside in Python: a sync tool past its bound is
abandoned, still running in the background (a daemon thread: it does not keep the process alive at exit). A
tool that must be stopped for good belongs in a process (`sandbox.PythonSandbox`).
"""

from __future__ import annotations

import asyncio
import json
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated

from grpo_lightning.core.options import Alias, Range, check_fields
from grpo_lightning.core.tools.formats import ParsedTurn, ToolCallFormat, ToolCallFormatName
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

    call_timeout: Annotated[float | None, Alias("tool_call_timeout"), Range("> 0")] = 60.0
    """Seconds a tool call may take, sync or async, its result's conversion to text included: past them its
    result is `{"error": "<tool> did not return within N s"}` and the rollout goes on. A sync tool past it is
    left running in a background thread (Python cannot stop a thread); see the module's description. TRL and
    verl set no bound; 60 s leaves room for a real tool (a web search, a code runner) and keeps a hung one
    from holding a step for long. None: TRL's way, no bound and each sync tool called in the trainer's own
    thread, which a tool that sets a signal handler needs (TRL's `grpo_agent.py` bounds its SQL query with
    `SIGALRM`; Python takes signal handlers from the main thread only; under `max_staleness > 0` the rollout
    itself runs on a thread of its own, so such a tool also needs `max_staleness: 0`, which its warning says);
    what it raises beyond `Exception` (`SystemExit`, `KeyboardInterrupt`) then ends the run, as in TRL."""

    environment_timeout: Annotated[float | None, Range("> 0")] = 300.0
    """Seconds an environment's constructor, `reset(**row)` or `get_reward()` may take
    (`environment_factory`), each run in a thread of its own. A `get_reward` past it is that sample's missing
    reward (None, as a reward function's no-opinion); a constructor or `reset` past it ends the run with one
    line naming the class, as one that raises does (TRL's behaviour: it cannot draw a sample from an
    environment that is not set up). None: TRL's way, no bound and each of them called in the trainer's own
    thread, which an environment that sets a signal handler there needs (one bounding its work with
    `signal.alarm`; Python takes signal handlers from the main thread only, and under a bound such a call
    fails with one line naming this option; under `max_staleness > 0` the rollout itself runs on a thread of
    its own, so such an environment needs `max_staleness: 0`, which its line then names). Its methods the
    policy calls are tools, bounded by `call_timeout`."""

    max_response_length: Annotated[int | None, Alias("max_tool_response_length"), Range(">= 1")] = None
    """Characters of each text result the model reads: a longer one keeps its start and end, this many
    characters in all, with `TRUNCATION_MARK` between them (a list result, content blocks, is never cut).
    None: results are not cut, as TRL. verl: `actor_rollout_ref.rollout.multi_turn.max_tool_response_length`
    (256 there, with `tool_response_truncate_side: middle`), worth setting where a tool may return pages."""

    call_format: Annotated[ToolCallFormatName | None, Alias("tool_call_format")] = None
    """The tool-call format the model writes (`tools.formats.TOOL_CALL_FORMATS`: hermes, qwen3_coder,
    nemotron_3, glm4, llama3_json, gpt_oss, lfm2, gemma4). None: chosen from the chat template as TRL chooses
    its response schema (by which of TRL's template files it is, else by the markers it writes); Hermes where
    the template shows no tools (the system prompt teaches Hermes calls). TRL has no such option: a TRL user
    sets `tokenizer.response_schema`."""

    check_arguments: Annotated[bool, Alias("check_tool_arguments")] = False
    """Check each call's arguments against its tool's JSON schema before calling it: an argument the tool
    lacks, one missing, or a value of another JSON type is the call's error (`{'error': "multiply's argument
    a must be of type integer, got 'six'"}`) and the tool is not called. False: as TRL, the tool is called
    with the arguments as the format typed them (`"6"` for an integer is 6 already) and what Python raises
    on ones it cannot take is the error; a value of the wrong type reaches the tool."""

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
    """One call of a model turn: the tool's name and the arguments as the format read them (a dict for a
    call the tool can take), or why it cannot run."""

    name: str | None
    arguments: object
    error: str | None = None  # set: the call is not run and this is its result


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


def argument_error(arguments: object, schema: dict) -> str | None:
    """Why `arguments` do not fit a tool's JSON `schema`, or None: not a JSON object, an argument it lacks,
    one it requires that is missing, or a value of another JSON type (an integer passes for a number)."""
    function = schema["function"]
    if not isinstance(arguments, dict):
        return f"the arguments of {function['name']} must be a JSON object, got {arguments!r}"
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


Content = str | list  # a tool message's content: text, or a list of content blocks


def result_content(result: object) -> Content:
    """A tool's result as TRL 1.16 hands it to the chat template and the reward functions: a list (content
    blocks) as it is, anything else as `str(result)`; characters UTF-8 cannot hold (a lone surrogate) become
    `?`, as the tokenizer needs UTF-8. Raises what the conversion raises (a `__str__` that raises, a list
    that holds itself): `ToolRunner` makes that the call's error."""
    if isinstance(result, list):
        json.dumps(result, default=str)  # a list a transcript cannot hold (one holding itself) is refused
        return result
    return str(result).encode("utf-8", errors="replace").decode("utf-8")


ERROR_PREFIX = "{'error': "  # how every failed call's result begins (`error_text`), cut or not


def error_text(message: str) -> str:
    """A failed call's result as TRL writes it: `str({"error": message})`."""
    return str({"error": message})


def is_error(content: Content) -> bool:
    """Whether a tool message's content is a failed call's result (`error_text`)."""
    return isinstance(content, str) and content.startswith(ERROR_PREFIX)


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

    def __init__(self, error: BaseException, message: str | None = None, text: str | None = None) -> None:
        super().__init__(message or type(error).__name__)
        self.error = error
        self.text = text if text is not None else message_of(error)  # `str(error)`, as TRL reports it


def run_bounded(function: Callable[[], object], seconds: float | None, name: str) -> object:
    """`function()`'s value, run in a daemon thread of its own, this thread waiting at most `seconds` (None:
    for as long as it takes).

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
            outcome["text"] = message_of(error)
        finally:
            done.set()

    threading.Thread(target=target, name=f"grpo-call-{name}", daemon=True).start()
    if not done.wait(seconds):
        raise CallTimeout(f"{name} did not return within {seconds:g} s")
    if "error" in outcome:
        raise CallFailed(outcome["error"], outcome["message"], outcome["text"])  # type: ignore[arg-type]
    return outcome["value"]


def call_within(function: Callable[[], object], seconds: float | None, name: str) -> object:
    """`function()`'s value: under a bound, run in a thread of its own (`run_bounded`); with `seconds` None,
    TRL's way, called in this thread with no bound, so that it may set signal handlers (what it raises
    beyond `Exception`, `SystemExit` or `KeyboardInterrupt`, then leaves as itself).

    Raises `CallFailed` holding the exception it raised, or `CallTimeout` past `seconds`.
    """
    if seconds is not None:
        return run_bounded(function, seconds, name)
    try:
        return function()
    except Exception as error:
        raise CallFailed(error, describe(error)) from None


ROLLOUT_THREAD = "grpo-rollout"
"""The name (prefix) of the thread that rolls out the batches sampled ahead (`async_rollouts.max_staleness` >
0), where every tool call and environment method of a multi-turn rollout runs."""


def on_rollout_thread() -> bool:
    """Whether this is the thread of rollouts sampled ahead (`ROLLOUT_THREAD`)."""
    return threading.current_thread().name.startswith(ROLLOUT_THREAD)


def sets_signal_handler(error: CallFailed, seconds: float | None) -> bool:
    """Whether `error` is Python's refusal of a signal handler outside the main thread (`signal only works
    in main thread ...`), met by a call run under a bound (`seconds`, in a thread of its own) or, with no
    bound, on the rollout thread of rollouts sampled ahead."""
    off_main_thread = seconds is not None or on_rollout_thread()
    return off_main_thread and isinstance(error.error, ValueError) and "main thread" in error.text


def signal_handler_advice(option: str, alias: str | None = None) -> str:
    """What to set where user code failed by setting a signal handler in the thread `option` runs it in,
    or, called on the rollout thread of rollouts sampled ahead, in that thread."""
    shown = f"{option}: null ({alias}, " if alias else f"{option}: null ("
    if on_rollout_thread():
        return (
            "it sets a signal handler, which only the trainer's main thread may, and under "
            "async_rollouts.max_staleness > 0 the multi-turn rollout runs on a thread of its own; set "
            f"async_rollouts.max_staleness: 0 and {shown}TRL's way: no bound, the trainer's thread)"
        )
    return (
        f"it sets a signal handler, which only the trainer's main thread may, and {option} runs it in a "
        f"thread of its own; set {shown}TRL's way: no bound, the trainer's thread)"
    )


_WARNED_SIGNAL_TOOLS: set[str] = set()


def warn_signal_tool(name: str, text: str) -> None:
    """Once per tool: a call failed because the tool sets a signal handler, which only the main thread may,
    and `call_timeout` (or the rollout thread of rollouts sampled ahead) runs it in a thread of its own."""
    if name in _WARNED_SIGNAL_TOOLS:
        return
    _WARNED_SIGNAL_TOOLS.add(name)
    advice = signal_handler_advice("tools.call_timeout", "tool_call_timeout")
    warnings.warn(f"tool {name} failed with {text!r}: {advice}", stacklevel=2)


def message_of(error: BaseException) -> str:
    """`str(error)`, as TRL writes a failed call's error; its type's name where its `str()` fails."""
    try:
        return str(error)
    except BaseException:  # an exception whose __str__ raises still has a name
        return type(error).__name__


def describe(error: BaseException) -> str:
    """`error` as `Type: message`, or its type alone where it has no message or its `str()` fails."""
    try:
        message = str(error)
    except BaseException:  # an exception whose __str__ raises still has a name
        message = ""
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


class ToolRunner:
    """Runs the tool calls of a batch of completions: `tools` by name, their schemas checked once here.

    Each result is TRL's content (`result_content`), a text one cut to `options.max_response_length` where
    set (`truncate_middle`); a call that cannot run or raises gives TRL's `{'error': ...}`, and `counts` adds
    up calls and failures.
    """

    def __init__(self, tools: Sequence[Tool], options: ToolOptions | None = None) -> None:
        self.tools = tools_by_name(tools)
        self.schemas = {name: tool_schema(tool) for name, tool in self.tools.items()}
        self.options = options or ToolOptions()
        self.counts = ToolCallCounts()

    def __call__(
        self, calls_per_row: Sequence[Sequence[ToolCall]], rows: Sequence[int] | None = None
    ) -> list[list[tuple[str, Content]]]:
        """Each row's `(tool name, result content)` per call, in the calls' order; the async tools of every
        row awaited together. `rows`: the rollout rows the calls come from (their own tools,
        `RowToolRunner`). Whatever a call does, its slot gets a content (see the module's description)."""
        results: list[list[tuple[str, Content] | None]] = [[None] * len(calls) for calls in calls_per_row]
        pending = []  # (row, index, name, the call's coroutine function)
        for row, calls in enumerate(calls_per_row):
            tools, schemas = self.tools_of(None if rows is None else rows[row])
            for index, call in enumerate(calls):
                self.counts.calls += 1
                name = call.name or "unknown"
                problem = call.error
                if problem is None and call.name not in tools:
                    problem = f"Tool {call.name} not found."  # TRL's words
                if problem is None and self.options.check_arguments:
                    problem = argument_error(call.arguments, schemas[call.name])
                if problem is not None:
                    results[row][index] = self._failed(name, problem)
                elif is_async_tool(tools[name]):
                    pending.append((row, index, name, _bind(tools[name], call.arguments)))
                else:
                    results[row][index] = self._sync_call(name, _bind(tools[name], call.arguments))
        for (row, index, name, _), (ok, content) in zip(pending, self._async_calls(pending), strict=True):
            results[row][index] = (name, content) if ok else self._failed(name, content)
        return results  # type: ignore[return-value]  every slot is filled above

    def may_call(self, rounds: int) -> bool:
        """Whether a sample that has had `rounds` rounds of tool calls may have another
        (`ToolOptions.max_calling_iterations`)."""
        limit = self.options.max_calling_iterations
        return limit is None or rounds < limit

    def parse(
        self, call_format: ToolCallFormat, text: str, *, plain_text: str, **context: object
    ) -> ParsedTurn:
        """A model turn's `text` read by `call_format` (`ToolCallFormat.parse`, with `context`: the prompt,
        the schemas, the end-of-sequence token); a turn the format fails on in any way is TRL's plain turn
        (`plain_text` as its content, no call), never an exception out of the rollout."""
        try:
            return call_format.parse(text, plain_text=plain_text, **context)  # type: ignore[arg-type]
        except Exception:  # the model wrote it: an unreadable turn calls nothing and ends the sample
            return ParsedTurn({"role": "assistant", "content": plain_text}, False)

    def _content(self, name: str, value: object) -> Content:
        """`value` as the (cut) content the model reads; an error naming `name` where it has none."""
        try:
            return self._cut(result_content(value))
        except Exception as error:  # a __str__ that raises...
            raise _NoText(f"the result of {name} cannot be turned into text: {describe(error)}") from None

    def _sync_call(self, name: str, call: Callable[[], object]) -> tuple[str, Content]:
        seconds = self.options.call_timeout
        try:
            return name, call_within(lambda: self._content(name, call()), seconds, name)  # type: ignore[return-value]
        except CallTimeout as error:
            return self._failed(name, str(error))
        except CallFailed as error:  # the model reads why its call failed; training goes on
            if sets_signal_handler(error, seconds):
                warn_signal_tool(name, error.text)
            return self._failed(name, error.text)

    def _async_calls(self, pending: list) -> list[tuple[bool, Content]]:
        """`(ok, content)` for each pending async call, awaited together in an event loop of their own thread
        (this thread may run a loop already, a notebook's), each bounded by `call_timeout`; past the bound
        and a second (a tool that blocks the loop), all of them are timeouts."""
        if not pending:
            return []
        seconds = self.options.call_timeout

        async def one(name: str, call: Callable[[], object]) -> tuple[bool, Content]:
            try:
                value = await asyncio.wait_for(call(), seconds)  # type: ignore[arg-type]
            except TimeoutError:
                return False, f"{name} did not return within {seconds:g} s"
            except BaseException as error:  # the tool's SystemExit is its result too
                return False, message_of(error)
            try:
                return True, self._content(name, value)
            except _NoText as error:
                return False, str(error)

        async def together() -> list[tuple[bool, Content]]:
            return list(await asyncio.gather(*(one(name, call) for *_, name, call in pending)))

        bound = None if seconds is None else seconds + 1.0
        try:
            return run_bounded(lambda: asyncio.run(together()), bound, "async tools")  # type: ignore[return-value]
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

    def _cut(self, content: Content) -> Content:
        limit = self.options.max_response_length
        return content if limit is None or isinstance(content, list) else truncate_middle(content, limit)


class _NoText(Exception):
    """A tool's result that `result_content` cannot turn into text: the message names the tool."""


def _bind(tool: Tool, arguments: object) -> Callable[[], object]:
    """The call, as TRL makes it: arguments that are not a mapping raise Python's `TypeError` before the tool
    runs (`multiply() argument after ** must be a mapping, not str`), which is the call's error."""
    return lambda: tool(**arguments)  # type: ignore[arg-type]


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
