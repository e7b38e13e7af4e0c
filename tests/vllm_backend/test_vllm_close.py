"""Closing the engine mid-run keeps the trainer's process group: vLLM's shutdown destroys the default group,
which a rebuilt engine (a module sampled before `fit` in another precision) and the trainer's next
collective need. The engine: `core.generation.vllm_engine`."""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from tests.vllm_backend.helpers import MASK, PROMPTS, engine_for


def test_closing_and_rebuilding_the_engine_keeps_the_trainers_group(vllm_model_dir, tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        model = AutoModelForCausalLM.from_pretrained(vllm_model_dir, dtype=torch.float32)
        for _ in range(2):  # built, sampled, closed; then built again on the same group
            engine = engine_for(model)
            assert engine.generate(model, PROMPTS, MASK, num_generations=2).completion_ids.size(0) == 4
            engine.close()
            assert dist.is_initialized(), "the trainer's process group was destroyed with the engine"
            total = torch.ones(1)
            dist.all_reduce(total)  # the trainer's next collective
            assert total.item() == 1.0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
