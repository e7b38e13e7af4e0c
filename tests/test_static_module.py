"""The static engine inside `GRPOModule`: the backend chosen (eager on CPU unless asked, one warning when a
model falls back), the copy refreshed once per rollout in training and shared by validation, a loaded
checkpoint sampled next, the accuracy callback decoding through the module's engine, and a copy built
before `fit` following the trainer's precision.
"""

from __future__ import annotations

import functools

import torch

from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.generation.engines import EagerEngine
from grpo_lightning.core.generation.static_engine import StaticEngine
from grpo_lightning.training.module import GRPOModule
from tests.helpers import arithmetic_data, quiet_trainer, sliding_window_model, static_module
from tests.test_static_engine import assert_copy_holds, eager_greedy


def test_backend_choice_and_one_warning_on_fallback(tiny_model_dir, recwarn):
    auto = GRPOModule(tiny_model_dir)
    auto.configure_model()
    assert isinstance(auto.rollouts.build_engine(), EagerEngine), (
        "auto is eager on CPU: the default is unchanged"
    )
    static = GRPOModule(tiny_model_dir, grpo=GRPOConfig(generation_backend="static"))
    static.configure_model()
    engine = static.rollouts.build_engine()
    assert isinstance(engine, StaticEngine)
    assert not engine.compile, "no compile on CPU"
    tokenizer = static.tokenizer
    recwarn.clear()
    fallback = GRPOModule(
        sliding_window_model(len(tokenizer)),
        tokenizer,
        grpo=GRPOConfig(generation_backend="static", share_prompt=False),
    )
    fallback.rollouts.sample(["1 + 1 ="], 2)
    fallback.rollouts.sample(["2 + 2 ="], 2)
    messages = [str(w.message) for w in recwarn if "attention" in str(w.message)]
    assert messages == [
        "grpo.scoring.packed_sequences, grpo.engine.backend='static': its attention layers are not all full "
        "attention (layer_types ['full_attention', 'sliding_attention']); the passes run padded rows; "
        "rollouts use eager decoding"
    ]
    assert isinstance(fallback.rollouts.engine, EagerEngine)


def test_training_refreshes_the_copy_and_validation_shares_it(tiny_model_dir):
    """Validation first (inference mode, greedy), dynamic sampling, a KL reference: after training the
    copy holds the trained weights, and greedy validation rollouts are the policy's own."""
    module = static_module(
        tiny_model_dir,
        max_completion_length=6,
        dynamic_sampling=True,
        dynamic_sampling_metric=None,
        beta=0.04,
    )
    data = arithmetic_data(40)

    trainer = quiet_trainer(max_steps=3, limit_val_batches=1, num_sanity_val_steps=1, val_check_interval=2)
    trainer.fit(module, data)
    engine_ = module.rollouts.engine
    assert isinstance(engine_, StaticEngine) and engine_.copy is not None
    batch = next(iter(data.val_dataloader()))
    ids, mask = module.rollouts.encoder.encode(batch["prompt"], "cpu")
    static = module.rollouts.sample(batch["prompt"], 1, do_sample=False)[0]
    assert_copy_holds(engine_, module.policy)  # refreshed after the last step, before this rollout
    s = engine_.settings
    expected = eager_greedy(
        module.policy,
        ids,
        mask,
        G=1,
        max_new_tokens=s.max_new_tokens,
        pad_token_id=s.pad_token_id,
        eos_token_ids=list(s.eos_token_ids),
    )
    assert torch.equal(static.completion_ids, expected.completion_ids)


class CheckedModule(GRPOModule):
    """Checks, at every rollout, that the static engine's copy holds the policy's weights of that moment,
    and counts the rollouts."""

    rollouts_sampled = 0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        sample = self.rollouts.sample

        def checked_sample(prompts, num_generations, do_sample=True):
            result = sample(prompts, num_generations, do_sample)
            assert_copy_holds(self.rollouts.engine, self.policy)
            self.rollouts_sampled += 1
            return result

        self.rollouts.sample = checked_sample


