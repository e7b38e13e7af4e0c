"""Every push resets vLLM's prefix cache: prompts sharing whole KV blocks (32 tokens here, the smallest
block vLLM's CPU attention takes) are sampled exactly after 3 AdamW steps, where a cache kept from the first
rollout would serve the old weights' KV of the shared prefix. The engine: `core.generation.vllm_engine`."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from tests.vllm_backend.helpers import adamw_steps, engine_for, sampled_gap

PREFIX = torch.arange(30, 94)  # [64]: two whole blocks of 32 tokens, shared by every prompt
TAILS = ([5, 6, 7], [8, 9, 10])
PROMPTS = torch.stack([torch.cat([PREFIX, torch.tensor(tail)]) for tail in TAILS])  # [2, 67]
PROMPTS_MASK = torch.ones_like(PROMPTS)


def test_a_push_resets_the_prefix_cache(vllm_model_dir):
    model = AutoModelForCausalLM.from_pretrained(vllm_model_dir, dtype=torch.float32)
    engine = engine_for(model, engine={"block_size": 32, "max_model_len": 96})
    try:
        assert sampled_gap(engine, model, prompts=(PROMPTS, PROMPTS_MASK)) < 1e-5
        adamw_steps(model)
        engine.weights_changed()
        gap = sampled_gap(engine, model, prompts=(PROMPTS, PROMPTS_MASK))
        assert gap < 1e-5, f"the pushed weights sampled off by {gap:.2e}: the shared prefix's KV was stale"
        assert engine.refreshes == 2
    finally:
        engine.close()
