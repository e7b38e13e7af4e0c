"""Tools from functions to results: schemas as TRL renders them, a turn read in the guarded unit, every kind
of failure returned to the model as TRL's `{'error': ...}`, results as TRL renders them (`str` of a dict, a
list as it is), async tools awaited, results cut in the middle only where asked, the call and failure
counts, and `ToolOptions` (`GRPOConfig.tools`) checked."""

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
    error_text,
    truncate_middle,
)
from grpo_lightning.core.tools.formats import TOOL_CALL_FORMATS
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


HERMES = TOOL_CALL_FORMATS["hermes"]


def parse_tool_calls(text: str, tools=(multiply, lookup, broken)) -> list[ToolCall]:
    """The calls of a Hermes turn, read as a rollout reads them (`ToolRunner.parse`)."""
    parsed = ToolRunner(list(tools)).parse(
        HERMES, text, plain_text=text, schemas=[tool_schema(t) for t in tools]
    )
    return [ToolCall(call.name, call.arguments) for call in parsed.calls]


def test_a_turn_is_read_in_the_guarded_unit_as_trl_reads_it():
    text = (
        'I will compute. <tool_call>\n{"name": "multiply", "arguments": {"a": "3", "b": 4}}\n</tool_call>'
        '<tool_call>{"name": "lookup", "arguments": {"key": "k"}}</tool_call>'
    )
    assert parse_tool_calls(text) == [
        ToolCall("multiply", {"a": 3, "b": 4}),
        ToolCall("lookup", {"key": "k"}),
    ]
    assert parse_tool_calls("The answer is 12.") == []
    broken_json = '<tool_call>{"name": "multiply", "arguments": {"a": 3,, "b": 4}}</tool_call>'
    assert parse_tool_calls(broken_json) == []  # TRL's: no call, the sample ends

    class Raising:  # a format that fails in a way no format should: still a plain turn, no exception
        def parse(self, text, **context):
            raise RecursionError("deep")

    parsed = ToolRunner([multiply]).parse(Raising(), "<tool_call>x</tool_call>", plain_text="x")
    assert (
        parsed.message == {"role": "assistant", "content": "x"} and not parsed.calls and not parsed.readable
    )


def test_every_failure_reaches_the_model_as_trls_error_result():
    runner = ToolRunner([multiply, lookup, broken])
    rows = [
        [
            ToolCall("multiply", {"a": 3, "b": 4.5}),
            ToolCall("nope", {}),
            ToolCall("multiply", {"a": 3}),
            ToolCall("multiply", {"a": 3, "b": 1, "c": 2}),
            ToolCall("multiply", "a=3"),
        ],
        [
            ToolCall("lookup", {"key": "abc"}),
            ToolCall("lookup", {"key": "missing"}),
            ToolCall("broken", {"x": 1}),
        ],
        [],
    ]
    results = runner(rows)
    assert results[0] == [
        ("multiply", "13.5"),
        ("nope", "{'error': 'Tool nope not found.'}"),
        ("multiply", "{'error': \"multiply() missing 1 required positional argument: 'b'\"}"),
        ("multiply", "{'error': \"multiply() got an unexpected keyword argument 'c'\"}"),
        ("multiply", "{'error': 'test_tools.multiply() argument after ** must be a mapping, not str'}"),
    ]
    assert results[1] == [
        ("lookup", "{'key': 'abc', 'value': 3}"),  # awaited; a dict as TRL renders it, str()
        ("lookup", "{'error': \"'missing'\"}"),
        ("broken", "{'error': 'disk on fire'}"),
    ]
    assert results[2] == []
    assert (runner.counts.calls, runner.counts.failures) == (8, 6)
    assert runner.counts.metrics(rows=4) == {"tools/call_frequency": 2.0, "tools/failure_frequency": 0.75}
    assert ToolCallCounts().metrics(rows=4) == {"tools/call_frequency": 0.0, "tools/failure_frequency": 0.0}


def test_arguments_are_checked_against_the_schema_where_asked():
    runner = ToolRunner([multiply], ToolOptions(check_arguments=True))
    [results] = runner(
        [
            [
                ToolCall("multiply", {"a": 3}),
                ToolCall("multiply", {"a": 3, "b": 1, "c": 2}),
                ToolCall("multiply", {"a": "3", "b": 1}),
                ToolCall("multiply", {"a": True, "b": 1}),
                ToolCall("multiply", "a=3"),
                ToolCall("multiply", {"a": 3, "b": 2}),
            ]
        ]
    )
    assert [text for _, text in results] == [
        error_text("multiply needs the argument b"),
        error_text("multiply takes no argument c (it takes: a, b)"),
        error_text("multiply's argument a must be of type integer, got '3'"),
        error_text("multiply's argument a must be of type integer, got True"),
        error_text("the arguments of multiply must be a JSON object, got 'a=3'"),
        "6",
    ]
    assert (runner.counts.calls, runner.counts.failures) == (6, 5)


def test_a_list_result_is_the_list_itself():
    def blocks(n: int) -> list:
        """Text blocks.

        Args:
            n: how many
        """
        return [{"type": "text", "text": str(i)} for i in range(n)]

    cut = ToolRunner([blocks], ToolOptions(max_response_length=1))  # a list is never cut
    assert cut([[ToolCall("blocks", {"n": 2})]]) == [[("blocks", blocks(2))]]


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
    call = [ToolCall("add", {"n": 5})]
    assert runner([call, call], rows=[1, 1]) == [[("add", "5")], [("add", "10")]]
    assert (envs[0].total, envs[1].total) == (0, 10)
    assert runner.counts.calls == 2
    with pytest.raises(ValueError, match="rows="):
        runner([call])


def test_async_tools_run_inside_a_running_event_loop_too():
    runner = ToolRunner([lookup])
    calls = [[ToolCall("lookup", {"key": "ab"})]]

    async def inside_a_loop():
        return runner(calls)

    assert asyncio.run(inside_a_loop()) == [[("lookup", "{'key': 'ab', 'value': 2}")]]


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
    [[(_, whole)]] = ToolRunner([long_text])([[ToolCall("long_text", {"n": 5000})]])
    assert whole == "x" * 5000  # by default no cut, as TRL


def test_tool_options_are_a_section_of_grpo_config_checked_by_either_name():
    assert ToolOptions() == ToolOptions(
        max_calling_iterations=None, max_response_length=None, call_format=None, check_arguments=False
    )
    assert GRPOConfig(tool_call_format="llama3_json").tools.call_format == "llama3_json"
    with pytest.raises(ValueError, match="call_format"):
        GRPOConfig(tool_call_format="json")
    assert GRPOConfig().tools == ToolOptions()
    config = GRPOConfig(max_tool_calling_iterations=3, max_tool_response_length=64)  # TRL's and verl's names
    assert config.tools == ToolOptions(max_calling_iterations=3, max_response_length=64)
    assert (config.max_tool_calling_iterations, config.max_tool_response_length) == (3, 64)
    rule = r"GRPOConfig.tools.max_response_length=0 \(max_tool_response_length\): must be >= 1 or None$"
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
