"""Pre-flight: the block reported before the first step, each check's finding, and no effect on training."""

import dataclasses

import lightning as L
import pytest
import torch

from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.rewards.verifiable import accuracy_reward
from grpo_lightning.io.arithmetic_task import arithmetic_problems
from grpo_lightning.io.models import LoraOptions, ModelOptions
from grpo_lightning.io.rows import collate_rows
from grpo_lightning.training.callbacks.preflight import (
    Preflight,
    effective_batch,
    groups_cut_whole,
    input_gradients_enabled,
    run_preflight,
    servers_line,
)
from grpo_lightning.training.data import GSM8KDataModule
from grpo_lightning.training.module import GRPOModule
from tests.helpers import length_reward, quiet_trainer
from tests.test_bad_input_rewards import end_early

BATCH = collate_rows(arithmetic_problems(2, seed=3), system_prompt=None)


def module_for(model_dir: str, grpo: dict | None = None, reward_funcs=(accuracy_reward,), **kwargs):
    grpo = GRPOConfig(**({"num_generations": 4, "max_completion_length": 3} | (grpo or {})))
    module = GRPOModule(model_dir, reward_funcs=list(reward_funcs), grpo=grpo, **kwargs)
    module.configure_model()
    return module


def test_effective_batch_counts_completions_per_update():
    assert effective_batch(prompts=2, num_generations=4) == 8
    assert effective_batch(prompts=2, num_generations=4, devices=8, accumulation=2) == 128


def test_report_of_a_sound_setup(tiny_model_dir):
    module = module_for(tiny_model_dir, grpo={"max_completion_length": 20})
    end_early(module, eos_logit=6.0)  # EOS as likely as the 399 other tokens together: 20 tokens hold one
    report = run_preflight(module, BATCH, devices=1, accumulation=1, samples=2)
    assert report.lines["effective batch"] == (
        "2 prompts x 4 completions x 1 device(s) x 1 accumulation = 8 completions per step, 1 optimizer "
        "step(s) each (1 mini-batch(es) of 8 completions x 1 iteration(s); one micro-batch)"
    )
    assert report.lines["completion length"] == (
        "0 of 8 sampled completions reached max_completion_length=20; 0 of 2 groups were cut whole"
    )
    assert report.lines["reward audit"] == "passes on 2 reference solutions"
    assert report.lines["LoRA input grads"].startswith("not needed")
    assert report.problems == []
    assert report.text().splitlines()[0] == "GRPO pre-flight:" and report.text().endswith("all clear")


@pytest.mark.parametrize(
    ("update", "steps"),
    [
        ({"steps_per_generation": 4}, "4 optimizer step(s) each (4 mini-batch(es) of 2 completions x 1 "),
        (
            {"steps_per_generation": 2, "num_iterations": 3},
            "6 optimizer step(s) each (2 mini-batch(es) of 4 ",
        ),
    ],
)
def test_the_effective_batch_counts_each_steps_optimizer_steps(tiny_model_dir, update, steps):
    """A rollout of 8 completions in `steps_per_generation` mini-batches, each stepped `num_iterations`
    times: the optimizer steps that `max_steps` counts."""
    module = module_for(tiny_model_dir, grpo=update)
    line = run_preflight(module, BATCH, samples=2).lines["effective batch"]
    assert line.startswith(
        f"2 prompts x 4 completions x 1 device(s) x 1 accumulation = 8 completions per step, {steps}"
    )


def test_groups_cut_whole_is_a_problem(tiny_model_dir):
    module = module_for(tiny_model_dir, grpo={"max_completion_length": 3, "min_completion_length": 3})
    report = run_preflight(module, BATCH, samples=2)
    assert report.lines["completion length"] == (
        "8 of 8 sampled completions reached max_completion_length=3; 2 of 2 groups were cut whole"
    )
    assert len(report.problems) == 1
    assert report.problems[0].startswith("in 2 of 2 groups all completions sampled before training reached")
    assert "raise grpo.sampling.max_completion_length" in report.problems[0]


