"""Per-token log-probabilities of a rollout's completions under a Hugging Face causal LM, as the loss
reads them: positions that count real tokens, the LM head on completion positions only, chunked, in
float32, with the logit transforms some families apply (Cohere's scale, Granite's divisor, soft-capping).

No Lightning here: these functions take a `PreTrainedModel` (or a PEFT wrapper of one) and tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypedDict

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

if TYPE_CHECKING:  # typing.Unpack is Python 3.11's
    from typing_extensions import Unpack


def position_ids(attention_mask: Tensor) -> Tensor:
    """Positions `[B, L]` that count real tokens only, as `generate` numbers them.

    With left padding, arange positions would shift a shorter prompt's tokens: rotary models do not mind,
    models with absolute position embeddings (GPT-2, OPT) would score completions they never sampled.
    """
    return (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)


def _entropy(logits: Tensor, log_z: Tensor) -> Tensor:
    probs = torch.exp(logits - log_z[:, None])  # [C, V]
    return log_z - (probs * logits).sum(dim=-1)  # [C]


LogitTransform = Callable[[Tensor], Tensor]


class HeadOptions(TypedDict, total=False):
    """How the LM head scores tokens: `head_logprobs`' keywords, which every scorer built on it forwards."""

    temperature: float  # scales the logits as the sampler saw them
    with_entropy: bool  # also return each position's entropy
    entropy_grad: bool  # let the gradient flow through the entropies
    max_logits_elements: int  # logits per chunk of the head


def head_logit_transform(model: PreTrainedModel) -> LogitTransform | None:
    """What the model's `forward` does to the LM head's output before it returns the logits that `generate`
    samples from; None for a plain head (nearly every causal LM).

    Gemma 2/3 soft-cap them (`final_logit_softcapping`: c * tanh(x / c)), Cohere multiplies by
    `logit_scale`, Granite divides by `logits_scaling`. Another config carrying one of those names is
    refused: the same name means a different operation elsewhere (HyperCLOVAX multiplies by
    `logits_scaling`), and scoring other logits than the sampled ones would bias every ratio silently.
    """
    config = model.config.get_text_config(decoder=True)
    family = config.model_type
    scale = 1.0  # the head's logits are multiplied by it, then soft-capped
    if family.startswith("cohere") and getattr(config, "logit_scale", None) is not None:
        scale = config.logit_scale
    elif family.startswith("granite") and getattr(config, "logits_scaling", None) is not None:
        scale = 1 / config.logits_scaling
    else:
        for name in ("logit_scale", "logits_scaling"):
            if getattr(config, name, None) not in (None, 1, 1.0):
                raise ValueError(
                    f"{type(model).__name__} ({family}) has `{name}={getattr(config, name)}` in its config: "
                    "its forward may change the logits after the LM head in a way grpo-lightning does not "
                    "reproduce, so its log-probs would not be those it samples from; not supported"
                )
    cap = getattr(config, "final_logit_softcapping", None)
    if scale == 1.0 and cap is None:
        return None

    def transform(logits: Tensor) -> Tensor:
        logits = logits * scale if scale != 1.0 else logits
        return torch.tanh(logits / cap) * cap if cap is not None else logits

    return transform


def _token_logprobs_and_entropy(
    head: torch.nn.Module,
    hidden: Tensor,
    targets: Tensor,
    temperature: float,
    with_entropy: bool,
    transform: LogitTransform | None = None,
) -> tuple[Tensor, Tensor]:
    logits = head(hidden).float()  # [C, V] float32, only C rows of the vocabulary at once
    logits = (transform(logits) if transform is not None else logits) / temperature  # [C, V]
    log_z = logits.logsumexp(dim=-1)  # [C]
    logprobs = logits.gather(-1, targets[:, None]).squeeze(-1) - log_z  # [C]
    entropy = _entropy(logits, log_z) if with_entropy else torch.zeros_like(logprobs)
    return logprobs, entropy


