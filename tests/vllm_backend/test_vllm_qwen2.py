"""A tiny Qwen2 (biases on q/k/v, as every GPU config's model), with its LM head untied and tied, is pushed
exactly after 3 AdamW steps of full fine-tuning in float32. The engine: `core.generation.vllm_engine`."""

from __future__ import annotations

import pytest

from grpo_lightning.offline.tiny import build_qwen2
from tests.vllm_backend.helpers import adamw_steps, engine_for, sampled_gap


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_qwen2_pushed_exactly(tied):
    model = build_qwen2(
        400, 64, num_layers=2, num_heads=2, num_kv_heads=1, max_positions=128, tie_word_embeddings=tied
    )
    assert sum(name.endswith("_proj.bias") for name, _ in model.named_parameters()) == 6  # q, k, v x 2
    engine = engine_for(model)
    try:
        assert sampled_gap(engine, model) < 1e-5, "the first push"
        adamw_steps(model)
        engine.weights_changed()
        assert sampled_gap(engine, model) < 1e-5
    finally:
        engine.close()
