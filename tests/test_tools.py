"""Tools from functions to results: schemas as TRL renders them, Hermes calls parsed from text, every kind of
failure returned to the model as `{"error": ...}`, async tools awaited, results cut in the middle, the
call and failure counts, and `ToolOptions` (`GRPOConfig.tools`) checked."""

import asyncio
import json

import pytest

from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.tools.calculator import calculator
from grpo_lightning.core.tools.calls import (
    TRUNCATION_MARK,
    RowToolRunner,
    ToolCall,
    ToolCallCounts,
    ToolOptions,
    ToolRunner,
    assistant_message,
    error_text,
    parse_tool_calls,
    truncate_middle,
)
from grpo_lightning.core.tools.rewards import answered_tool_calls, tool_call_reward
from grpo_lightning.core.tools.schemas import (
    hermes_system_prompt,
    template_renders_tools,
    tool_schema,
    tools_by_name,
    with_tools_in_system_prompt,
)
from grpo_lightning.offline.tiny import CHATML_TEMPLATE


def multiply(a: int, b: float) -> float:
    """Multiply two numbers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


async def lookup(key: str) -> dict:
    """Look a key up.

    Args:
        key: what to look up
    """
    await asyncio.sleep(0)
    if key == "missing":
        raise KeyError(key)
    return {"key": key, "value": len(key)}


def broken(x: int) -> int:
    """Always fails.

    Args:
        x: anything
    """
    raise RuntimeError("disk on fire")


def test_schema_is_the_one_the_chat_template_takes():
    schema = tool_schema(multiply)
    assert schema == {
        "type": "function",
        "function": {
            "name": "multiply",
            "description": "Multiply two numbers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "the first factor"},
                    "b": {"type": "number", "description": "the second factor"},
                },
                "required": ["a", "b"],
            },
            "return": {"type": "number"},  # as TRL renders a typed tool
        },
    }
    assert tool_schema(lookup)["function"]["name"] == "lookup"  # async functions too


def test_a_function_without_hints_or_docstring_is_refused_naming_it():
    def no_doc(a: int) -> int:
        return a

    def no_hints(a):
        """Does something.

        Args:
            a: a thing
        """

    for function in (no_doc, no_hints):
        with pytest.raises(ValueError, match=rf"^tool '{function.__name__}' has no JSON schema") as caught:
            tool_schema(function)
        assert "\n" not in str(caught.value)
    with pytest.raises(ValueError, match="two tools are named 'multiply'"):
        tools_by_name([multiply, multiply])


def test_hermes_prompt_where_the_template_shows_no_tools():
    class Template:  # a tokenizer's chat template alone
        def __init__(self, template):
            from tokenizers import Tokenizer, models
            from transformers import PreTrainedTokenizerFast

            self.tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"x": 0}, "x")))
            self.tok.chat_template = template

    schemas = [tool_schema(multiply)]
    plain = Template(CHATML_TEMPLATE).tok
    assert not template_renders_tools(plain, schemas)
    showing = CHATML_TEMPLATE.replace("{% for", "{{ tools | tojson }}{% for", 1)
    assert not template_renders_tools(Template(showing).tok, schemas)  # the calls are dropped: TRL refuses it
    calls = "{{ message['tool_calls'] | tojson if message['tool_calls'] is defined else '' }}"
    whole = showing.replace("{{ message['content'] }}", "{{ message['content'] }}" + calls)
    assert template_renders_tools(Template(whole).tok, schemas)
    text = hermes_system_prompt(schemas)
    assert json.dumps(schemas[0]) in text and "<tool_call>" in text
    messages = [{"role": "user", "content": "hi"}]
    added = with_tools_in_system_prompt(messages, schemas)
    assert added[0] == {"role": "system", "content": text} and added[1:] == messages
    kept = with_tools_in_system_prompt([{"role": "system", "content": "Be brief."}, *messages], schemas)
    assert kept[0]["content"] == "Be brief.\n\n" + text and len(kept) == 2


def test_parses_hermes_calls_and_names_what_is_malformed():
    text = (
        'I will compute. <tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
        '<tool_call>{"name": "lookup", "arguments": "{\\"key\\": \\"k\\"}"}</tool_call>'
        "<tool_call>{not json}</tool_call>"
        '<tool_call>["a list"]</tool_call>'
        '<tool_call>{"name": "multiply", "arguments": 7}</tool_call>'
        '<tool_call>{"name": "multiply", "arguments": {}'
    )
    calls = parse_tool_calls(text)
    assert calls[0] == ToolCall("multiply", {"a": 3, "b": 4})
    assert calls[1] == ToolCall("lookup", {"key": "k"})  # arguments as a JSON string
    assert calls[2].error.startswith("the tool call is not valid JSON")
    assert 'string "name"' in calls[3].error
    assert calls[4].name == "multiply" and "must be a JSON object" in calls[4].error
    assert "not closed" in calls[5].error
    assert len(calls) == 6
    assert parse_tool_calls("The answer is 12.") == []


def test_every_failure_reaches_the_model_as_an_error_result():
    runner = ToolRunner([multiply, lookup, broken])
    rows = [
        parse_tool_calls(
            '<tool_call>{"name": "multiply", "arguments": {"a": 3, "b": 4.5}}</tool_call>'
            '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "multiply", "arguments": {"a": 3}}</tool_call>'
            '<tool_call>{"name": "multiply", "arguments": {"a": 3, "b": 1, "c": 2}}</tool_call>'
            '<tool_call>{"name": "multiply", "arguments": {"a": "3", "b": 1}}</tool_call>'
            '<tool_call>{"name": "multiply", "arguments": {"a": true, "b": 1}}</tool_call>'
        ),
        parse_tool_calls(
            '<tool_call>{"name": "lookup", "arguments": {"key": "abc"}}</tool_call>'
            '<tool_call>{"name": "lookup", "arguments": {"key": "missing"}}</tool_call>'
            '<tool_call>{"name": "broken", "arguments": {"x": 1}}</tool_call>'
            "<tool_call>{bad</tool_call>"
        ),
        [],
    ]
    results = runner(rows)
    assert results[0][0] == ("multiply", "13.5")
    errors = [json.loads(text)["error"] for _, text in results[0][1:]]
    assert "no tool is named 'nope'" in errors[0]
    assert "needs the argument b" in errors[1]
    assert "takes no argument c" in errors[2]
    assert "must be of type integer, got '3'" in errors[3]
    assert "must be of type integer, got True" in errors[4]
    assert results[1][0] == ("lookup", '{"key": "abc", "value": 3}')  # awaited, as JSON
    assert json.loads(results[1][1][1]) == {"error": "KeyError: 'missing'"}
    assert json.loads(results[1][2][1]) == {"error": "RuntimeError: disk on fire"}
    assert results[1][3][0] == "unknown" and "not valid JSON" in json.loads(results[1][3][1])["error"]
    assert results[2] == []
    assert (runner.counts.calls, runner.counts.failures) == (10, 8)
    assert runner.counts.metrics(rows=5) == {"tools/call_frequency": 2.0, "tools/failure_frequency": 0.8}
    assert ToolCallCounts().metrics(rows=4) == {"tools/call_frequency": 0.0, "tools/failure_frequency": 0.0}


class Counter:
    """An environment: each instance's own state, its methods its tools."""

    def __init__(self) -> None:
        self.total = 0

    def add(self, n: int) -> int:
        """Add to this counter.

        Args:
            n: how much
        """
        self.total += n
        return self.total


