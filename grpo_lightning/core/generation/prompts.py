"""Prompts in, text out, around an engine: `PromptEncoder` (text or chat prompts -> left-padded token ids:
the chat template with the run's `PromptOptions`, `max_prompt_length`; completion ids -> text) and
`PromptSampler` (the encoder, then the engine, then the decoded completions),
the one sampling path of training, validation and `evaluation.generate_answers`; `warn_if_unteachable` says
when a rollout's decoded completions cannot teach anything.

No Lightning here.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo_lightning.core.chat_template import PromptOptions, render_chat
from grpo_lightning.core.generation.engines import RolloutEngine
from grpo_lightning.core.generation.sampling import SamplingSettings
from grpo_lightning.core.types import Rollout

Prompt = str | list[dict[str, str]]  # plain text, or chat messages


@contextmanager
def left_padded(tokenizer: PreTrainedTokenizerBase) -> Iterator[PreTrainedTokenizerBase]:
    """Left padding and a pad token for batched generation, restoring the caller's settings afterwards
    (another module may well train with right padding)."""
    side, pad = tokenizer.padding_side, tokenizer.pad_token
    tokenizer.padding_side = "left"
    if pad is None:
        tokenizer.pad_token = tokenizer.eos_token
    try:
        yield tokenizer
    finally:
        tokenizer.padding_side = side
        if pad is None:
            tokenizer.pad_token = pad


def check_chat_template(tokenizer: PreTrainedTokenizerBase) -> None:
    """Chat prompts need a template: one clear error instead of a failure inside `apply_chat_template`."""
    if not tokenizer.chat_template:
        raise ValueError(
            "the tokenizer has no chat template but the prompts are chat messages: set "
            "`tokenizer.chat_template` (e.g. copy the instruct model's), or use plain-text prompts"
        )


@dataclass
class PromptEncoder:
    """Prompts (text or chat messages) -> left-padded token ids, and completion ids -> text.

    Args:
        tokenizer: applies the chat template, tokenizes and decodes.
        max_prompt_length: prompt tokens kept; None keeps all.
        truncate_prompts: "left" cuts a longer prompt's start (with a warning), "error" refuses it; a chat
            prompt that opens with a system turn or shows tools is refused, never cut.
        options: how chat prompts are rendered (`GRPOConfig.prompts`: the chat template's keyword
            arguments).
    """

    tokenizer: PreTrainedTokenizerBase
    max_prompt_length: int | None = None
    truncate_prompts: str = "left"
    options: PromptOptions = field(default_factory=PromptOptions)

    def encode(
        self,
        prompts: Sequence[Prompt],
        device: torch.device | str,
        tools: Sequence[Sequence[dict]] | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Apply the chat template to conversational prompts and tokenize, left-padded: `[N, P]` each.
        `tools`: each prompt's tool schemas, for the template's `tools` (a multi-turn rollout's)."""
        tok = self.tokenizer
        conversational = isinstance(prompts[0], list)
        if conversational:
            check_chat_template(tok)
        shown = [None] * len(prompts) if tools is None else [list(t) for t in tools]
        texts = (
            [
                render_chat(tok, p, self.options, tokenize=False, add_generation_prompt=True, tools=t)
                for p, t in zip(prompts, shown, strict=True)
            ]
            if conversational
            else list(prompts)
        )
        with left_padded(tok):
            enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=not conversational)
        ids, mask = enc["input_ids"].to(device), enc["attention_mask"].to(device)  # [N, P]
        limit = self.max_prompt_length
        if limit is not None and ids.size(1) > limit:
            longest = int(mask.sum(1).max())
            if self.truncate_prompts == "error":
                raise ValueError(f"a prompt has {longest} tokens, over max_prompt_length={limit}")
            lengths = mask.sum(1).tolist()  # [N]
            for prompt, schemas, length in zip(prompts, shown, lengths, strict=True):
                if length > limit and conversational and (schemas or prompt[0].get("role") == "system"):
                    what = "shows tools" if schemas else "opens with a system turn"
                    raise ValueError(
                        f"a prompt that {what} has {length} tokens, over max_prompt_length={limit}: a cut "
                        "from the left would drop it first; raise max_prompt_length or set it to None"
                    )
            warnings.warn(
                f"prompt of {longest} tokens cut from the left to max_prompt_length={limit}", stacklevel=2
            )
            ids, mask = (
                ids[:, -limit:],
                mask[:, -limit:],
            )  # left padding: the last `limit` columns hold the ends
        return ids, mask

    def decode(self, rollout: Rollout) -> list[str]:
        """The completions' text, special tokens skipped."""
        return self.tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)


@dataclass
class PromptSampler:
    """Prompts -> `encoder` -> `engine` -> (`Rollout`, decoded completions): the one sampling path of
    training, validation and `evaluation.generate_answers`. `settings`: the sampling of its calls, when not
    the engine's own (an evaluation's length and temperature)."""

    encoder: PromptEncoder
    engine: RolloutEngine
    settings: SamplingSettings | None = None

    def sample(
        self,
        model: PreTrainedModel,
        prompts: Sequence[Prompt],
        num_generations: int,
        *,
        do_sample: bool = True,
        device: torch.device | str | None = None,
    ) -> tuple[Rollout, list[str]]:
        """`num_generations` completions per prompt (greedy unless `do_sample`), and their text.
        `device`: where the prompt ids go; default the model's."""
        ids, mask = self.encoder.encode(
            prompts, device if device is not None else next(model.parameters()).device
        )
        rollout = self.engine.generate(
            model, ids, mask, num_generations=num_generations, do_sample=do_sample, settings=self.settings
        )
        return rollout, self.encoder.decode(rollout)


def warn_if_unteachable(
    rollout: Rollout,
    completions: list[str],
    eos_token_ids: Sequence[int],
    max_new_tokens: int,
    *,
    tokenizer_size: int,
    vocab_size: int,
) -> None:
    """Warn when a rollout cannot teach anything: every completion empty (saying whether the policy ended
    at once or wrote tokens that decode to nothing), or every one cut off."""
    if not any(text.strip() for text in completions):
        lengths = rollout.completion_mask.sum(dim=1)  # [B] tokens, the EOS included
        ended_at_once = int(((lengths == 1) & ~rollout.truncated).sum())
        if ended_at_once == len(completions):
            cause = (
                "the policy ends at once; check the chat template and the end-of-sequence ids "
                f"{list(eos_token_ids)}"
            )
        else:
            written, tokens = len(completions) - ended_at_once, int(lengths.sum())
            cause = (
                f"{written} have tokens ({tokens} in all) that decode to nothing (whitespace, special "
                f"tokens, or ids past the tokenizer's {tokenizer_size}: the model's vocabulary has "
                f"{vocab_size})" + (f", {ended_at_once} end at once" if ended_at_once else "")
            )
        warnings.warn(
            f"all {len(completions)} completions of this step are empty: {cause}",
            stacklevel=3,
        )
    elif bool(rollout.truncated.all()):
        warnings.warn(
            f"all {len(completions)} completions of this step reached max_completion_length="
            f"{max_new_tokens} without an end-of-sequence token: answers are cut off "
            "before their final line; raise grpo.sampling.max_completion_length",
            stacklevel=3,
        )
