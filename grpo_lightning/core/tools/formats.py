"""The tool-call formats models write, one registry entry per family, and the one a chat template uses.

Each format reads an assistant turn into the message TRL builds from it (TRL 1.16 with the response
templates of `trl.chat_template_utils.add_response_schema`): the content, the thinking split off where the
family writes one, the tool calls with their arguments typed by the tools' JSON schemas (`"6"` for an
integer parameter is 6). A turn whose call cannot be read (broken JSON, a call without a name) is TRL's
plain turn: its text as the content and no call, so that the sample ends there.

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5, Qwen3, Qwen3-Instruct-2507,
  Qwen3-VL; and any template without tools, where the system prompt teaches these calls);
- `qwen3_coder`: `<tool_call><function=NAME><parameter=P>V</parameter></function></tool_call>` (Qwen3.5 think
  and nothink, Qwen3.6, Qwen3.8); `nemotron_3`: the same calls after the `<think>` the prompt opens
  (Nemotron 3 Nano, Super, Ultra, 3.5 Lightning);
- `glm4`: `<tool_call>NAME<arg_key>P</arg_key><arg_value>V</arg_value></tool_call>` (GLM-4.5);
- `llama3_json`: `{"name": ..., "parameters": {...}}<|eot_id|>` (Llama 3.1, 3.2: results as `ipython` turns);
- `gpt_oss`: `to=functions.NAME<|channel|>commentary json<|message|>{...}<|call|>` (gpt-oss);
- `lfm2`: `<|tool_call_start|>[multiply(a=6, b=7)]<|tool_call_end|>` (LFM2 v2, LFM2.5);
- `gemma4`: `<|tool_call>call:multiply{a:6,b:7}<tool_call|>` (Gemma 4).

The format is chosen as TRL chooses its response template: by which of TRL's template files (or their
training copies) the tokenizer's template is. A template TRL does not ship is matched by the markers its
family writes; `tools.call_format` names one outright.

Every family's tool results are TRL's tool messages (`{"role": "tool", "name": ..., "content": ...}`); the
chat template renders them its own way (Llama 3.x as `ipython` turns, gpt-oss as `functions.NAME` turns).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from grpo_lightning.core.options import Choices
from grpo_lightning.core.tools.templates import TRAINING_SUFFIX, template_text, trl_template_name
from grpo_lightning.core.tools.turn_parser import (
    Region,
    TurnLayout,
    UnreadableTurn,
    before,
    literal,
    parameters_by_tool,
    pattern,
    read_json,
    read_regions,
    read_tags,
)


@dataclass(frozen=True)
class ParsedCall:
    """One tool call of a turn: the tool's name and its arguments as read (a dict for a well-formed call;
    a model may write anything else, which the tool cannot be called with)."""

    name: str
    arguments: Any


@dataclass(frozen=True)
class ParsedTurn:
    """An assistant turn as TRL reads it: `message` is the dict TRL's reward functions get (`role`,
    `content`, the thinking where the family splits it off, `tool_calls`); `readable` False: a call could not
    be read and the turn is plain text."""

    message: dict
    readable: bool = True

    @property
    def calls(self) -> list[ParsedCall]:
        """The turn's function calls, in order."""
        return [
            ParsedCall(call["function"]["name"], call["function"]["arguments"])
            for call in self.message.get("tool_calls", [])
            if call.get("type") == "function"
        ]


@dataclass(frozen=True)
class ToolCallFormat:
    """A family's tool calls: how its turns are laid out (`layout`), the TRL template files that write
    them, and the markers (`markers`, all present) that tell a template of the family TRL does not ship."""

    name: str
    layout: TurnLayout
    trl_templates: tuple[str, ...]
    markers: tuple[str, ...]

    def parse(
        self,
        text: str,
        *,
        prompt: str = "",
        schemas: Sequence[dict] = (),
        plain_text: str | None = None,
        eos_token: str | None = None,
    ) -> ParsedTurn:
        """The assistant turn `text` (decoded with its special tokens) as TRL reads it after `prompt` (the
        context it was sampled from, decoded: its last assistant header and what the template wrote after
        it start the turn), arguments typed by `schemas` (the tools' JSON schemas). `plain_text`: the turn
        without special tokens, the content of a turn that cannot be read (default `text`); `eos_token`:
        cut off the end of the content, as TRL does."""
        try:
            fields = read_regions(
                self.layout, _after_anchor(self.layout, prompt) + text, parameters_by_tool(schemas)
            )
            message = {"role": "assistant", **fields}
            content = message.get("content")
            if isinstance(content, str) and eos_token:
                message["content"] = content.removesuffix(eos_token)
            if not message.get("content"):
                message["content"] = ""
            if "tool_calls" in message:
                _check_calls(message["tool_calls"])
        except (UnreadableTurn, ValueError, TypeError):
            return ParsedTurn(
                {"role": "assistant", "content": text if plain_text is None else plain_text}, False
            )
        return ParsedTurn(message)


