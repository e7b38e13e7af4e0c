"""Batched generation of completion groups and per-token log-probabilities of Hugging Face causal LMs.

No Lightning here: these functions take a `PreTrainedModel` (or a PEFT wrapper of one) and tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint
from transformers import GenerationConfig, PreTrainedModel


@dataclass
class Rollout:
    """G sampled completions for each of N prompts, prompt i's group in rows i*G .. i*G+G-1."""

    prompt_ids: Tensor  # [N*G, P] left-padded
    prompt_mask: Tensor  # [N*G, P]
    completion_ids: Tensor  # [N*G, T] right-padded with the pad token
    completion_mask: Tensor  # [N*G, T] 1 up to and including the first EOS
    truncated: Tensor  # [N*G] bool: no EOS within max_new_tokens

    @property
    def input_ids(self) -> Tensor:  # [N*G, P+T]
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    @property
    def attention_mask(self) -> Tensor:  # [N*G, P+T]
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1)


def completion_mask_from_ids(completion_ids: Tensor, eos_token_ids: list[int]) -> tuple[Tensor, Tensor]:
    """Mask of the tokens up to and including each row's first EOS, and which rows never emitted one."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos_token_ids, device=completion_ids.device))  # [B, T]
    has_eos = is_eos.any(dim=1)  # [B]
    first_eos = torch.where(has_eos, is_eos.int().argmax(dim=1), completion_ids.size(1))  # [B]
    positions = torch.arange(completion_ids.size(1), device=completion_ids.device)  # [T]
    mask = (positions[None, :] <= first_eos[:, None]).long()  # [B, T]
    return mask, ~has_eos


@torch.no_grad()
def generate_completions(
    model: PreTrainedModel,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    *,
    num_generations: int,
    max_new_tokens: int,
    eos_token_ids: list[int],
    pad_token_id: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_new_tokens: int = 0,
    do_sample: bool = True,
) -> Rollout:
    """Sample `num_generations` completions per prompt in one batched `generate` call with KV cache."""
    prompt_ids = prompt_ids.repeat_interleave(num_generations, dim=0)  # [N*G, P]
    prompt_mask = prompt_mask.repeat_interleave(num_generations, dim=0)  # [N*G, P]
    # A fresh config so that a checkpoint's own sampling defaults (e.g. top_k=20) never leak in.
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        min_new_tokens=min_new_tokens,
        do_sample=do_sample,
        temperature=temperature if do_sample else None,
        top_p=top_p if do_sample else None,
        top_k=top_k if do_sample else None,
        eos_token_id=eos_token_ids,
        pad_token_id=pad_token_id,
        use_cache=True,
    )
    was_training = model.training
    model.eval()  # no dropout while sampling, and gradient checkpointing would switch the KV cache off
    try:
        output = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config)
    finally:
        model.train(was_training)
    completion_ids = output[:, prompt_ids.size(1) :]  # [N*G, T]
    completion_mask, truncated = completion_mask_from_ids(completion_ids, eos_token_ids)
    completion_ids = completion_ids.masked_fill(completion_mask == 0, pad_token_id)
    return Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, truncated)


def _token_logprobs_and_entropy(
    head: torch.nn.Module, hidden: Tensor, targets: Tensor, temperature: float, with_entropy: bool
) -> tuple[Tensor, Tensor]:
    logits = head(hidden).float() / temperature  # [C, V] float32, only C rows of the vocabulary at once
    log_z = logits.logsumexp(dim=-1)  # [C]
    logprobs = logits.gather(-1, targets[:, None]).squeeze(-1) - log_z  # [C]
    if not with_entropy:
        return logprobs, torch.zeros_like(logprobs)
    probs = torch.softmax(logits, dim=-1)  # [C, V]
    entropy = log_z - (probs * logits).sum(dim=-1)  # [C]
    return logprobs, entropy


def completion_logprobs(
    model: PreTrainedModel,
    input_ids: Tensor,
    attention_mask: Tensor,
    num_completion_tokens: int,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    max_logits_elements: int = 2**26,
) -> tuple[Tensor, Tensor]:
    """Per-token log-probs (and entropies) of the last `num_completion_tokens` tokens, in float32.

    The decoder runs once over the whole sequence, but the LM head only over the completion positions,
    and in chunks of at most `max_logits_elements` logits (2**26 floats = 256 MiB): a 150k vocabulary
    never materialises `[B, T, V]` in float32. With gradients on, each chunk is checkpointed so that its
    logits are recomputed in backward instead of being kept alive.

    Returns `(logprobs, entropies)`, each `[B, T]` float32; entropies are zeros unless `with_entropy`.
    """
    T = num_completion_tokens
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # [B, L, H]
    hidden = hidden[:, -T - 1 : -1]  # [B, T, H] position t predicts token t+1
    targets = input_ids[:, -T:]  # [B, T]
    head = model.get_output_embeddings()
    rows = hidden.reshape(-1, hidden.size(-1))  # [B*T, H]
    flat_targets = targets.reshape(-1)  # [B*T]
    chunk = max(1, max_logits_elements // head.weight.size(0))
    use_checkpoint = torch.is_grad_enabled() and rows.requires_grad
    logprobs, entropies = [], []
    for start in range(0, rows.size(0), chunk):
        h, y = rows[start : start + chunk], flat_targets[start : start + chunk]
        if use_checkpoint:
            lp, ent = checkpoint(
                _token_logprobs_and_entropy, head, h, y, temperature, with_entropy, use_reentrant=False
            )
        else:
            lp, ent = _token_logprobs_and_entropy(head, h, y, temperature, with_entropy)
        logprobs.append(lp)
        entropies.append(ent if entropy_grad else ent.detach())
    shape = targets.shape
    return torch.cat(logprobs).view(shape), torch.cat(entropies).view(shape)
