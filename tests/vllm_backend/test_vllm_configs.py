"""Every shipped config trains 2 steps with `generation_backend: vllm` (its precision, LoRA, strategy and
algorithm options; `tests/test_yaml_configs.py` runs them with their own engine): the rollouts come from
vLLM, pushed once per rollout, and most trainable weights move.
The registry: `core.generation.backends`."""

from __future__ import annotations

import os

import pytest

from tests.test_yaml_configs import CONFIGS, two_steps_of

VLLM = {"generation_backend": "vllm", "vllm_kv_cache_gb": 0.05, "vllm_enforce_eager": True}


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_every_config_trains_two_steps_on_vllm(path, vllm_model_dir, tmp_path):
    module, moved = two_steps_of(path, vllm_model_dir, tmp_path, **VLLM)
    assert module.rollouts.backend == "vllm"
    assert module.rollouts.engine.refreshes == 2 and module.rollouts.engine.llm is None, "pushed, then closed"
    assert moved > (0.4 if module.lora else 0.8), f"{moved:.1%} of the trainable weights moved"
