"""The chat template a run with tools trains with, against TRL 1.16's choice: on every tool-capable template
TRL ships, with a byte-level (GPT-2-style) tokenizer that holds the templates' markers as tokens and one
that does not, the template is kept where TRL keeps it, swapped for TRL's training copy where TRL swaps it,
and refused where TRL cannot append a tool turn either; the tool turn's ids are then TRL's
`_get_tool_suffix_ids`."""

from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from grpo_lightning.core.tools.schemas import template_renders_tools, tool_schema
from grpo_lightning.core.tools.templates import TRAINING_SUFFIX, trl_chat_templates
from grpo_lightning.core.tools.turns import (
    check_prefix_preserving,
    tool_messages,
    tool_suffix_ids,
    training_template,
    training_template_note,
)
from tests.test_tool_formats import ADDED, SPECIAL, multiply

SHIPPED = sorted(name for name in trl_chat_templates() if not name.endswith(TRAINING_SUFFIX))


@pytest.fixture(scope="module", params=["markers as tokens", "markers as text"])
def tokenizer_with(request, tiny_model_dir):
    """A fresh tokenizer with TRL's template `name`, the families' markers added as tokens or not."""

    def make(name: str):
        tok = AutoTokenizer.from_pretrained(tiny_model_dir)
        if request.param == "markers as tokens":
            tok.add_special_tokens({"additional_special_tokens": SPECIAL})
            tok.add_tokens(ADDED)
        tok.bos_token = "<bos>" if "gemma" in name else "<|begin_of_text|>"
        tok.chat_template = trl_chat_templates()[name]
        return tok

    return make


def trl_suffix(tok, chat_template: str | None, results: list[tuple[str, str]]) -> list[int]:
    from trl.trainer.grpo_trainer import GRPOTrainer

    trainer = SimpleNamespace(
        processing_class=tok,
        _tokenizer=tok,
        chat_template=chat_template,
        chat_template_kwargs={},
        _is_vlm=False,
    )
    messages = [{"role": "tool", "name": name, "content": text} for name, text in results]
    return GRPOTrainer._get_tool_suffix_ids(trainer, messages)


@pytest.mark.parametrize("name", SHIPPED)
def test_the_training_template_is_trls_choice_and_its_tool_turn_trls_ids(tokenizer_with, name):
    ctu = pytest.importorskip("trl.chat_template_utils")
    tok = tokenizer_with(name)
    if not (ctu.supports_tool_calling(tok) and template_renders_tools(tok, [tool_schema(multiply)])):
        return  # no tool turns under this template: nothing to train
    if ctu.is_chat_template_prefix_preserving(tok):  # TRL keeps the template
        assert training_template(tok, True) is None
        chosen = None
    else:
        try:
            chosen = ctu.get_training_chat_template(tok)
        except ValueError:  # TRL has no copy to swap in: it refuses, and so do we
            with pytest.raises(ValueError, match=r"^the chat template does not render .* token \d+ changes"):
                training_template(tok, True)
            return
        try:
            ours = training_template(tok, True)
        except ValueError:  # not even TRL's copy keeps conversations as prefixes: TRL fails at the first turn
            with pytest.raises(ValueError, match="Unexpected tokenization"):
                trl_suffix(tok, chosen, [("multiply", "42")])
            return
        assert ours == chosen
        tok.chat_template = chosen
        assert training_template_note(trl_chat_templates()[name]).startswith(f"the chat template ({name}) ")
    results = [("multiply", "42"), ("multiply", "{'error': 'x'}")]
    assert tool_suffix_ids(tok, tool_messages(results, True)) == trl_suffix(tok, chosen, results)


def test_qwen3s_shipped_template_trains_with_trls_copy_and_a_rewriting_one_is_refused(tokenizer_with):
    pytest.importorskip("trl")
    tok = tokenizer_with("qwen3")  # drops the earlier turn's thinking once a tool follows
    with pytest.raises(
        ValueError, match=r"^the chat template does not render .* token \d+ changes: '<?think>"
    ):
        check_prefix_preserving(tok, True)
    assert training_template(tok, True) == trl_chat_templates()["qwen3_training"]
    assert tok.chat_template == trl_chat_templates()["qwen3"]  # the tokenizer is left as it was
    tok.chat_template = (
        "{{ messages | length }}" + trl_chat_templates()["qwen2_5"]
    )  # the count changes the start
    with pytest.raises(
        ValueError, match=r"^the chat template does not render .*token 0 changes: '2<.* becomes '3<"
    ) as error:
        training_template(tok, True)
    assert "\n" not in str(error.value)


def test_a_template_that_takes_arguments_only_as_a_string_gets_its_tool_turn(tokenizer_with):
    """DeepSeek-V3's template adds the call's arguments to a string: the stand-in call gives them as JSON
    text, as TRL falls back; its tools are taught in the system prompt and the results come as a user turn."""
    pytest.importorskip("trl")
    tok = tokenizer_with("deepseekv3")
    assert not template_renders_tools(tok, [tool_schema(multiply)])
    assert training_template(tok, False) is None
    suffix = tok.decode(tool_suffix_ids(tok, tool_messages([("multiply", "42")], False)))
    assert "<tool_response>\n42\n</tool_response>" in suffix
