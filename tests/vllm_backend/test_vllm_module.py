"""vLLM inside `GRPOModule` (one engine for the module, one module for the file): pushed once per rollout
with `steps_per_generation` 2, each rollout sampling the weights of its moment; a loaded checkpoint
sampled next; validation pushing first; the pre-flight's memory estimate counting vLLM's weights and KV
pool; the engine closed before the process group."""

from __future__ import annotations

import pytest
import torch

from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.io.distributed import close_process_group
from grpo_lightning.training.callbacks.preflight import rollout_memory
from grpo_lightning.training.module import GRPOModule
from tests.helpers import arithmetic_data, digit_reward, quiet_trainer

VLLM = dict(generation_backend="vllm", vllm_kv_cache_gb=0.05, vllm_enforce_eager=True)


class CheckedModule(GRPOModule):
    """Checks at every rollout that vLLM sampled the policy's weights of that moment (the sampled log-probs
    are the scorer's), and counts the rollouts."""

    rollouts_sampled = 0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        sample = self.rollouts.sample

        def checked_sample(prompts, num_generations, do_sample=True):
            rollout, completions = sample(prompts, num_generations, do_sample)
            if do_sample:
                with torch.no_grad():  # the loss's scorer: inside the root's forward under FSDP2
                    logprobs, _ = self.rollouts.scorer(self.policy, rollout, slice(None))
                gap = (rollout.sampler_logprobs - logprobs)[rollout.completion_mask.bool()]
                assert gap.abs().max() < 1e-5
            self.rollouts_sampled += 1
            return rollout, completions

        self.rollouts.sample = checked_sample


@pytest.fixture(scope="module")
def module(vllm_model_dir):
    torch.manual_seed(0)
    grpo = GRPOConfig(
        num_generations=2,
        max_completion_length=4,
        steps_per_generation=2,
        learning_rate=1e-2,
        preflight=False,
        log_completions_every=0,
        **VLLM,
    )
    module = CheckedModule(vllm_model_dir, reward_funcs=[digit_reward], grpo=grpo)
    yield module
    close_process_group()
    assert module.rollouts.engine is None or module.rollouts.engine.llm is None, "closed with the group"


def test_one_push_per_rollout_with_two_steps_each(module):
    quiet_trainer(max_steps=4, limit_val_batches=0).fit(module, arithmetic_data(16))  # 2 rollouts x 2 steps
    assert module.trainer.global_step == 4 and module.rollouts_sampled == 2
    assert module.rollouts.engine.refreshes == 2
    assert module.rollouts.engine_metrics()["rollout/weight_pushes"] == 2


def test_validation_pushes_first(module):
    """Trained weights not yet sampled (the last 2 steps came after the last rollout): validation pushes
    them, and its greedy rollouts are the policy's."""
    pushes = module.rollouts.engine.refreshes
    quiet_trainer(limit_val_batches=1).validate(module, arithmetic_data(16))
    assert module.rollouts.engine.refreshes == pushes + 1
    prompts = ["12 + 7 =", "3 * 4 ="]
    greedy = module.rollouts.sample(prompts, 1, do_sample=False)[0]
    assert module.rollouts.engine.refreshes == pushes + 1, "nothing changed: no push"
    with torch.no_grad():
        logits = module.policy(input_ids=greedy.input_ids, attention_mask=greedy.attention_mask).logits
    P = greedy.prompt_ids.size(1)
    expected = logits[:, P - 1 : -1].argmax(-1)  # [2, T] each token the argmax after the ones before
    mask = greedy.completion_mask.bool()
    assert torch.equal(greedy.completion_ids[mask], expected[mask])


def test_a_loaded_checkpoint_is_sampled_next(module):
    state = {k: v.clone() for k, v in module.state_dict().items()}
    with torch.no_grad():
        for name, value in state.items():
            if "up_proj" in name:
                value.add_(0.3)
    pushes = module.rollouts.engine.refreshes
    module.load_state_dict(state)
    module.rollouts.sample(["1 + 1 ="], 2)  # checked: the loaded weights sampled
    assert module.rollouts.engine.refreshes == pushes + 1


def test_the_memory_estimate_counts_vllm(module):
    estimate = rollout_memory(module, sequences=4, prompt_tokens=16, devices=1, precision="32-true")
    weights = sum(p.numel() * 4 for p in module.policy.parameters())
    assert estimate.gpu["inference copy"] == weights
    assert estimate.gpu["KV cache"] == int(0.05e9), "vLLM's pool, not rows x tokens"
