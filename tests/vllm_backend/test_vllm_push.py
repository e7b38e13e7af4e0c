"""The push is exact after 3 AdamW steps of full fine-tuning, in float32, with an untied LM head and with one
tied to the embedding, which vLLM's CPU build packs at load and the push repacks (one engine at a time).
The engine: `core.generation.vllm_engine`."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.vllm_backend.helpers import adamw_steps, engine_for, sampled_gap


@pytest.fixture(scope="module", params=["untied", "tied"])
def model(request):
    folder = request.getfixturevalue({"untied": "vllm_model_dir", "tied": "vllm_tied_dir"}[request.param])
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


@pytest.fixture(scope="module")
def engine(model):
    engine = engine_for(model)
    yield engine
    engine.close()


def test_three_adamw_steps_pushed_exactly(engine, model, request):
    assert model.config.tie_word_embeddings == ("[tied]" in request.node.name)
    assert sampled_gap(engine, model) < 1e-5, "the first push: vLLM started from random weights"
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    adamw_steps(model)
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters()), "every weight moved"
    engine.weights_changed()
    assert sampled_gap(engine, model) < 1e-5
    assert engine.refreshes == 2
