"""Under bf16-mixed vLLM computes in bfloat16: after 3 AdamW steps of the float32 master weights the
sampled log-probs stay as close to the scorer's (under autocast) as bf16 decoding allows, the gap of the
first rollout within a factor of 3 (the steps sharpen the logits, and with them the rounding), where
the stale weights' gap is ten times that (one engine for the module)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.vllm_backend.helpers import MASK, PROMPTS, adamw_steps, engine_for, scored


@pytest.fixture(scope="module")
def model(vllm_model_dir):
    return AutoModelForCausalLM.from_pretrained(vllm_model_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def engine(model):
    engine = engine_for(model, dtype=torch.bfloat16)
    yield engine
    engine.close()


def mean_gap(engine, model) -> float:
    """The mean |sampler - scorer| over 64 rollouts' tokens, the scorer under bf16 autocast."""
    rollout = engine.generate(model, PROMPTS, MASK, num_generations=32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        gap = (rollout.sampler_logprobs - scored(model, rollout))[rollout.completion_mask.bool()]
    return float(gap.abs().mean())


def test_the_push_keeps_the_gap_of_bf16_decoding(engine, model):
    before = mean_gap(engine, model)
    assert 0 < before < 0.05
    adamw_steps(model)
    stale = mean_gap(engine, model)
    engine.weights_changed()
    after = mean_gap(engine, model)
    assert after < 3 * before and stale > 10 * after, (before, after, stale)
