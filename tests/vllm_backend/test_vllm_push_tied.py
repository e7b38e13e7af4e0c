"""The push is exact after 3 AdamW steps of full fine-tuning with the LM head tied to the embedding (one
engine for the module): vLLM's CPU build packs the head's weight at load, and the push repacks it."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.vllm_backend.helpers import adamw_steps, engine_for, sampled_gap


@pytest.fixture(scope="module")
def model(vllm_tied_dir):
    return AutoModelForCausalLM.from_pretrained(vllm_tied_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def engine(model):
    engine = engine_for(model)
    yield engine
    engine.close()


def test_three_adamw_steps_pushed_exactly(engine, model):
    assert model.config.tie_word_embeddings
    assert sampled_gap(engine, model) < 1e-5, "the first push: vLLM started from random weights"
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    adamw_steps(model)
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters()), "every weight moved"
    engine.weights_changed()
    assert sampled_gap(engine, model) < 1e-5
    assert engine.refreshes == 2
