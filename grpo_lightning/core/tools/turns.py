"""The token ids of a tool turn, token in and token out: what follows an assistant turn that called tools.

A multi-turn sample is one growing list of ids, never a transcript re-tokenised: re-rendering the
conversation would change the tokens the loss scores (decode/encode drift). After an assistant turn (its
ids end with the end-of-turn token the model drew), the ids appended are the chat template's rendering of
the tool results and of the next assistant header, found by diffing two renders of a stand-in
conversation, as TRL's `GRPOTrainer` does: the conversation up to an assistant turn that calls tools, cut
after its end-of-turn token, and the same conversation with the tool messages and the generation prompt.
The suffix keeps the turn separator the template writes after each assistant turn (the `\\n` after
Qwen's `<|im_end|>`): the model never drew it, so dropping it would show the model a context it is never
shown at inference (verl PR #6921).

This holds only for a chat template that renders each conversation as a prefix of the next one
(`check_prefix_preserving`). Every render takes the run's `PromptOptions`, as the prompt's does, so that
the tool turns are the ones the template writes after that prompt (a keyword such as `enable_thinking` may
change them).
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from grpo_lightning.core.chat_template import PromptOptions, render_chat


def tool_messages(results: Sequence[tuple[str, str]], template_has_tools: bool) -> list[dict]:
    """The messages of one turn's tool results `(name, text)`: a `tool` message each where the chat template
    renders tools, else one user message of Hermes `<tool_response>` blocks (as Qwen2.5's template writes
    them), which any template renders."""
    if template_has_tools:
        return [{"role": "tool", "name": name, "content": text} for name, text in results]
    blocks = "\n".join(f"<tool_response>\n{text}\n</tool_response>" for _, text in results)
    return [{"role": "user", "content": blocks}]


def _render(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], generation_prompt: bool, options: PromptOptions
) -> list[int]:
    return render_chat(tokenizer, messages, options, tokenize=True, add_generation_prompt=generation_prompt)


def _calling_turn(name: str) -> list[dict]:
    """A stand-in conversation ending with an assistant turn that calls the tool `name` (some templates
    derive the tool turn's header from the call's name)."""
    call = {"type": "function", "function": {"name": name, "arguments": {}}}
    return [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]}]


def _cut_after_end_of_turn(ids: list[int], end_of_turn: int | None) -> list[int]:
    """`ids` up to and including their last `end_of_turn` token, as the model's turn ends; all of them
    when the template ends turns with another token."""
    ends = [i for i, token in enumerate(ids) if token == end_of_turn]
    return ids[: ends[-1] + 1] if ends else ids


def tool_suffix_ids(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], options: PromptOptions = PromptOptions()
) -> list[int]:
    """The ids that follow an assistant turn's end-of-turn token for the tool result `messages`
    (`tool_messages`): the separator after the turn, the results, the next assistant header, rendered with
    `options` (the run's `GRPOConfig.prompts`)."""
    name = messages[0].get("name", "tool")
    calling = _render(tokenizer, _calling_turn(name), False, options)
    before = _cut_after_end_of_turn(calling, tokenizer.eos_token_id)
    after = _render(tokenizer, _calling_turn(name) + messages, True, options)
    if after[: len(before)] != before:
        raise ValueError(_NOT_PREFIX)
    return after[len(before) :]


_NOT_PREFIX = (
    "the chat template does not render a conversation as the start of the conversation that follows it "
    "(an earlier turn changes when a tool turn is added), so tool turns cannot be appended token by token: "
    "set tokenizer.chat_template to a prefix-preserving template (TRL's "
    "`trl.chat_template_utils.get_training_chat_template(tokenizer)` gives one for known models)"
)


def check_prefix_preserving(
    tokenizer: PreTrainedTokenizerBase, template_has_tools: bool, options: PromptOptions = PromptOptions()
) -> None:
    """Refuse, in one line naming the fix, a chat template under which a conversation's ids are not the start
    of the next one's: the prompt of the generation prompt within the prompt with an assistant turn, and
    that (cut after its end-of-turn token) within the conversation with tool results and the next header."""
    prompt = [{"role": "user", "content": "x"}]
    answered = [*prompt, {"role": "assistant", "content": "y"}]
    first = _render(tokenizer, prompt, True, options)
    if _render(tokenizer, answered, False, options)[: len(first)] != first:
        raise ValueError(_NOT_PREFIX)
    tool_suffix_ids(tokenizer, tool_messages([("tool", "z")], template_has_tools), options)
