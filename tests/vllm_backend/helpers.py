"""What the vLLM test files share: an engine on a model, and the gap between its sampled log-probs and the
scorer's on the same tokens."""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import PreTrainedModel

from grpo_lightning.core.generation.logprobs import completion_logprobs
from grpo_lightning.core.generation.sampling import SamplingSettings
from grpo_lightning.core.generation.vllm_engine import VLLMEngine, VLLMOptions
from grpo_lightning.core.types import Rollout

PROMPTS = torch.tensor([[0, 0, 11, 12, 13, 14], [21, 22, 23, 24, 25, 26]])  # [2, 6] left-padded
MASK = (PROMPTS != 0).long()  # [2, 6]


def engine_for(
    model: PreTrainedModel, dtype: torch.dtype | None = None, engine: dict | None = None, **settings
) -> VLLMEngine:
    """A vLLM engine for `model` (started on its first rollout): 8 new tokens, stop at id 2, pad 0;
    `engine`: `VLLMOptions` fields and `VLLMEngine` keywords (`max_model_len`, `block_size`) over the tests'
    own."""
    options = dict(max_new_tokens=8, eos_token_ids=(2,), pad_token_id=0)
    sampling = SamplingSettings(**{**options, **settings})
    vllm = {"max_model_len": 64, "kv_cache_gb": 0.05, "enforce_eager": True, **(engine or {})}
    keywords = {name: vllm.pop(name) for name in ("max_model_len", "block_size") if name in vllm}
    return VLLMEngine(sampling, VLLMOptions(**vllm), dtype=dtype, **keywords)


def scored(model: PreTrainedModel, rollout: Rollout, temperature: float = 1.0) -> Tensor:
    """The scorer's float32 log-probs `[B, T]` of `rollout`'s completions under `model`, 0 after the end."""
    with torch.no_grad():
        logprobs, _ = completion_logprobs(
            model,
            rollout.input_ids,
            rollout.attention_mask,
            rollout.completion_ids.size(1),
            temperature=temperature,
        )
    return logprobs * rollout.completion_mask


def sampled_gap(
    engine: VLLMEngine,
    model: PreTrainedModel,
    G: int = 4,
    temperature: float = 1.0,
    prompts: tuple[Tensor, Tensor] = (PROMPTS, MASK),
) -> float:
    """The largest |sampler - scorer| log-prob over a fresh rollout's tokens of `prompts` (ids, mask)."""
    rollout = engine.generate(model, *prompts, num_generations=G)
    mask = rollout.completion_mask.bool()
    return float((rollout.sampler_logprobs - scored(model, rollout, temperature))[mask].abs().max())


def adamw_steps(model: PreTrainedModel, steps: int = 3, lr: float = 1e-2) -> None:
    """`steps` AdamW steps raising the log-probs of fixed tokens: every trainable weight moves."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr)
    ids = torch.arange(3, 19).view(2, 8)  # [2, 8]
    for _ in range(steps):
        logprobs, _ = completion_logprobs(model, ids, torch.ones_like(ids), 4)
        (-logprobs.mean()).backward()
        optimizer.step()
        optimizer.zero_grad()