@pytest.mark.parametrize(
    ("truncated", "whole", "problem"),
    [
        ([1, 1, 1, 0, 1, 1, 0, 0], 0, False),  # most cut (SmolLM2 at 48 tokens), each group can learn
        ([1, 1, 1, 1, 1, 1, 0, 1], 1, False),  # half the groups cut whole
        ([1, 1, 1, 1, 1, 1, 1, 1], 2, True),
    ],
)
def test_cut_completions_are_a_problem_only_when_most_groups_are_cut_whole(
    tiny_model_dir, monkeypatch, truncated, whole, problem
):
    module = module_for(tiny_model_dir)
    sample = module.rollouts.sample

    def sample_with_truncation(prompts, num_generations):
        rollout, rest = sample(prompts, num_generations)
        return dataclasses.replace(rollout, truncated=torch.tensor(truncated, dtype=torch.bool)), rest

    monkeypatch.setattr(module.rollouts, "sample", sample_with_truncation)
    report = run_preflight(module, BATCH, samples=2)
    assert groups_cut_whole(torch.tensor(truncated, dtype=torch.bool), 4) == whole
    assert report.lines["completion length"].endswith(f"; {whole} of 2 groups were cut whole")
    assert bool(report.problems) is problem


def test_a_reward_that_ignores_the_answer_fails_the_audit(tiny_model_dir):
    module = module_for(tiny_model_dir, reward_funcs=[length_reward])
    report = run_preflight(module, BATCH, samples=1)
    assert report.lines["reward audit"] == "FAILS on 2 reference solutions"
    audit_problems = [p for p in report.problems if p.startswith("the reward audit fails")]
    assert len(audit_problems) == 1 and "length_reward" in audit_problems[0]  # with the table


def test_lora_with_gradient_checkpointing_needs_input_gradients(tiny_model_dir):
    module = module_for(
        tiny_model_dir,
        lora=LoraOptions(r=2, target_modules=["q_proj"]),
        model_options=ModelOptions(gradient_checkpointing=True),
    )
    assert input_gradients_enabled(module.policy) is True  # the module enables them
    report = run_preflight(module, BATCH, samples=1)
    assert report.lines["LoRA input grads"] == "enabled"

    # A policy prepared elsewhere, whose input embeddings nobody hooked (transformers, PEFT and the module
    # each register one hook: remove them all).
    module.policy.get_input_embeddings()._forward_hooks.clear()
    assert input_gradients_enabled(module.policy) is False
    report = run_preflight(module, BATCH, samples=1)
    assert report.lines["LoRA input grads"] == "DISABLED"
    assert any("policy.enable_input_require_grads()" in p for p in report.problems)


def first_step_completions(model_dir: str, preflight: Preflight | None) -> tuple[list[str], int]:
    L.seed_everything(0)
    grpo = GRPOConfig(num_generations=2, max_completion_length=4, preflight=preflight is not None)
    module = GRPOModule(model_dir, reward_funcs=[length_reward], grpo=grpo)
    data = GSM8KDataModule(
        source="arithmetic", system_prompt=None, arithmetic_size=10, batch_size=2, val_size=2
    )
    calls = []
    sample = module.rollouts.sample
    module.rollouts.sample = lambda *args, **kwargs: calls.append(1) or sample(*args, **kwargs)
    trainer = quiet_trainer(max_steps=1, limit_val_batches=0, callbacks=[preflight] if preflight else [])
    trainer.fit(module, data)
    return module.last_rollout.completions, len(calls)


def test_preflight_runs_once_before_the_first_step_and_leaves_sampling_alone(tiny_model_dir, caplog):
    preflight = Preflight(samples=1)
    with pytest.warns(UserWarning, match="completions sampled before training reached max_completion_length"):
        with_it, calls = first_step_completions(tiny_model_dir, preflight)
    assert calls == 2  # the pre-flight's sample, then the step's
    assert preflight.report is not None and "GRPO pre-flight:" in caplog.text
    without_it, calls = first_step_completions(tiny_model_dir, None)
    assert calls == 1
    assert with_it == without_it  # it drew from its own copy of the RNG states


def test_the_memory_estimate_says_it_leaves_vllm_servers_out():
    servers = GRPOConfig(vllm_mode="server", vllm_server_base_url=["http://a:1", "http://b:2"])
    assert servers_line(servers) == (
        "2 vLLM server(s) at http://a:1, http://b:2: their weights and KV cache are on their own devices, "
        "outside the estimate above (size them with cli.py vllm-serve --gpu-memory-utilization)"
    )
    assert servers_line(GRPOConfig()) is None
    assert servers_line(GRPOConfig(generation_backend="vllm")) is None
