"""Each prompt through the decoder once per group, not G times (Prefix Grouper, arXiv:2506.05433).

The G completions of a group share their prompt, so the prompt's keys and values are the same in all G
rows. Here the prompt runs once per group, its per-layer keys and values are repeated to the group's rows,
and the completions run on top of them as a KV cache:

- scoring (`group_completion_logprobs`, with or without gradient): a forward of the distinct prompts that
  captures every layer's keys and values, then a forward of the completions that attends to them. The
  repeat is an index into the prompt tensors, so backward sums the G rows' gradients into the one prompt
  pass, which is exactly the gradient of G separate prompt passes. The log-probs equal
  `logprobs.completion_logprobs` on the concatenated rows up to rounding.
- generation (`sampling.prefill_groups`, beside the decoding it feeds): one forward of the distinct
  prompts but their last token into a `DynamicCache`, repeated to G rows; `generate` continues from it
  (vLLM's prefix caching does the same).

`sharing_unsupported` says when a model cannot share this way; the module then keeps the unshared path.
No Lightning here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn
from transformers import Cache, PreTrainedModel
from transformers.cache_utils import DynamicLayer
from transformers.modeling_layers import GradientCheckpointingLayer

from grpo_lightning.core.generation.logprobs import HeadOptions, head_logprobs, position_ids
from grpo_lightning.core.generation.model_abilities import cache_argument, not_full_attention
from grpo_lightning.core.types import Rollout

if TYPE_CHECKING:  # typing.Unpack is Python 3.11's
    from typing_extensions import Unpack


class _CapturedPrompt(DynamicLayer):
    """A cache layer that the prompt pass writes its keys and values into; attention sees them unchanged.

    It overwrites instead of appending: under gradient checkpointing, backward replays the layer and
    writes the same keys again (the prompt pass reads nothing back, so it never sees a stale entry).
    """

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        self.keys, self.values, self.is_initialized = key_states, value_states, True  # [n, heads, P, d]
        return key_states, value_states


class _SharedPrefix(DynamicLayer):
    """A read-only cache layer: the completions' keys and values are appended to the prompt's in the
    attention call only, never stored, so that a checkpointed layer's replay sees the same prefix."""

    def __init__(self, keys: Tensor, values: Tensor) -> None:
        super().__init__()
        self.keys, self.values, self.is_initialized = keys, values, True  # [b, heads, P, d]
        self.read = False

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        self.read = True
        return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)


def sharing_unsupported(model: nn.Module) -> str | None:
    """Why `model` cannot encode a group's prompt once, or None when it can."""
    if cache_argument(model) is None:
        return f"{type(model.get_decoder()).__name__}.forward takes no KV cache"
    if (reason := not_full_attention(model.config)) is not None:
        return reason
    checkpointed = any(layer.gradient_checkpointing for layer in _checkpointable_layers(model.get_decoder()))
    if checkpointed and not hasattr(GradientCheckpointingLayer, "_can_checkpoint_with_cache"):
        # Older transformers drop the cache inside a checkpointed layer: completions would not see the prompt.
        return "this transformers version drops the KV cache under gradient checkpointing"
    return None


def _checkpointable_layers(decoder: nn.Module) -> list[GradientCheckpointingLayer]:
    return [m for m in decoder.modules() if isinstance(m, GradientCheckpointingLayer)]


@contextmanager
def _cache_kept_under_checkpointing(decoder: nn.Module) -> Iterator[None]:
    """Let checkpointed decoder layers keep our caches, which are safe to replay (see the layer classes);
    transformers drops any cache inside a checkpointed layer otherwise."""
    layers = _checkpointable_layers(decoder)
    for layer in layers:
        # transformers' private class flag, set on the instance: no public switch keeps a cache through
        # a checkpointed layer.
        layer._can_checkpoint_with_cache = True
    try:
        yield
    finally:
        for layer in layers:
            del layer._can_checkpoint_with_cache


