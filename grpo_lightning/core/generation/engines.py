"""The rollout seam: prompts in, sampled completions and their log-probs out.

- `SamplingSettings` (`sampling.py`): what every sampled token obeys (length bounds, stop ids,
  temperature, top-p/k).
- `RolloutEngine`: how completions are generated from token ids (`EagerEngine`: Hugging Face `generate`
  with a dynamic KV cache). The trainer tells it when the weights change (`weights_changed`: an optimizer
  step, a checkpoint load); an engine that keeps its own inference copy of them (a static cache compiled
  for a GPU, vLLM's) takes the new ones once, before its next rollout (`refresh`), and frees what it holds
  in `close`. Every sampled rollout carries the log-prob of each drawn token under the distribution it
  was drawn from (`Rollout.sampler_logprobs`), and the engine reports its speed (`metrics`).
- `PromptSampler`: text or chat prompts -> token ids (`PromptEncoder`: chat template, `max_prompt_length`)
  -> the engine -> the `Rollout` and its decoded completions. Training, validation and
  `evaluation.generate_answers` all sample through it.
- `LogProbScorer`: the per-token log-probs (and entropies) of a rollout's completions under a model, each
  group's prompt encoded once when the policy can share it, inside the root's FSDP hooks when the caller
  says how (sharded models: `io.distributed.call_in_root_forward`).

No Lightning here: these take a `PreTrainedModel` (or a PEFT wrapper of one), a tokenizer and tensors.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo_lightning.core.generation.logprobs import completion_logprobs
from grpo_lightning.core.generation.sampling import (
    COMPACT_ABOVE_ROWS,
    SamplingSettings,
    generate_completions,
    prefill_groups,
)
from grpo_lightning.core.generation.shared_prompt import group_completion_logprobs
from grpo_lightning.core.options import check_fields
from grpo_lightning.core.types import Rollout

Prompt = str | list[dict[str, str]]  # plain text, or chat messages


class RolloutEngine(Protocol):
    """Generates completion groups from left-padded prompt ids; the trainer tells it when weights change."""

    settings: SamplingSettings

    def generate(
        self,
        model: PreTrainedModel,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        *,
        num_generations: int,
        do_sample: bool = True,
        settings: SamplingSettings | None = None,
    ) -> Rollout:
        """`num_generations` completions for each prompt of `prompt_ids` `[N, P]` (left-padded): a `Rollout`
        of `N * num_generations` rows, prompt i's group in rows i*G .. i*G+G-1; greedy unless `do_sample`.
        `settings`: this call's, instead of the engine's (an evaluation's length or temperature)."""
        ...

    def weights_changed(self) -> None:
        """The policy's weights changed (an optimizer step, a checkpoint load): the next rollout samples the
        new ones. Cheap: an engine with a copy of its own takes them in `refresh`, once."""
        ...

    def refresh(self, model: PreTrainedModel, device: torch.device) -> None:
        """Make the next `generate` sample from `model`'s current weights, if it keeps a copy of its own (a
        collective under FSDP2: every rank calls it at the same point). `generate` calls it too."""
        ...

    def metrics(self) -> dict[str, float]:
        """The last call's `tokens_per_second` and `ms_per_decoding_step`, and what else the engine counts."""
        ...

    @property
    def reads_live_weights(self) -> bool:
        """Whether `generate` reads `model`'s own weights (the caller gathers sharded weights around it), or a
        copy of the engine's own, which `refresh` fills."""
        return True

    def close(self) -> None:
        """Free what the engine holds outside Python's reach (vLLM's engine); nothing by default."""


def rollout_speed(rollout: Rollout, decoding_steps: int, seconds: float) -> dict[str, float]:
    """Completion tokens per second of one `generate` call that ran `decoding_steps` steps (one per column)
    in `seconds`, and milliseconds per step. Reading the mask waits for the device."""
    tokens = int(rollout.completion_mask.sum())
    seconds = max(seconds, 1e-9)
    return {
        "tokens_per_second": tokens / seconds,
        "ms_per_decoding_step": 1000 * seconds / max(decoding_steps, 1),
    }


class EagerEngine(RolloutEngine):
    """`generate` with a dynamic KV cache on the live model: nothing to refresh when the weights change.

    Samples the raw policy (`sampling.generate_completions`) under the caller's autocast; with
    `settings.share_prompt` each distinct prompt is prefilled once and its cache repeated to the group
    (`sampling.prefill_groups`). `compact_above_rows`: a call of more rows than this stops decoding its
    finished rows once half have ended (`sampling.generate_completions`); None decodes every row until the
    longest ends.
    """

    def __init__(
        self, settings: SamplingSettings, compact_above_rows: int | None = COMPACT_ABOVE_ROWS
    ) -> None:
        self.settings = settings
        self.compact_above_rows = compact_above_rows
        self.last_speed: dict[str, float] = {}

    @torch.no_grad()
    def generate(self, model, prompt_ids, prompt_mask, *, num_generations, do_sample=True, settings=None):
        # The argument types are RolloutEngine.generate's.
        s = settings or self.settings
        start = time.perf_counter()
        prefill = prefill_groups(model, prompt_ids, prompt_mask, num_generations) if s.share_prompt else None
        rollout = generate_completions(
            model,
            prompt_ids,  # [N, P]
            prompt_mask,  # [N, P]
            s,
            num_generations=num_generations,
            do_sample=do_sample,
            prompt_cache=prefill,
            compact_above_rows=self.compact_above_rows,
        )
        self.last_speed = rollout_speed(rollout, rollout.completion_ids.size(1), time.perf_counter() - start)
        return rollout

    def weights_changed(self) -> None:
        """Nothing to do: `generate` reads the live weights."""

    def refresh(self, model: PreTrainedModel, device: torch.device) -> None:
        """Nothing to do: `generate` reads the live weights."""

    def metrics(self) -> dict[str, float]:
        return dict(self.last_speed)


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
        truncate_prompts: "left" cuts a longer prompt's start (with a warning), "error" refuses it.
    """

    tokenizer: PreTrainedTokenizerBase
    max_prompt_length: int | None = None
    truncate_prompts: str = "left"

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
                tok.apply_chat_template(p, tools=t, tokenize=False, add_generation_prompt=True)
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


def rows_share_prompts(rollout: Rollout, num_generations: int) -> bool:
    """Whether every run of `num_generations` rows of `rollout` holds one prompt, as sampled groups do."""
    ids, G = rollout.prompt_ids, num_generations  # [B, P]
    if ids.size(0) % G:
        return False
    groups = ids.view(-1, G, ids.size(1))  # [N, G, P]
    return torch.equal(groups, groups[:, :1].expand_as(groups))


@dataclass
class LogProbScorer:
    """Per-token log-probs (and entropies) of a rollout's completions under a model, float32 `[b, T]`.

    Args:
        num_generations: the group size G of the rollouts it scores.
        temperature: scales the logits as the sampler saw them.
        share_prompt: encode each group's prompt once (`shared_prompt.group_completion_logprobs`) when the
            scored rows hold whole groups of one prompt.
        entropy_grad: let the gradient flow through the entropies (an entropy bonus in the loss).
        in_root_forward: runs `(model, fn, *args)` as the model's forward; for a sharded model, so that the
            root's FSDP hooks gather the embeddings and LM head (`io.distributed.call_in_root_forward`).
            None calls `fn` directly.
    """

    num_generations: int
    temperature: float = 1.0
    share_prompt: bool = False
    entropy_grad: bool = False
    in_root_forward: Callable | None = None

    def __call__(
        self, model: PreTrainedModel, rollout: Rollout, rows: slice, with_entropy: bool = False
    ) -> tuple[Tensor, Tensor]:
        """`(logprobs, entropies)` of `rollout`'s `rows`, each `[b, T]`; entropies are zeros unless asked."""
        G = self.num_generations
        if self.share_prompt and rows_share_prompts(rollout, G):
            scorer, inputs = group_completion_logprobs, (rollout, rows, G)
        else:
            inputs = (rollout.input_ids[rows], rollout.attention_mask[rows], rollout.completion_ids.size(1))
            scorer = completion_logprobs
        options = dict(with_entropy=with_entropy, entropy_grad=with_entropy and self.entropy_grad)
        if self.in_root_forward is not None:
            return self.in_root_forward(
                model, scorer, model, *inputs, temperature=self.temperature, **options
            )
        return scorer(model, *inputs, temperature=self.temperature, **options)


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


@dataclass(frozen=True)
class ScoringOptions:
    """How the reference, old-policy and policy passes lay out their rows (`GRPOConfig.scoring`)."""

    share_prompt: bool = True
    """Encode each prompt once per group instead of once per completion, in generation (one prefill per
    prompt, its KV cache repeated to the G rows) and in the reference, old-policy and policy passes (the G
    completions attend to one prompt pass, whose gradient sums theirs); Prefix Grouper, arXiv:2506.05433.
    Same log-probs and gradients up to rounding (tests/test_share_prompt.py). A model that cannot share
    (attention without a KV cache, a sliding window in any layer, gradient checkpointing in transformers < 5)
    keeps the unshared path, with a warning.
    """
    packed_sequences: bool = True
    """Pack the reference, old-policy and policy passes: each micro-batch's rows laid end to end in a few
    lines (their prompts and completions, padding only where a line ends), kept apart by one attention
    mask, with position ids restarting at each row; with `share_prompt` a line holds a group's prompt once
    and several of its completions. The LM head runs on the completion tokens only. Same log-probs and
    gradients up to rounding (tests/test_packing.py). On MATH-like rollouts with `share_prompt` and the
    token budget the decoder computes 0.99 positions per token of the rows instead of 1.58
    (`benchmarks/token_budget.py --group`). Needs sdpa or eager attention and full attention in every layer:
    another model (flash attention, a sliding window in any layer) keeps the padded passes, with a warning
    (`grpo_lightning.core.generation.packing`). TRL: `padding_free`; verl: `use_remove_padding`.
    """

    def __post_init__(self) -> None:
        check_fields(self)
