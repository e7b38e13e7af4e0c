"""The chat template's one call: `PromptOptions` (how chat messages become the policy's text, the keyword
arguments of every render) and `render_chat`, which every render of a run goes through (the prompts, the
tool turns, the check that a template shows tools), so that they all read the same text.

No Lightning here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from grpo_lightning.core.options import check_fields


@dataclass(frozen=True)
class PromptOptions:
    """How chat prompts become the policy's text (`GRPOConfig.prompts`)."""

    chat_template_kwargs: dict[str, Any] | None = None
    """Keyword arguments given to every `apply_chat_template` call of the run (its prompts, its tool turns,
    its evaluations), as TRL's `chat_template_kwargs`: e.g. `{"enable_thinking": false}` for Qwen3's
    template, which then opens the answer with an empty thinking block. Default None: the template's own
    defaults.
    """

    def __post_init__(self) -> None:
        check_fields(self)


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict],
    options: PromptOptions,
    *,
    tokenize: bool,
    add_generation_prompt: bool,
    tools: Sequence[dict] | None = None,
) -> str | list[int]:
    """`messages` through `tokenizer`'s chat template with `options`' keyword arguments: the text, or its
    token ids when `tokenize`. `tools`: the schemas for the template's `tools`."""
    rendered = tokenizer.apply_chat_template(
        messages,
        tools=None if tools is None else list(tools),
        tokenize=tokenize,
        add_generation_prompt=add_generation_prompt,
        return_dict=False,
        **(options.chat_template_kwargs or {}),
    )
    return list(rendered) if tokenize else rendered