def _after_anchor(layout: TurnLayout, prompt: str) -> str:
    """What the prompt wrote after its last assistant header (all of it where it has none)."""
    end, position = None, 0
    while (found := layout.anchor(prompt, position)) is not None:
        end = found.end
        position = found.end if found.end > found.start else found.end + 1
    return prompt if end is None else prompt[end:]


def _check_calls(calls: object) -> None:
    """Refuse (`UnreadableTurn`) calls that are not `{"type", "function": {"name": str, "arguments"}}`;
    arguments left out are `{}`."""
    if not isinstance(calls, list):
        raise UnreadableTurn("the tool calls are not a list")
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise UnreadableTurn("a tool call without a function name")
        if function.get("arguments") is None:
            function["arguments"] = {}


def result_message(name: str, content: object) -> dict:
    """A tool's result as the message every family's chat template reads: TRL's `tool` message."""
    return {"role": "tool", "name": name, "content": content}


# The families ----------------------------------------------------------------------------------------


def _call(function: Any) -> dict:
    return {"type": "function", "function": function}


def _named_call(arguments: Any, groups: dict[str, str]) -> dict:
    return _call({"name": groups.get("name"), "arguments": arguments})


def _thinking(name: str = "reasoning_content") -> Region:
    return Region(name, opens=literal("<think>"), closes=pattern(r"</think>\s*"))


def _content(closes: str) -> Region:
    return Region("content", closes=pattern(closes))


_IM_END = r"<\|im_end\|>\s*"
_QWEN_HEADER = literal("<|im_start|>assistant\n")

_coder_calls = Region(
    "tool_calls",
    opens=pattern(r"<tool_call>\s*<function=(?P<name>[^\n>]+)>"),
    closes=pattern(r"</tool_call>\s*"),
    read=lambda text, groups: _named_call(
        read_tags(r"<parameter=(?P<key>[^>\n]+)>\s*(?P<value>.*?)\s*</parameter>", str.strip)(text), groups
    ),
    repeats=True,
)

# An LFM2 argument's value: a single-quoted string, brackets nested up to three deep (TRL's bound: a
# regular expression cannot count), or bare text up to the next `,` or `)`.
_LFM2_ATOM = r"[^\[\]{}'\"]|'[^']*'|\"[^\"]*\""
_lfm2_nested = _LFM2_ATOM
for _ in range(3):
    _lfm2_nested = rf"{_LFM2_ATOM}|[\[{{](?:{_lfm2_nested})*[\]}}]"
_LFM2_VALUE = rf"'[^']*'|[\[{{](?:{_lfm2_nested})*[\]}}]|[^,)]*"


def _lfm2_value(raw: str) -> Any:
    return read_json(raw, string_quotes=[("'", "'")], or_text=True)


