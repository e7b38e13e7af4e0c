"""The rollout seam: one sampling path for training and `generate_answers`, and an engine that the module
tells when the weights change and asks to refresh before each rollout."""

from dataclasses import dataclass

import torch

from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.generation.engines import EagerEngine, RolloutEngine
from grpo_lightning.core.generation.sampling import SamplingSettings
from grpo_lightning.core.generation.scorer import LogProbScorer
from grpo_lightning.training.evaluation import generate_answers
from grpo_lightning.training.module import GRPOModule
from tests.helpers import length_reward, quiet_trainer

PROMPTS = [[{"role": "user", "content": "What is 2 + 3?"}], [{"role": "user", "content": "Name 7 + 1."}]]


def test_generate_answers_samples_as_the_module(tiny_model_dir):
    module = GRPOModule(tiny_model_dir, grpo=GRPOConfig(max_completion_length=8, share_prompt=False))
    module.configure_model()
    _, greedy = module.rollouts.sample(PROMPTS, 1, do_sample=False)
    assert greedy == generate_answers(module.policy, module.tokenizer, PROMPTS, max_new_tokens=8)
    torch.manual_seed(3)
    _, sampled = module.rollouts.sample(PROMPTS, 3)
    torch.manual_seed(3)
    assert sampled == generate_answers(
        module.policy, module.tokenizer, PROMPTS, num_generations=3, max_new_tokens=8
    )


def test_scorer_shares_the_prompt_with_the_same_logprobs(tiny_model_dir):
    module = GRPOModule(tiny_model_dir, grpo=GRPOConfig(num_generations=2, max_completion_length=6))
    module.configure_model()
    torch.manual_seed(0)
    rollout, _ = module.rollouts.sample(PROMPTS, 2)
    shared = LogProbScorer(2, share_prompt=True)(module.policy, rollout, slice(None))[0]  # [4, T]
    unshared = LogProbScorer(2, share_prompt=False)(module.policy, rollout, slice(None))[0]
    mask = rollout.completion_mask.bool()
    torch.testing.assert_close(shared[mask], unshared[mask], atol=1e-5, rtol=1e-5)


class CountingEngine(EagerEngine):
    """The eager engine, counting `generate` calls and the weight changes it is told of, with the weights it
    saw at each `refresh` (where a static engine would copy them)."""

    def __init__(self, settings) -> None:
        super().__init__(settings)
        self.generated, self.changes, self.refreshed = 0, 0, []

    def generate(self, model, prompt_ids, prompt_mask, *, num_generations, do_sample=True, settings=None):
        self.generated += 1
        return super().generate(
            model,
            prompt_ids,
            prompt_mask,
            num_generations=num_generations,
            do_sample=do_sample,
            settings=settings,
        )

    def weights_changed(self) -> None:
        self.changes += 1

    def refresh(self, model, device) -> None:
        self.refreshed.append(next(model.parameters()).detach().clone())


def counting(module: GRPOModule) -> GRPOModule:
    """`module`, its rollouts built on a `CountingEngine` (kept as `module.engine`)."""
    build = module.rollouts.build_engine

    def build_counting() -> RolloutEngine:
        module.engine = CountingEngine(build().settings)
        return module.engine

    module.rollouts.build_engine = build_counting
    return module


def test_the_engine_hears_of_every_weight_change_and_refreshes_before_each_rollout(tiny_model_dir):
    from grpo_lightning.training.data import GSM8KDataModule

    grpo = GRPOConfig(
        num_generations=2, max_completion_length=4, num_iterations=2, learning_rate=1e-2, preflight=False
    )
    module = counting(GRPOModule(tiny_model_dir, reward_funcs=[length_reward], grpo=grpo))
    data = GSM8KDataModule(
        source="arithmetic", system_prompt=None, arithmetic_size=8, batch_size=2, val_size=2
    )
    quiet_trainer(max_steps=4, limit_val_batches=0).fit(module, data)  # 2 batches x 2 optimizer steps
    engine = module.engine
    assert engine.generated == 2 and len(engine.refreshed) == 2
    assert engine.changes == 4  # each optimizer step (the engine was built at the first rollout)
    assert not torch.equal(engine.refreshed[0], engine.refreshed[1]), "the second rollout's weights moved"
    module.load_state_dict(module.state_dict())
    assert engine.changes == 5, "a checkpoint load is a change"


def test_evaluation_builds_its_settings_and_sees_no_training_knob(tiny_model_dir):
    @dataclass(frozen=True, kw_only=True)
    class WithKnob(SamplingSettings):
        presence_penalty: float = 0.0  # a knob that sampling could gain later

    class Recording(EagerEngine):
        def generate(self, model, prompt_ids, prompt_mask, *, num_generations, do_sample=True, settings=None):
            self.seen = settings
            return super().generate(
                model,
                prompt_ids,
                prompt_mask,
                num_generations=num_generations,
                do_sample=do_sample,
                settings=settings,
            )

    module = GRPOModule(tiny_model_dir, grpo=GRPOConfig(max_completion_length=8))
    module.configure_model()
    training = module.rollouts.current_engine().settings
    knobs = dict(min_new_tokens=3, temperature=0.7, top_p=0.5, top_k=5, min_p=0.1, repetition_penalty=1.3)
    knobs["presence_penalty"] = 0.5
    engine = Recording(WithKnob(**{**vars(training), **knobs}))
    policy, tokenizer = module.policy, module.tokenizer
    generate_answers(policy, tokenizer, PROMPTS, max_new_tokens=6, temperature=0.9, engine=engine)
    expected = SamplingSettings(
        max_new_tokens=6,
        eos_token_ids=training.eos_token_ids,
        pad_token_id=training.pad_token_id,
        temperature=0.9,
        share_prompt=training.share_prompt,
    )
    assert type(engine.seen) is SamplingSettings and engine.seen == expected
