"""What the model is told about its tools: each tool's JSON schema, built from a plain function, and, where
the chat template cannot show tools, the same schemas in a Hermes-style system prompt.

A schema is what `apply_chat_template(tools=...)` takes and what TRL's `GRPOTrainer(tools=...)` renders: it is
read from the function's type hints and its Google-style docstring (`transformers.utils.get_json_schema`).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Sequence

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase
from transformers.utils import get_json_schema

from grpo_lightning.core.chat_template import PromptOptions, render_chat

Tool = Callable[..., object]  # a sync or async function with type hints and a Google-style docstring


def tool_name(tool: Tool) -> str:
    """The name the model calls `tool` by: its function's `__name__`."""
    return getattr(tool, "__name__", type(tool).__name__)


def tool_schema(tool: Tool) -> dict:
    """`tool`'s JSON schema (`{"type": "function", "function": {"name", "description", "parameters"}}`, and
    `"return"` where the function annotates what it returns), read from its type hints and Google-style
    docstring, as TRL renders a tool (`apply_chat_template(tools=[function])`); a function without them is
    refused, naming it."""
    if not callable(tool):
        raise TypeError(f"a tool must be a function, got {tool!r}")
    try:
        schema = get_json_schema(tool)
    except Exception as error:  # transformers raises its own exception types, one per missing piece
        raise ValueError(
            f"tool {tool_name(tool)!r} has no JSON schema ({error}): give every argument a type hint and "
            "the function a Google-style docstring with an `Args:` line per argument"
        ) from None
    return schema


def tools_by_name(tools: Sequence[Tool]) -> dict[str, Tool]:
    """`tools` keyed by the names the model calls them by; two tools of one name are refused."""
    named: dict[str, Tool] = {}
    for tool in tools:
        name = tool_name(tool)
        if name in named:
            raise ValueError(f"two tools are named {name!r}: the model could not tell them apart")
        named[name] = tool
    return named


def is_async_tool(tool: Tool) -> bool:
    """Whether calling `tool` returns a coroutine to await (an `async def` function or method)."""
    return inspect.iscoroutinefunction(tool)


def template_renders_tools(
    tokenizer: PreTrainedTokenizerBase, schemas: Sequence[dict], options: PromptOptions = PromptOptions()
) -> bool:
    """Whether `tokenizer`'s chat template, rendered with `options` (the run's `GRPOConfig.prompts`), shows
    the tools it is given (`apply_chat_template(tools=...)`: the first tool's name and description appear
    in a rendered conversation) and renders a whole tool exchange: an assistant turn's call (its name and
    arguments) and the tool's result, as TRL requires of a template it runs tools with
    (`trl.chat_template_utils.supports_tool_calling`). A template that drops either is not shown tools."""
    if not schemas:
        return False
    function = schemas[0]["function"]
    rendered = render_chat(
        tokenizer,
        [{"role": "user", "content": "x"}],
        options,
        tokenize=False,
        add_generation_prompt=True,
        tools=schemas,
    )
    shown = function["name"] in rendered and function.get("description", "") in rendered
    return shown and _renders_tool_exchange(tokenizer, options)


def _renders_tool_exchange(tokenizer: PreTrainedTokenizerBase, options: PromptOptions) -> bool:
    """Whether a call's name, argument name and value, and the tool's result all appear in the render of a
    user turn, an assistant turn calling a tool, and the tool's message (arguments given as a JSON string
    where the template cannot take them as a mapping)."""
    marks = ("call_name_5e1c", "argument_key_7a2d", "argument_value_3f9b", "result_text_8c4e")
    name, key, value, result = marks
    for arguments in ({key: value}, json.dumps({key: value})):
        messages = [
            {"role": "user", "content": "x"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}],
            },
            {"role": "tool", "name": name, "content": result},
        ]
        try:
            rendered = render_chat(tokenizer, messages, options, tokenize=False, add_generation_prompt=False)
        except TypeError:
            continue  # a template that adds the arguments to a string: try them as one
        except TemplateError:
            return False  # a template that refuses the roles
        return all(mark in rendered for mark in marks)
    return False


def hermes_system_prompt(schemas: Sequence[dict]) -> str:
    """The tools described in Hermes style (Qwen2.5's template's words and format), for a system prompt where
    the chat template cannot show tools: each schema as one JSON line inside `<tools></tools>`, and how to
    call one (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`)."""
    lines = "\n".join(json.dumps(schema, ensure_ascii=False) for schema in schemas)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{lines}\n"
        "</tools>\n\nFor each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        "<args-json-object>}\n</tool_call>"
    )


def with_tools_in_system_prompt(messages: list[dict], schemas: Sequence[dict]) -> list[dict]:
    """`messages` with `hermes_system_prompt(schemas)` after the system message's content, or as a new
    system message first; the input list is left as it is."""
    tools_text = hermes_system_prompt(schemas)
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{tools_text}"}, *messages[1:]]
    return [{"role": "system", "content": tools_text}, *messages]