FORMATS: list[ToolCallFormat] = [
    ToolCallFormat(
        "qwen3_coder",
        TurnLayout(_QWEN_HEADER, (_thinking(), _coder_calls, _content(_IM_END))),
        ("qwen3_5_nothink", "qwen3_5_think", "qwen3_6", "qwen3_8"),
        ("<tool_call>", "<function=", "<parameter="),
    ),
    ToolCallFormat(
        "nemotron_3",
        TurnLayout(
            pattern(r"<\|im_start\|>assistant\n<think>(?:\n|</think>)?"),
            (
                Region("reasoning_content", opens=before("</think>"), closes=pattern(r"</think>\s*")),
                _coder_calls,
                _content(_IM_END),
            ),
        ),
        ("nemotron_3_nano", "nemotron_3_super", "nemotron_3_ultra", "nemotron_3_5_lightning"),
        ("<tool_call>", "<function=", "truncate_history_thinking"),
    ),
    ToolCallFormat(
        "glm4",
        TurnLayout(
            literal("<|assistant|>"),
            (
                _thinking(),
                Region(
                    "tool_calls",
                    opens=pattern(r"<tool_call>(?P<name>\S+)\n?"),
                    closes=pattern(r"</tool_call>\s*"),
                    read=lambda text, groups: _named_call(
                        read_tags(
                            r"<arg_key>(?P<key>[^<]+)</arg_key>\s*\n<arg_value>(?P<value>.*?)</arg_value>",
                            str.strip,
                        )(text),
                        groups,
                    ),
                    repeats=True,
                ),
                _content(r"<\|user\|>\s*|$"),
            ),
        ),
        ("glm4moe",),
        ("<tool_call>", "<arg_key>"),
    ),
    ToolCallFormat(
        "llama3_json",
        TurnLayout(
            literal("<|start_header_id|>assistant<|end_header_id|>\n\n"),
            (
                Region(
                    "tool_calls",
                    opens=pattern(r'\{"name":\s*"(?P<name>[^"]+)",\s*"parameters":\s*'),
                    closes=pattern(r"\}<\|eot_id\|>\s*"),
                    read=lambda text, groups: _named_call(read_json(text), groups),
                    repeats=True,
                    typed=True,
                ),
                _content(r"<\|eot_id\|>\s*"),
            ),
        ),
        ("llama3_1", "llama3_2"),
        ("ipython", '"parameters"', "<|eot_id|>"),
    ),
    ToolCallFormat(
        "gpt_oss",
        TurnLayout(
            literal("<|start|>assistant"),
            (
                Region(
                    "thinking",
                    opens=literal("<|channel|>analysis<|message|>"),
                    closes=pattern(r"<\|end\|>\s*"),
                ),
                Region(
                    "content",
                    opens=literal("<|channel|>final<|message|>"),
                    closes=pattern(r"<\|return\|>\s*"),
                ),
                Region(
                    "tool_calls",
                    opens=pattern(r"to=functions\.(?P<name>\S+?)<\|channel\|>commentary\s+json<\|message\|>"),
                    closes=pattern(r"<\|call\|>\s*"),
                    read=lambda text, groups: _named_call(read_json(text), groups),
                    repeats=True,
                    typed=True,
                ),
            ),
        ),
        ("gptoss",),
        ("<|call|>", "to=functions."),
    ),
    ToolCallFormat(
        "lfm2",
        TurnLayout(
            _QWEN_HEADER,
            (
                _thinking("thinking"),
                Region(
                    "tool_calls",
                    opens=pattern(r"(?:<\|tool_call_start\|>\[|,\s*)(?P<name>\w+)\("),
                    closes=pattern(r"\)(?:\]<\|tool_call_end\|>)?\s*"),
                    read=lambda text, groups: _named_call(
                        read_tags(rf"(?P<key>\w+)=(?P<value>{_LFM2_VALUE})", _lfm2_value)(text), groups
                    ),
                    repeats=True,
                ),
                _content(_IM_END),
            ),
        ),
        ("lfm2_v2", "lfm2_2_5", "lfm2_2_5_v2", "lfm2_2_5_vl"),
        ("<|tool_call_start|>",),
    ),
    ToolCallFormat(
        "gemma4",
        TurnLayout(
            pattern(r"(?:<\|turn>model\n|<tool_response\|>)"),
            (
                Region(
                    "reasoning_content",
                    opens=literal("<|channel>thought\n"),
                    closes=pattern(r"<channel\|>\s*"),
                ),
                Region(
                    "tool_calls",
                    opens=pattern(r"<\|tool_call>call:(?P<name>\w+)"),
                    closes=pattern(r"<tool_call\|>\s*"),
                    read=lambda text, groups: _named_call(
                        read_json(text, string_quotes=[('<|"|>', '<|"|>')], bare_keys=True), groups
                    ),
                    repeats=True,
                    typed=True,
                ),
                _content(r"(?:<turn\|>|<\|tool_response>|<eos>)\s*|$"),
            ),
        ),
        ("gemma4", "gemma4_v2", "gemma4_v3", "gemma4_v4", "gemma4_v5"),
        ("<|tool_call>", "call:"),
    ),
    ToolCallFormat(  # last: its markers are the fewest, and it is the format taught where none is shown
        "hermes",
        TurnLayout(
            _QWEN_HEADER,
            (
                _thinking(),
                Region(
                    "tool_calls",
                    opens=literal("<tool_call>"),
                    closes=pattern(r"</tool_call>\s*"),
                    read=lambda text, groups: _call(read_json(text)),
                    repeats=True,
                    typed=True,
                ),
                _content(_IM_END),
            ),
        ),
        ("qwen2_5", "qwen3", "qwen3_instruct_2507", "qwen3_vl"),
        ("<tool_call>",),
    ),
]

TOOL_CALL_FORMATS: Choices[ToolCallFormat] = Choices("tools.call_format", {f.name: f for f in FORMATS})
"""The tool-call formats by name, in the order their markers are tried (the most specific first)."""

ToolCallFormatName = Literal[tuple(TOOL_CALL_FORMATS)]  # the type of the option that names one


def choose_format(
    chat_template: str | dict | None, renders_tools: bool, name: str | None = None
) -> ToolCallFormat:
    """The format of the calls under `chat_template`: `name` where given (`tools.call_format`); else the
    family of the TRL template file it is (a training copy included); else the first family whose markers
    it holds. A template that shows no tools (`renders_tools` False) is taught Hermes calls in the system
    prompt; one that shows tools in no known format is refused, naming the option."""
    if name is not None:
        return TOOL_CALL_FORMATS[name]
    if not renders_tools:
        return TOOL_CALL_FORMATS["hermes"]
    shipped = trl_template_name(chat_template)
    if shipped is not None:
        family = shipped.removesuffix(TRAINING_SUFFIX)
        for candidate in FORMATS:
            if family in candidate.trl_templates:
                return candidate
    text = template_text(chat_template)
    for candidate in FORMATS:
        if all(marker in text for marker in candidate.markers):
            return candidate
    raise ValueError(
        "the chat template shows tools, but its tool calls are in no format known here: set "
        f"tools.call_format to the one its model writes ({', '.join(TOOL_CALL_FORMATS)})"
    )
