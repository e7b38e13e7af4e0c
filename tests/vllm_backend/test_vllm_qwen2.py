"""A tiny Qwen2 (biases on q/k/v, as every GPU config's model), with its LM head untied and tied, is pushed
exactly after 3 AdamW steps of full fine-tuning in float32. The engine: `core.generation.vllm_engine`."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from tests.vllm_backend.helpers import adamw_steps, engine_for, sampled_gap


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_qwen2_pushed_exactly(tied):
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=400,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
    )
    model = Qwen2ForCausalLM(config).float()
    with torch.no_grad():  # the biases start at 0: random ones, so that a bias the push missed shows
        for name, p in model.named_parameters():
            if name.endswith("_proj.bias"):
                p.normal_(0, 0.5)
    assert sum(name.endswith("_proj.bias") for name, _ in model.named_parameters()) == 6  # q, k, v x 2
    engine = engine_for(model)
    try:
        assert sampled_gap(engine, model) < 1e-5, "the first push"
        adamw_steps(model)
        engine.weights_changed()
        assert sampled_gap(engine, model) < 1e-5
    finally:
        engine.close()