class _HeadLogProbs(torch.autograd.Function):
    """`log_softmax(hidden @ weight.T / temperature)[target]` of a chunk of rows, with a written-out backward.

    The backward only needs the softmax, d logprob / d logits = onehot(target) - p: the chunk's logits are
    kept when `keep_logits` (the caller's only chunk, so at most `max_logits_elements`) and recomputed from
    `hidden` otherwise. Autograd through the same ops would keep (or, checkpointed, recompute) every
    intermediate of the log-softmax and the entropy. Entropies come out of the forward, without gradient.

    Under autocast (float32 weights with Lightning's `bf16-mixed` or `16-mixed`) the backward runs under the
    forward's autocast state, as `torch.amp.custom_bwd` would: recomputed logits are then the forward's
    bf16 ones, consistent with its `log_z` (float32 logits against a bf16 `log_z` give a softmax that does
    not sum to 1), and the gradient goes through the same low-precision matmuls as autograd's would.
    """

    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        temperature: float,
        keep_logits: bool,
        with_entropy: bool,
    ) -> tuple[Tensor, Tensor]:
        logits = (hidden @ weight.T).float() / temperature  # [C, V]
        log_z = logits.logsumexp(dim=-1)  # [C]
        logprobs = logits.gather(-1, targets[:, None]).squeeze(-1) - log_z  # [C]
        entropy = _entropy(logits, log_z) if with_entropy else torch.zeros_like(logprobs)  # [C]
        ctx.temperature = temperature
        device = hidden.device.type
        ctx.autocast = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))
        ctx.save_for_backward(hidden, weight, targets, log_z, logits if keep_logits else None)
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs: Tensor, grad_entropy: Tensor) -> tuple[Tensor | None, ...]:
        hidden, weight, targets, log_z, logits = ctx.saved_tensors
        device, dtype, enabled = ctx.autocast
        with torch.autocast(device, dtype=dtype, enabled=enabled):
            if logits is None:
                logits = (hidden @ weight.T.to(hidden.dtype)).float() / ctx.temperature  # [C, V]
            grad_logits = (logits - log_z[:, None]).exp_().mul_(-grad_logprobs[:, None])  # [C, V] -g * p
            grad_logits.scatter_add_(-1, targets[:, None], grad_logprobs[:, None])  # + g at the target
            grad_logits = grad_logits.div_(ctx.temperature).to(
                hidden.dtype
            )  # d logits / d (hidden @ weight.T)
            grad_hidden = grad_logits @ weight.to(hidden.dtype) if ctx.needs_input_grad[0] else None  # [C, H]
            grad_weight = grad_logits.T @ hidden if ctx.needs_input_grad[1] else None  # [V, H]
        grad_hidden = None if grad_hidden is None else grad_hidden.to(hidden.dtype)
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def completion_logprobs(
    model: PreTrainedModel,
    input_ids: Tensor,
    attention_mask: Tensor,
    num_completion_tokens: int,
    **head: Unpack[HeadOptions],
) -> tuple[Tensor, Tensor]:
    """Per-token log-probs (and entropies) of the last `num_completion_tokens` tokens, in float32.

    The decoder runs once over the whole sequence, but the LM head only over the completion positions,
    and in chunks of at most `max_logits_elements` logits (2**26 floats = 256 MiB): a 150k vocabulary
    never materialises `[B, T, V]` in float32. A plain bias-free `nn.Linear` head (nearly every causal LM)
    goes through `_HeadLogProbs`, whose backward keeps a single chunk's logits and recomputes several
    chunks'; any other head, or a gradient through the entropy, is checkpointed chunk by chunk instead.
    Models whose forward transforms the head's logits get the same transform (`head_logit_transform`), so
    every token is scored with the logits it was sampled from.

    `head`: `head_logprobs`' options. Returns `(logprobs, entropies)`, each `[B, T]` float32; entropies are
    zeros unless `with_entropy`.
    """
    T = num_completion_tokens
    decoder = model.get_decoder()
    hidden = decoder(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask)
    ).last_hidden_state  # [B, L, H]
    hidden = hidden[:, -T - 1 : -1]  # [B, T, H] position t predicts token t+1
    return head_logprobs(model, hidden, input_ids[:, -T:], **head)


def head_logprobs(
    model: PreTrainedModel,
    hidden: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    max_logits_elements: int = 2**26,
) -> tuple[Tensor, Tensor]:
    """The LM head part of `completion_logprobs`: log-probs (and entropies) of `targets` `[B, T]` from the
    decoder's final hidden states `hidden` `[B, T, H]` that predict them, chunked, in float32."""
    head = model.get_output_embeddings()
    transform = head_logit_transform(model)
    rows = hidden.reshape(-1, hidden.size(-1))  # [B*T, H]
    flat_targets = targets.reshape(-1)  # [B*T]
    chunk = max(1, max_logits_elements // head.weight.size(0))
    use_checkpoint = torch.is_grad_enabled() and rows.requires_grad
    written_backward = (
        type(head) is torch.nn.Linear and head.bias is None and transform is None and not entropy_grad
    )
    keep_logits = rows.size(0) <= chunk
    logprobs, entropies = [], []
    for start in range(0, rows.size(0), chunk):
        h, y = rows[start : start + chunk], flat_targets[start : start + chunk]
        if written_backward:
            lp, ent = _HeadLogProbs.apply(h, head.weight, y, temperature, keep_logits, with_entropy)
        elif use_checkpoint:
            lp, ent = checkpoint(
                _token_logprobs_and_entropy,
                head,
                h,
                y,
                temperature,
                with_entropy,
                transform,
                use_reentrant=False,
            )
        else:
            lp, ent = _token_logprobs_and_entropy(head, h, y, temperature, with_entropy, transform)
        logprobs.append(lp)
        entropies.append(ent if entropy_grad else ent.detach())
    shape = targets.shape
    return torch.cat(logprobs).view(shape), torch.cat(entropies).view(shape)
