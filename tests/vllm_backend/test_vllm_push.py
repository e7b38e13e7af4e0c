"""The push is exact after 3 AdamW steps of full fine-tuning, in float32, with an untied LM head (one engine
for the module); `test_vllm_push_tied.py` repeats it with a tied head, which vLLM's CPU build must repack.
The engine: `core.generation.vllm_engine`."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.vllm_backend.helpers import adamw_steps, engine_for, sampled_gap


@pytest.fixture(scope="module")
def model(vllm_model_dir):
    return AutoModelForCausalLM.from_pretrained(vllm_model_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def engine(model):
    engine = engine_for(model)
    yield engine
    engine.close()


def test_three_adamw_steps_pushed_exactly(engine, model):
    assert not model.config.tie_word_embeddings
    assert sampled_gap(engine, model) < 1e-5, "the first push: vLLM started from random weights"
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    adamw_steps(model)
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters()), "every weight moved"
    engine.weights_changed()
    assert sampled_gap(engine, model) < 1e-5
    assert engine.refreshes == 2