def test_copy_refreshes_once_per_rollout_with_two_steps_each(tiny_model_dir):
    """`steps_per_generation` 2: two optimizer steps per rollout, one refresh per rollout (the first
    fill included), each rollout sampling the weights of its moment."""
    module = static_module(tiny_model_dir, CheckedModule, max_completion_length=4, steps_per_generation=2)
    data = arithmetic_data(16)
    quiet_trainer(max_steps=6, limit_val_batches=0).fit(module, data)  # 3 rollouts x 2 optimizer steps
    assert module.trainer.global_step == 6 and module.rollouts_sampled == 3
    assert module.rollouts.engine.refreshes == 3


def test_a_checkpoint_load_is_sampled_next(tiny_model_dir):
    """A module samples (its copy holds the initial weights), then loads trained weights: its next rollout
    samples those, as eager decoding on them does."""
    torch.manual_seed(0)  # the training rollouts (and so whether the weights move) whatever ran before
    trained = static_module(tiny_model_dir, max_completion_length=6)
    quiet_trainer(max_steps=2, limit_val_batches=0).fit(trained, arithmetic_data(8))
    module = static_module(tiny_model_dir, max_completion_length=6)
    module.configure_model()
    prompts_ = ["12 + 7 =", "3 * 4 ="]
    before = module.rollouts.sample(prompts_, 1, do_sample=False)[0].completion_ids
    module.load_state_dict(trained.state_dict())
    after = module.rollouts.sample(prompts_, 1, do_sample=False)[0]
    assert_copy_holds(module.rollouts.engine, module.policy)
    ids, mask = module.rollouts.encoder.encode(prompts_, "cpu")
    s = module.rollouts.engine.settings
    eager = eager_greedy(
        module.policy,
        ids,
        mask,
        G=1,
        max_new_tokens=6,
        pad_token_id=s.pad_token_id,
        eos_token_ids=list(s.eos_token_ids),
    )
    assert torch.equal(after.completion_ids, eager.completion_ids)
    assert not torch.equal(after.completion_ids, before), "the loaded weights write something else"


def test_gsm8k_callback_samples_through_the_modules_engine(tiny_model_dir):
    """The accuracy callback decodes a GRPOModule's policy with its rollout engine (here the static copy,
    refreshed first): its greedy answers are the engine's, at the callback's own length."""
    from grpo_lightning.io.rows import collate_rows
    from grpo_lightning.training.evaluation import GSM8KAccuracyCallback, generate_answers
    from tests.helpers import GSM8K_DIR

    grpo = GRPOConfig(
        num_generations=2, max_completion_length=4, generation_backend="static", preflight=False
    )
    module = GRPOModule(tiny_model_dir, grpo=grpo)
    module.configure_model()
    engine_ = module.rollouts.current_engine()
    callback = GSM8KAccuracyCallback(source=GSM8K_DIR, split="holdout", num_problems=2, max_new_tokens=6)
    callback.setup(None, module, "fit")
    callback.evaluate(module)
    assert engine_.copy is not None and engine_.refreshes == 1, "the callback built the copy and sampled"
    batch = collate_rows(callback.data.val_rows, callback.data.hparams.system_prompt)
    answers = functools.partial(generate_answers, module.policy, module.tokenizer, batch["prompt"])
    through_engine = answers(max_new_tokens=6, engine=engine_)
    assert through_engine == answers(max_new_tokens=6)  # float32: the copy is the policy, greedy agrees
    assert through_engine != answers(max_new_tokens=4, engine=engine_), (
        "the callback's length, not training's"
    )


def test_an_engine_built_before_fit_follows_the_trainers_precision(tiny_model_dir):
    """Sampling before `fit` (an evaluation before training) builds the static engine without a trainer:
    a float32 inference copy. Under `bf16-mixed` training must generate from a bf16 copy, as the scorer's
    autocast sees the weights; the demo's seed 0 once trained from the float32 one."""
    module = static_module(tiny_model_dir, max_completion_length=4)
    module.configure_model()
    module.rollouts.sample(["1 + 1 ="], 1, do_sample=False)
    linear = "model.layers.0.mlp.up_proj.weight"
    assert dict(module.rollouts.engine.copy.model.named_parameters())[linear].dtype == torch.float32
    quiet_trainer(max_steps=1, limit_val_batches=0, precision="bf16-mixed").fit(module, arithmetic_data(8))
    copy = dict(module.rollouts.engine.copy.model.named_parameters())
    assert copy[linear].dtype == torch.bfloat16 and copy["model.embed_tokens.weight"].dtype == torch.float32
