"""LoRA on vLLM stays unmerged and exact: with B at 1e-4, 1e-3 and 1e-2 the engine's log-probs move by
what the scorer's move (at least 0.99 of the change, float32), and after 3 AdamW steps of the adapter the
push is exact, and each push's adapter is loaded once, not at every decoding step (one engine for the
module)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo_lightning.io.models import LoraOptions, apply_lora
from tests.vllm_backend.helpers import MASK, PROMPTS, adamw_steps, engine_for, sampled_gap, scored


@pytest.fixture(scope="module")
def model(vllm_model_dir):
    base = AutoModelForCausalLM.from_pretrained(vllm_model_dir, dtype=torch.float32)
    return apply_lora(base, LoraOptions(r=4, alpha=8, target_modules=["q_proj", "v_proj", "up_proj"]))


@pytest.fixture(scope="module")
def engine(model):
    engine = engine_for(model)
    yield engine
    engine.close()


def set_b(model, scale: float) -> None:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(scale * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("scale", [1e-4, 1e-3, 1e-2])
def test_the_engine_keeps_the_scorers_logprob_change(engine, model, scale):
    set_b(model, scale)
    engine.weights_changed()
    rollout = engine.generate(model, PROMPTS, MASK, num_generations=16)
    mask = rollout.completion_mask.bool()
    trained = scored(model, rollout)[mask]
    with model.disable_adapter():
        untrained = scored(model, rollout)[mask]
    change = (trained - untrained).abs().sum()
    kept = 1 - (rollout.sampler_logprobs[mask] - trained).abs().sum() / change
    assert change > 0 and kept >= 0.99, f"kept {kept:.4f} of the scorer's change"


def test_three_adamw_steps_of_the_adapter_pushed_exactly(engine, model):
    set_b(model, 1e-3)
    adamw_steps(model)
    engine.weights_changed()
    assert sampled_gap(engine, model) < 1e-5
    assert engine.lora_request is not None, "the adapter is served, not merged"


def test_the_adapter_loads_once_per_push(engine, model, monkeypatch):
    from vllm.lora.worker_manager import WorkerLoRAManager  # vLLM only in the vLLM job

    loads = []
    load = WorkerLoRAManager._load_adapter

    def counted(manager, request):
        loads.append(request.lora_int_id)
        return load(manager, request)

    monkeypatch.setattr(WorkerLoRAManager, "_load_adapter", counted)
    set_b(model, 1e-2)
    engine.weights_changed()
    rollout = engine.generate(model, PROMPTS, MASK, num_generations=4)
    assert rollout.completion_mask.sum(1).max() > 1, "several decoding steps"
    assert len(loads) == 1, f"{len(loads)} adapter loads in one rollout after a push"
    engine.generate(model, PROMPTS, MASK, num_generations=4)
    assert len(loads) == 1, "no load without a push"
