"""LoRA through the static engine at a real model width (Qwen2.5-0.5B's hidden size, 2 layers): the shipped
LoRA config's numerics (a bf16 base, float32 adapters, `bf16-mixed`), where early adapter updates are
small. The engine's inference copy keeps the adapters unmerged and computes as the scorer does, so its
log-prob change is the scorer's at every adapter size, where a copy with the adapters merged into its bf16
weights loses most of a small update; after real AdamW steps from B = 0 the sampled tokens' log-probs are
the scorer's within bf16 rounding."""

import copy

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from grpo_lightning.core.generation.inference_copy import copy_precision
from grpo_lightning.core.generation.logprobs import completion_logprobs
from grpo_lightning.core.generation.sampling import SamplingSettings
from grpo_lightning.core.generation.static_engine import StaticEngine
from grpo_lightning.io.models import LoraOptions, apply_lora

VOCAB, T = 512, 16
SHAPE = {  # Qwen2.5-0.5B's width, heads and MLP; 2 of its 24 layers
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 2,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
}


@pytest.fixture(scope="module")
def lora_policy():
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, tie_word_embeddings=True, eos_token_id=2, pad_token_id=0, **SHAPE)
    base = Qwen2ForCausalLM(config).to(torch.bfloat16)  # the frozen base, as `model_options.dtype: bfloat16`
    policy = apply_lora(base, LoraOptions(r=16, alpha=32))
    assert all(p.dtype == torch.float32 for n, p in policy.named_parameters() if "lora_" in n)
    return policy


def settings(**options) -> SamplingSettings:
    return SamplingSettings(
        **{"max_new_tokens": 12, "eos_token_ids": (2,), "pad_token_id": 0, "share_prompt": True, **options}
    )


def scored(model, ids: torch.Tensor) -> torch.Tensor:
    """Log-probs of the last T tokens as the loss scores them under `bf16-mixed`: `[B, T]`."""
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        return completion_logprobs(model, ids, torch.ones_like(ids), T)[0]


def set_adapters(policy, scale: float) -> None:
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, weight in policy.named_parameters():
            if "lora_B" in name:
                weight.copy_(torch.randn(weight.shape, generator=g) * scale)


def test_engine_keeps_every_adapter_size(lora_policy):
    """Log-prob change from the base (B = 0) to B at scale s, on fixed tokens: the engine's copy reproduces
    the scorer's (PEFT's unmerged forward) at every s; a merged bf16 copy does not at 1e-4."""
    policy = lora_policy
    ids = torch.randint(3, VOCAB, (4, 40), generator=torch.Generator().manual_seed(2))  # [B, P+T]
    engine = StaticEngine(settings(), precision=copy_precision("bf16-mixed"))
    set_adapters(policy, 0.0)
    engine.refresh(policy, torch.device("cpu"))
    base_scorer, base_engine = scored(policy, ids), scored(engine.copy.model, ids)
    merged_base = scored(copy.deepcopy(policy).merge_and_unload(), ids)
    for scale in (1e-4, 1e-3, 1e-2):
        set_adapters(policy, scale)
        engine.weights_changed()
        engine.refresh(policy, torch.device("cpu"))
        change = (scored(policy, ids) - base_scorer).flatten()  # [B*T] what the loss sees move
        reproduced = (scored(engine.copy.model, ids) - base_engine).flatten()
        share = float(reproduced @ change / (change @ change))
        assert share >= 0.99, (scale, share)
        assert float((reproduced - change).norm() / change.norm()) < 0.05, scale
        if scale == 1e-4:  # what merging into bf16 weights, bf16(W + s * B @ A), leaves of it
            merged = (scored(copy.deepcopy(policy).merge_and_unload(), ids) - merged_base).flatten()
            assert float(merged @ change / (change @ change)) < 0.9


def test_sampled_logprobs_are_the_scorers_after_adamw_steps(lora_policy):
    """3 AdamW steps from B = 0 under bf16 autocast (the adapters' first, small updates), then a sampled
    rollout: each token's log-prob as the engine drew it equals the scorer's within bf16 rounding."""
    policy = lora_policy
    set_adapters(policy, 0.0)
    engine = StaticEngine(settings(temperature=0.9), precision=copy_precision("bf16-mixed"))
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))
    engine.generate(policy, ids, torch.ones_like(ids), num_generations=2)  # the copy at B = 0
    trainable = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    g = torch.Generator().manual_seed(4)
    for _ in range(3):
        text = torch.randint(3, VOCAB, (4, 16), generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            policy(input_ids=text, labels=text).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        engine.weights_changed()
    b = max(p.abs().max().item() for n, p in policy.named_parameters() if "lora_B" in n)
    assert 1e-4 < b < 1e-2  # small updates: what a merged bf16 copy would round away
    torch.manual_seed(0)
    rollout = engine.generate(policy, ids, torch.ones_like(ids), num_generations=4)
    assert engine.refreshes == 2
    width = rollout.completion_ids.size(1)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected, _ = completion_logprobs(
            policy, rollout.input_ids, rollout.attention_mask, width, temperature=0.9
        )
    drawn = rollout.completion_mask.bool()
    gap = (rollout.sampler_logprobs - expected)[drawn].abs()
    assert drawn.sum() >= 40
    assert gap.max() < 0.05 and gap.mean() < 5e-3, (gap.max(), gap.mean())
