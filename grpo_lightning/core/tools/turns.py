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

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from itertools import groupby

from transformers import PreTrainedTokenizerBase

from grpo_lightning.core.chat_template import PromptOptions, render_chat
from grpo_lightning.core.tools.formats import result_message
from grpo_lightning.core.tools.templates import trl_chat_templates, trl_template_name, trl_training_template


def tool_messages(results: Sequence[tuple[str, str | list]], template_has_tools: bool) -> list[dict]:
    """The messages of one turn's tool results `(name, content)`: TRL's `tool` message each where the chat
    template renders tools, else one user message of Hermes `<tool_response>` blocks (as Qwen2.5's template
    writes them), which any template renders."""
    if template_has_tools:
        return [result_message(name, content) for name, content in results]
    blocks = "\n".join(f"<tool_response>\n{text}\n</tool_response>" for _, text in results)
    return [{"role": "user", "content": blocks}]


def with_tool_turns_as_user_turns(messages: list[dict]) -> list[dict]:
    """`messages` with each run of `tool` messages (a prompt's worked example, `data.few_shot`) as
    `tool_messages` writes results for a chat template that shows no tools, so that the example reads as the
    rollout's own tool turns will."""
    out: list[dict] = []
    for is_tool, run in groupby(messages, key=lambda message: message.get("role") == "tool"):
        run = list(run)
        out += tool_messages([(m.get("name", ""), m["content"]) for m in run], False) if is_tool else run
    return out


def _render(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], generation_prompt: bool, options: PromptOptions
) -> list[int]:
    return render_chat(tokenizer, messages, options, tokenize=True, add_generation_prompt=generation_prompt)


def _calling_turn(name: str, arguments: dict | str) -> list[dict]:
    """A stand-in conversation ending with an assistant turn that calls the tool `name` (some templates
    derive the tool turn's header from the call's name). TRL's words: where the end-of-sequence token also
    opens a user turn, the suffix starts after that earlier one and holds the user's words."""
    call = {"type": "function", "function": {"name": name, "arguments": arguments}}
    return [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": [call]}]


def _render_call(
    tokenizer: PreTrainedTokenizerBase, name: str, following: list[dict], options: PromptOptions
) -> tuple[list[int], list[int]]:
    """The ids of the stand-in conversation calling `name`, and of it with the `following` messages and the
    generation prompt; the call's arguments as a JSON string where the template cannot take a mapping (it
    adds them to a string: DeepSeek-V3's), as TRL falls back."""

    def both(arguments: dict | str) -> tuple[list[int], list[int]]:
        conversation = _calling_turn(name, arguments)
        return _render(tokenizer, conversation, False, options), _render(
            tokenizer, conversation + following, True, options
        )

    try:
        return both({})
    except TypeError:
        return both("{}")


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
    calling, after = _render_call(tokenizer, messages[0].get("name", "tool"), messages, options)
    before = _cut_after_end_of_turn(calling, tokenizer.eos_token_id)
    if after[: len(before)] != before:
        raise ValueError(_not_prefix(tokenizer, before, after))
    return after[len(before) :]


def _not_prefix(tokenizer: PreTrainedTokenizerBase, before: list[int], after: list[int]) -> str:
    """One line: the template is not prefix-preserving, where the two renders part, and the fix."""
    shorter = min(len(before), len(after))
    at = next((i for i in range(shorter) if before[i] != after[i]), shorter)
    was, becomes = tokenizer.decode(before[at : at + 8]), tokenizer.decode(after[at : at + 8])
    return (
        "the chat template does not render a conversation as the start of the conversation that follows it "
        f"(once a tool's result follows an assistant turn, the turn's token {at} changes: {was!r} becomes "
        f"{becomes!r}), so tool turns cannot be appended token by token: set tokenizer.chat_template to a "
        "prefix-preserving template (TRL's `trl.chat_template_utils.get_training_chat_template(tokenizer)` "
        "gives one for the models it ships templates of)"
    )


def _preserves_prefix(
    tokenizer: PreTrainedTokenizerBase, template_has_tools: bool, options: PromptOptions
) -> tuple[bool, list[int], list[int]]:
    """TRL's test (`trl.chat_template_utils.is_chat_template_prefix_preserving`): the conversation up to an
    assistant turn calling a tool renders as the start of the same conversation with the tool's result and
    the next assistant header. With the renders it compared."""
    result = tool_messages([("tool", "z")], template_has_tools)
    calling, answered = _render_call(tokenizer, "tool", result, options)
    return answered[: len(calling)] == calling, calling, answered


def check_prefix_preserving(
    tokenizer: PreTrainedTokenizerBase, template_has_tools: bool, options: PromptOptions = PromptOptions()
) -> None:
    """Refuse, in one line naming where the renders part and the fix, a chat template under which the
    conversation up to a tool call is not the start of the conversation with its result (TRL's test)."""
    preserved, calling, answered = _preserves_prefix(tokenizer, template_has_tools, options)
    if not preserved:
        raise ValueError(_not_prefix(tokenizer, calling, answered))
    tool_suffix_ids(tokenizer, tool_messages([("tool", "z")], template_has_tools), options)


def training_template(
    tokenizer: PreTrainedTokenizerBase, template_has_tools: bool, options: PromptOptions = PromptOptions()
) -> str | None:
    """The chat template a run with tools trains with, as TRL chooses it: None where the tokenizer's own
    passes `check_prefix_preserving`; else TRL's training copy of it (`trl/chat_templates/<name>_training
    .jinja`, loaded from the installed `trl` package: Qwen3's shipped template, for one), checked in turn.
    A template that neither passes nor has a training copy that passes is refused, naming where its
    renders part (and TRL, where it is not installed)."""
    preserved, calling, answered = _preserves_prefix(tokenizer, template_has_tools, options)
    if preserved:
        check_prefix_preserving(tokenizer, template_has_tools, options)
        return None
    training = trl_training_template(tokenizer.chat_template)
    if training is None:
        problem = _not_prefix(tokenizer, calling, answered)
        if not trl_chat_templates():
            problem += " (TRL is not installed: `pip install trl` ships training copies of known templates)"
        raise ValueError(problem)
    shipped = tokenizer.chat_template
    tokenizer.chat_template = training
    try:
        check_prefix_preserving(tokenizer, template_has_tools, options)
    finally:
        tokenizer.chat_template = shipped
    return training


def training_template_note(chat_template: str | dict | None) -> str:
    """The one line a run says when it trains with TRL's training copy of `chat_template`."""
    return (
        f"the chat template ({trl_template_name(chat_template)}) rewrites an earlier turn when a tool's "
        "result follows: training with TRL's prefix-preserving training copy of it, as TRL does"
    )


@contextmanager
def rendering_with(tokenizer: PreTrainedTokenizerBase, chat_template: str | None) -> Iterator[None]:
    """Every render inside uses `chat_template` (a `training_template`; None: the tokenizer's own), and the
    tokenizer's own is back afterwards, so that what a checkpoint or an export saves is the template the
    model shipped with, as TRL passes its training template to each render rather than keeping it."""
    if chat_template is None:
        yield
        return
    shipped = tokenizer.chat_template
    tokenizer.chat_template = chat_template
    try:
        yield
    finally:
        tokenizer.chat_template = shipped