def test_each_row_calls_its_own_instances_tools():
    envs = [Counter(), Counter()]
    runner = RowToolRunner([[multiply, env.add] for env in envs])
    assert set(runner.schemas) == {"multiply", "add"}
    call = parse_tool_calls('<tool_call>{"name": "add", "arguments": {"n": 5}}</tool_call>')
    assert runner([call, call], rows=[1, 1]) == [[("add", "5")], [("add", "10")]]
    assert (envs[0].total, envs[1].total) == (0, 10)
    assert runner.counts.calls == 2
    with pytest.raises(ValueError, match="rows="):
        runner([call])


def test_a_turn_becomes_trls_assistant_message():
    text = (
        'Let me add. <tool_call>{"name": "add", "arguments": {"n": 2}}</tool_call><tool_call>{bad</tool_call>'
    )
    assert assistant_message(text) == {
        "role": "assistant",
        "content": "Let me add.",
        "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"n": 2}}}],
    }
    assert assistant_message("It is 4.") == {"role": "assistant", "content": "It is 4."}


def test_async_tools_run_inside_a_running_event_loop_too():
    runner = ToolRunner([lookup])
    calls = [parse_tool_calls('<tool_call>{"name": "lookup", "arguments": {"key": "ab"}}</tool_call>')]

    async def inside_a_loop():
        return runner(calls)

    assert asyncio.run(inside_a_loop()) == [[("lookup", '{"key": "ab", "value": 2}')]]


