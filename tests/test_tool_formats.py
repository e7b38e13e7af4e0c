"""The tool-call formats against TRL 1.16's own parsing: on every chat template TRL ships, the same assistant
turns (a call, a number written as a string, a string argument, an unknown tool, two calls, text around a
call, a thinking block, a plain answer, broken and cut-off calls, prose) read by `trl.chat_template_utils.
parse_response` with the response template TRL sets and by our format give the same message; the format is
the one TRL picks (or refused where TRL refuses); deep nesting and long turns stay bounded."""

import os
import time

import pytest
from transformers import AutoTokenizer

from grpo_lightning.core.tools.formats import TOOL_CALL_FORMATS, choose_format
from grpo_lightning.core.tools.schemas import template_renders_tools, tool_schema
from grpo_lightning.core.tools.templates import TRAINING_SUFFIX, trl_chat_templates, trl_training_template

# The markers of the families' turns, as the real tokenizers hold them: special tokens, or added ones.
SPECIAL = [
    *("<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    *("<|begin_of_text|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|call|>", "<|return|>"),
    *("<|constrain|>", "<|tool_call_start|>", "<|tool_call_end|>", "<|tool_response_start|>"),
    *("<|tool_response_end|>", "<|turn>", "<turn|>", "<|tool_call>", "<tool_call|>", "<|tool_response>"),
    *("<tool_response|>", '<|"|>', "<|channel>", "<channel|>", "<|assistant|>", "<|user|>", "<|system|>"),
    *("<|observation|>", "<bos>", "<eos>"),
]
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
ADDED += ["<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"]
END_OF_TURN = {  # each family's end-of-sequence token
    "hermes": "<|im_end|>",
    "qwen3_coder": "<|im_end|>",
    "nemotron_3": "<|im_end|>",
    "lfm2": "<|im_end|>",
    "glm4": "<|user|>",
    "llama3_json": "<|eot_id|>",
    "gpt_oss": "<|return|>",
    "gemma4": "<turn|>",
}
STOPS = ["<|call|>", "<|tool_response>", "<|observation|>"]  # where a calling turn stops in some families


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def greet(name: str, times: int = 1) -> str:
    """Greet someone.

    Args:
        name: whom to greet
        times: how many times
    """
    return " ".join([f"Hello {name}"] * times)


TOOLS = [multiply, greet]
SCHEMAS = [tool_schema(tool) for tool in TOOLS]
SHIPPED = sorted(name for name in trl_chat_templates() if not name.endswith(TRAINING_SUFFIX))


def call(name: str, arguments: dict) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


TURNS = {  # what the model writes, as the template renders such an assistant message
    "call": {"role": "assistant", "content": "", "tool_calls": [call("multiply", {"a": 6, "b": 7})]},
    "number as a string": {
        "role": "assistant",
        "content": "",
        "tool_calls": [call("multiply", {"a": "6", "b": 7})],
    },
    "string argument": {
        "role": "assistant",
        "content": "",
        "tool_calls": [call("greet", {"name": "42", "times": "2"})],
    },
    "unknown tool": {"role": "assistant", "content": "", "tool_calls": [call("divide", {"a": 6, "b": "7"})]},
    "two calls": {
        "role": "assistant",
        "content": "",
        "tool_calls": [call("multiply", {"a": 6, "b": 7}), call("greet", {"name": "Bob"})],
    },
    "text and a call": {
        "role": "assistant",
        "content": "Let me compute.",
        "tool_calls": [call("multiply", {"a": 6, "b": 7})],
    },
    "answer": {"role": "assistant", "content": "The answer is 42."},
}


@pytest.fixture(scope="module")
def base_tokenizer(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    tok.add_tokens(ADDED)
    return tok


def with_template(tokenizer, name: str):
    tok = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    tok.add_tokens(ADDED)
    tok.bos_token = "<bos>" if "gemma" in name else "<|begin_of_text|>"  # the templates that write one
    tok.chat_template = trl_chat_templates()[name]
    return tok


def written_turn(tok, message: dict, end_of_turn: str) -> tuple[str, str]:
    """(the prompt, the turn after it) where the model writes `message`: the template's render of the
    conversation with it, after the generation prompt's, up to where the model stops."""
    user = [{"role": "user", "content": "What is 6 times 7?"}]
    prompt = tok.apply_chat_template(user, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    full = tok.apply_chat_template([*user, message], tools=TOOLS, tokenize=False)
    turn = full[len(os.path.commonprefix([prompt, full])) :]  # after what the prompt opened (`<think>\n`)
    ends = [turn.find(stop) + len(stop) for stop in [end_of_turn, *STOPS] if stop in turn]
    return prompt, turn[: min(ends)] if ends else turn


def scripted_turns(tok, family: str) -> tuple[str, dict[str, str]]:
    end = END_OF_TURN[family]
    prompt, _ = written_turn(tok, TURNS["answer"], end)
    texts = {}
    for case, message in TURNS.items():
        if case == "two calls" and family == "llama3_json":
            continue  # Llama 3.x's template refuses two calls in one turn
        texts[case] = written_turn(tok, message, end)[1]
    texts["broken JSON"] = texts["call"].replace("7", "7,,", 1)
    texts["cut off"] = texts["call"][: len(texts["call"]) // 2]
    texts["thinking and a call"] = "<think>\nsix times seven\n</think>\n\n" + texts["call"]
    texts["prose"] = "plain words, maybe(x) and more" + end
    return prompt, texts


def trl_and_ours(tok, family: str, prompt: str, text: str) -> tuple[dict, dict]:
    from trl.chat_template_utils import parse_response

    prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    ids = tok(text, add_special_tokens=False)["input_ids"]
    theirs = parse_response(tok, ids, prefix=prompt_ids, tools=TOOLS)
    ours = TOOL_CALL_FORMATS[family].parse(
        tok.decode(ids),
        prompt=tok.decode(prompt_ids),
        schemas=SCHEMAS,
        plain_text=tok.decode(ids, skip_special_tokens=True),
        eos_token=tok.eos_token,
    )
    return theirs, ours.message


@pytest.mark.parametrize("name", SHIPPED)
def test_every_trl_template_parses_as_trl_or_is_refused_by_both(base_tokenizer, name):
    ctu = pytest.importorskip("trl.chat_template_utils")
    tok = with_template(base_tokenizer, name)
    if not ctu.supports_tool_calling(tok):  # TRL refuses tools: we teach Hermes calls in the system prompt
        assert not template_renders_tools(tok, SCHEMAS)
        assert choose_format(tok.chat_template, False).name == "hermes"
        return
    try:
        ctu.add_response_schema(tok)
    except ValueError:  # a template TRL shows tools with but cannot parse
        if name == "diffusion_gemma":  # Gemma 4's calls: ours reads them as TRL's Gemma 4 template does
            assert choose_format(tok.chat_template, True).name == "gemma4"
            tok.response_template = ctu.gemma4_template
        else:
            with pytest.raises(ValueError, match="^the chat template shows tools, but .* tools.call_format"):
                choose_format(tok.chat_template, True)
            return
    family = choose_format(tok.chat_template, True).name
    tok.eos_token = END_OF_TURN[family]
    prompt, texts = scripted_turns(tok, family)
    calls = 0
    for case, text in texts.items():
        theirs, ours = trl_and_ours(tok, family, prompt, text)
        assert ours == theirs, (case, text)
        calls += len(ours.get("tool_calls", []))
    assert calls >= 6  # the scripted calls were read as calls, not all as plain text
    training = trl_training_template(tok.chat_template)
    if training is not None:  # TRL's training copy is the same family
        assert choose_format(training, True).name == family


def test_arguments_are_typed_by_the_schema_and_the_last_text_is_the_content():
    hermes = TOOL_CALL_FORMATS["hermes"]
    turn = hermes.parse(
        '<think>\nfirst\n</think>\n\nI will call.\n<tool_call>\n{"name": "multiply", "arguments": {"a": "6", '
        '"b": 7}}\n</tool_call>\nthen this<|im_end|>',
        schemas=SCHEMAS,
    )
    assert turn.message == {
        "role": "assistant",
        "reasoning_content": "first",
        "content": "then this",
        "tool_calls": [call("multiply", {"a": 6, "b": 7})],
    }
    assert [(c.name, c.arguments) for c in turn.calls] == [("multiply", {"a": 6, "b": 7})]
    kept = hermes.parse(
        '<tool_call>\n{"name": "greet", "arguments": {"name": "42"}}\n</tool_call>', schemas=SCHEMAS
    )
    assert kept.calls[0].arguments == {"name": "42"}  # a string parameter keeps its text
    coder = TOOL_CALL_FORMATS["qwen3_coder"].parse(
        "<tool_call>\n<function=greet>\n<parameter=name>\n42\n</parameter>\n<parameter=times>\n2\n</parameter>\n"
        "</function>\n</tool_call><|im_end|>",
        schemas=SCHEMAS,
    )
    assert coder.calls[0].arguments == {"name": "42", "times": 2}


def test_broken_json_is_a_plain_turn_without_calls():
    text = '<tool_call>\n{"name": "multiply", "arguments": {"a": 6,, "b": 7}}\n</tool_call><|im_end|>'
    turn = TOOL_CALL_FORMATS["hermes"].parse(text, plain_text="plain")
    assert (
        not turn.readable and turn.calls == [] and turn.message == {"role": "assistant", "content": "plain"}
    )


@pytest.mark.parametrize("family", ["hermes", "llama3_json", "gpt_oss", "gemma4", "lfm2", "qwen3_coder"])
def test_a_call_nested_3000_deep_is_a_plain_turn_not_an_exception(family):
    deep = "[" * 3000 + "]" * 3000
    text = {
        "hermes": f'<tool_call>{{"name": "multiply", "arguments": {{"a": {deep}}}}}</tool_call><|im_end|>',
        "llama3_json": f'{{"name": "multiply", "parameters": {{"a": {deep}}}}}<|eot_id|>',
        "gpt_oss": f'to=functions.multiply<|channel|>commentary json<|message|>{{"a": {deep}}}<|call|>',
        "gemma4": f"<|tool_call>call:multiply{{a:{deep}}}<tool_call|>",
        "lfm2": f"<|tool_call_start|>[multiply(a={deep})]<|tool_call_end|><|im_end|>",
        "qwen3_coder": f"<tool_call>\n<function=multiply>\n<parameter=a>\n{deep}\n</parameter>\n</function>\n"
        "</tool_call><|im_end|>",
    }[family]
    schemas = [
        {
            "type": "function",
            "function": {"name": "multiply", "parameters": {"properties": {"a": {"type": "array"}}}},
        }
    ]
    turn = TOOL_CALL_FORMATS[family].parse(text, schemas=schemas)
    if family == "qwen3_coder":  # a value too deep to type stays the text the model wrote
        assert turn.calls[0].arguments == {"a": deep}
    else:
        assert not turn.readable and turn.calls == []


@pytest.mark.parametrize("family", list(TOOL_CALL_FORMATS))
def test_long_turns_are_read_in_bounded_time(family):
    for text in ["<tool_call>" * 20_000, "a, b(" * 20_000, "x" * 200_000, "<think>" * 20_000, "{" * 50_000]:
        start = time.perf_counter()
        TOOL_CALL_FORMATS[family].parse(text, prompt="<|im_start|>assistant\n<think>\n", schemas=SCHEMAS)
        assert time.perf_counter() - start < 2.0, (family, text[:20])


def test_the_format_option_names_one_outright_and_an_unknown_name_is_refused():
    assert choose_format(None, True, "lfm2").name == "lfm2"
    assert (
        choose_format("{{ messages }}", False).name == "hermes"
    )  # no tools shown: taught in the system prompt
    with pytest.raises(ValueError, match=r"^tools.call_format='mistral': must be one of qwen3_coder, "):
        choose_format(None, True, "mistral")


@pytest.mark.parametrize("name", SHIPPED)
def test_the_prompt_with_typed_tools_has_trls_ids_return_entry_included(base_tokenizer, name):
    """TRL hands the functions to the template (`apply_chat_template(tools=[function])`), whose schemas
    keep their `return`; ours are the same dicts, so the prompt's ids are TRL's."""
    from grpo_lightning.core.chat_template import PromptOptions, render_chat
    from grpo_lightning.core.tools.calculator import calculator

    tok = with_template(base_tokenizer, name)
    tools = [*TOOLS, calculator]
    if not template_renders_tools(tok, [tool_schema(t) for t in tools]):
        return  # the tools go to the system prompt (Hermes), not to the template
    messages = [{"role": "user", "content": "What is 6 times 7?"}]
    ours = render_chat(
        tok,
        messages,
        PromptOptions(),
        tokenize=True,
        add_generation_prompt=True,
        tools=[tool_schema(t) for t in tools],
    )
    theirs = tok.apply_chat_template(
        messages, tools=tools, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    assert ours == list(theirs)
    assert all("return" in tool_schema(t)["function"] for t in tools)


def test_values_are_typed_as_the_schema_says_and_json_dialects_read():
    from grpo_lightning.core.tools.turn_parser import UnreadableTurn, read_json, schema_types, typed_value

    assert typed_value("6", ("integer",)) == 6 and typed_value("3.0", ("integer",)) == 3
    assert typed_value("3.5", ("integer",)) == "3.5"  # not a whole number: the text stays
    assert typed_value("2.5", ("number",)) == 2.5 and typed_value("nan", ("number",)) == "nan"
    assert typed_value("true", ("boolean",)) is True and typed_value("None", ("null",)) is None
    assert typed_value("[1, 2]", ("array",)) == [1, 2] and typed_value("[1]", ("object",)) == "[1]"
    assert typed_value("6", ("string",)) == "6" and typed_value("6", ("string", "integer")) == 6  # as TRL
    assert schema_types({"anyOf": [{"type": "integer"}], "nullable": True}) == ("integer", "null")
    assert read_json('{a:6,b:<|"|>x, y<|"|>}', string_quotes=[('<|"|>', '<|"|>')], bare_keys=True) == {
        "a": 6,
        "b": "x, y",
    }
    assert read_json("'Paris'", string_quotes=[("'", "'")]) == "Paris"
    assert read_json(" not json ", or_text=True) == "not json"
    with pytest.raises(UnreadableTurn, match="nested more than 200 levels"):
        read_json("[" * 3000 + "]" * 3000, or_text=True)
