"""Sleep mode wakes before every rollout, not only before a push: two rollouts without a weight change both
return (on CPU vLLM's sleep frees nothing but pauses its scheduler, which a rollout on a sleeping engine
would wait on forever). The engine: `core.generation.vllm_engine`."""

from __future__ import annotations

import threading

import torch
from transformers import AutoModelForCausalLM

from tests.vllm_backend.helpers import MASK, PROMPTS, engine_for

TIMEOUT_S = 60


def test_two_rollouts_without_a_change_return(vllm_model_dir):
    model = AutoModelForCausalLM.from_pretrained(vllm_model_dir, dtype=torch.float32)
    engine = engine_for(model, engine={"sleep": True})
    rollouts = []

    def two_rollouts() -> None:
        for _ in range(2):
            rollouts.append(engine.generate(model, PROMPTS, MASK, num_generations=2))

    worker = threading.Thread(target=two_rollouts, daemon=True)  # a hung rollout cannot be interrupted
    worker.start()
    worker.join(TIMEOUT_S)
    assert not worker.is_alive(), f"{len(rollouts)} of 2 rollouts returned in {TIMEOUT_S} s: asleep"
    try:
        assert len(rollouts) == 2 and all(r.completion_ids.size(0) == 4 for r in rollouts)
        assert engine.sleeping and engine.refreshes == 1, "one push: nothing changed"
    finally:
        engine.close()