def _check_cache_used(model: nn.Module, used: bool) -> None:
    # A model that drops the cache somewhere (GPT-2 does under gradient checkpointing) would score the
    # completions without their prompt: stop rather than train on that.
    if not used:
        raise RuntimeError(
            f"{type(model.get_decoder()).__name__} ignored the KV cache of the shared prompt (gradient "
            "checkpointing?): set grpo.scoring.share_prompt=false for this model"
        )


def shared_prompt_hidden(
    model: PreTrainedModel,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    group: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
) -> Tensor:
    """The decoder's final hidden states `[b, T, H]` that predict each completion token, with each of the
    `n` distinct prompts `[n, P]` (left-padded) encoded once; row r's prompt is `prompt_ids[group[r]]`.

    Position t of row r equals position P - 1 + t of the unshared row prompt + completion: the same
    attention mask (left padding, and zeros after the completion's EOS) and the same position ids.
    """
    decoder = model.get_decoder()
    cache_kwarg = cache_argument(model)
    P, T = prompt_ids.size(1), completion_ids.size(1)
    prompt_cache = Cache(layers=[_CapturedPrompt() for _ in range(model.config.num_hidden_layers)])
    with _cache_kept_under_checkpointing(decoder):
        prompt_hidden = decoder(
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            position_ids=position_ids(prompt_mask),
            **{cache_kwarg: prompt_cache},
        ).last_hidden_state  # [n, P, H]
        _check_cache_used(model, all(layer.is_initialized for layer in prompt_cache.layers))
        hidden = prompt_hidden[group, -1:]  # [b, 1, H] the last prompt token predicts completion token 0
        if T == 1:
            return hidden
        # Indexing repeats each prompt's keys and values to its rows; backward sums the rows' gradients.
        layers = [_SharedPrefix(layer.keys[group], layer.values[group]) for layer in prompt_cache.layers]
        prefix = Cache(layers=layers)
        mask = torch.cat([prompt_mask[group], completion_mask], dim=1)[:, :-1]  # [b, P+T-1]
        completion_hidden = decoder(
            input_ids=completion_ids[:, :-1],  # the last completion token predicts nothing that is scored
            attention_mask=mask,
            position_ids=position_ids(mask)[:, P:],
            **{cache_kwarg: prefix},
        ).last_hidden_state  # [b, T-1, H]
        _check_cache_used(model, all(layer.read for layer in layers))
    return torch.cat([hidden, completion_hidden], dim=1)  # [b, T, H]


def group_completion_logprobs(
    model: PreTrainedModel,
    rollout: Rollout,
    rows: slice,
    num_generations: int,
    **head: Unpack[HeadOptions],
) -> tuple[Tensor, Tensor]:
    """`logprobs.completion_logprobs` of `rollout`'s `rows`, each group's prompt encoded once.

    `rows` may cut groups (a micro-batch smaller than G, or not a multiple of it): every group it touches
    gets one prompt pass. Returns `(logprobs, entropies)`, each `[b, T]` float32, as `completion_logprobs`.
    """
    G = num_generations
    start, stop, step = rows.indices(rollout.completion_ids.size(0))
    if step != 1 or stop <= start:
        raise ValueError(f"rows must be a non-empty contiguous slice, got {rows}")
    first = start // G
    row_group = torch.arange(start, stop, device=rollout.prompt_ids.device) // G - first  # [b]
    prompt_ids = rollout.prompt_ids[first * G : stop : G]  # [n, P] the first row of each group
    prompt_mask = rollout.prompt_mask[first * G : stop : G]  # [n, P]
    if not torch.equal(prompt_ids[row_group], rollout.prompt_ids[rows]):
        raise ValueError(f"the rows of a group of {G} do not share their prompt: is num_generations right?")
    completion_ids = rollout.completion_ids[rows]  # [b, T]
    hidden = shared_prompt_hidden(
        model, prompt_ids, prompt_mask, row_group, completion_ids, rollout.completion_mask[rows]
    )  # [b, T, H]
    return head_logprobs(model, hidden, completion_ids, **head)