def test_results_are_cut_in_the_middle():
    text = "".join(str(i % 10) for i in range(1000))
    cut = truncate_middle(text, 256)
    assert cut == text[:128] + TRUNCATION_MARK + text[-128:]
    assert truncate_middle(text, 5) == text[:3] + TRUNCATION_MARK + text[-2:]
    assert truncate_middle("short", 256) == "short"

    def long_text(n: int) -> str:
        """A long result.

        Args:
            n: its length
        """
        return "x" * n

    runner = ToolRunner([long_text], ToolOptions(max_response_length=10))
    [[(_, result)]] = runner([[ToolCall("long_text", {"n": 100})]])
    assert result == "xxxxx" + TRUNCATION_MARK + "xxxxx"


def test_tool_options_are_a_section_of_grpo_config_checked_by_either_name():
    assert ToolOptions() == ToolOptions(max_calling_iterations=None, max_response_length=256)
    assert GRPOConfig().tools == ToolOptions()
    config = GRPOConfig(max_tool_calling_iterations=3, max_tool_response_length=64)  # TRL's and verl's names
    assert config.tools == ToolOptions(max_calling_iterations=3, max_response_length=64)
    assert (config.max_tool_calling_iterations, config.max_tool_response_length) == (3, 64)
    rule = r"GRPOConfig.tools.max_response_length=0 \(max_tool_response_length\): must be >= 1$"
    with pytest.raises(ValueError, match="^" + rule):
        ToolOptions(max_response_length=0)
    with pytest.raises(ValueError, match="^" + rule):
        GRPOConfig(max_tool_response_length=0)
    with pytest.raises(
        ValueError, match=r"^GRPOConfig.tools.max_calling_iterations=0 .*: must be >= 1 or None"
    ):
        GRPOConfig(tools={"max_calling_iterations": 0})
    with pytest.raises(ValueError, match="must be an integer"):
        ToolOptions(max_calling_iterations=2.5)


def test_the_shaping_reward_counts_a_completion_with_a_call_answered_without_an_error():
    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {}}]}
    answered = [call, {"role": "tool", "name": "calculator", "content": "42"}, {"role": "assistant"}]
    failed = [call, {"role": "tool", "name": "calculator", "content": error_text("division by zero")}]
    twice = answered[:2] + answered[:2] + answered[2:]
    plain = [{"role": "assistant", "content": "6*7 is 42. #### 42"}]
    completions = [answered, failed, twice, plain, "#### 42"]
    assert tool_call_reward(completions) == [1.0, 0.0, 1.0, 0.0, 0.0]  # once per completion, however many
    assert [answered_tool_calls(c) for c in completions] == [1, 0, 2, 0, 0]
    cut = ToolRunner([calculator], ToolOptions(max_response_length=20))  # a cut error is still an error
    [[(_, result)]] = cut([[ToolCall("calculator", {"expression": "9**9**9"})]])
    assert TRUNCATION_MARK in result and answered_tool_calls([{"role": "tool", "content": result}]) == 0
