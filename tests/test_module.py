"""End to end: `cli.py fit` on a tiny random model, and the module's own contracts, its validation
(`training.validation_scores`) included."""

import math
import os

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoModelForCausalLM

from grpo_lightning.cli import build_cli
from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.training.module import GRPOModule
from tests.helpers import GSM8K_DIR, quiet_trainer

EXPECTED_SCALARS = [
    "train/reward",
    "train/reward_std",
    "train/frac_reward_zero_std",
    "train/rewards/accuracy_reward",
    "train/rewards/format_reward",
    "train/rewards/digit_reward",
    "train/kl",
    "train/entropy",
    "train/clip_ratio/low_mean",
    "train/clip_ratio/high_mean",
    "train/clip_ratio/region_mean",
    "train/completion_length",
    "train/completion_length_min",
    "train/completion_length_max",
    "train/frac_truncated",
    "train/grad_norm",
    "train/learning_rate",
    "train/tokens_per_second",
    "val/accuracy",
    "val/accuracy_strict",
    "val/pass_at_k",
    "val/maj_at_k",
]


def fit_args(model_dir: str, root: str, *extra: str) -> list[str]:
    return [
        "fit",
        f"--model.policy={model_dir}",
        "--model.reward_funcs=[grpo_lightning.core.rewards.verifiable.accuracy_reward, "
        "grpo_lightning.core.rewards.verifiable.format_reward, tests.helpers.digit_reward]",
        "--model.grpo.num_generations=4",
        "--model.grpo.max_completion_length=12",
        "--model.grpo.beta=0.04",
        "--model.grpo.learning_rate=1e-3",
        f"--data.source={GSM8K_DIR}",
        "--data.batch_size=2",
        "--data.val_size=4",
        "--data.val_batch_size=4",
        "--trainer.accelerator=cpu",
        "--trainer.max_steps=3",
        "--trainer.val_check_interval=3",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.log_every_n_steps=1",
        "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={root}",
        "--trainer.logger=lightning.pytorch.loggers.TensorBoardLogger",
        f"--trainer.logger.save_dir={root}",
        *extra,
    ]


def test_cli_fit_logs_metrics_and_updates_only_the_policy(tiny_model_dir, tmp_path):
    cli = build_cli(fit_args(tiny_model_dir, str(tmp_path)))
    module = cli.model
    assert cli.trainer.global_step == 3

    logged = cli.trainer.logged_metrics
    for key in EXPECTED_SCALARS:
        assert key in logged, key
        assert math.isfinite(float(logged[key])), key
    assert 0.0 <= float(logged["val/accuracy"]) <= 1.0

    # The same scalars reach TensorBoard, one point per training step.
    event_dir = cli.trainer.logger.log_dir
    events = EventAccumulator(event_dir)
    events.Reload()
    assert len(events.Scalars("train/reward")) == 3
    assert "val/accuracy" in events.Tags()["scalars"]

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    base_state = base.state_dict()
    policy_state = module.policy.state_dict()
    changed = [k for k in base_state if not torch.equal(base_state[k], policy_state[k])]
    assert len(changed) >= len(base_state) // 2, "the policy barely moved"
    for key, value in module.reference.state_dict().items():
        assert torch.equal(value, base_state[key]), f"reference weight {key} moved"
    assert not any(p.requires_grad for p in module.reference.parameters())
    assert not module.reference.training
    optimized = {id(p) for group in module.optimizers().optimizer.param_groups for p in group["params"]}
    assert not optimized & {id(p) for p in module.reference.parameters()}


def test_checkpoint_does_not_store_the_reference(tiny_model_dir, tmp_path):
    cli = build_cli(
        fit_args(tiny_model_dir, str(tmp_path), "--trainer.max_steps=1", "--trainer.limit_val_batches=0")
    )
    path = os.path.join(tmp_path, "model.ckpt")
    cli.trainer.save_checkpoint(path)
    state = torch.load(path, weights_only=False)["state_dict"]
    assert any(k.startswith("policy.") for k in state)
    assert not any(k.startswith("reference.") for k in state)
    restored = GRPOModule.load_from_checkpoint(path, policy=tiny_model_dir)
    for key, value in cli.model.policy.state_dict().items():
        assert torch.equal(restored.policy.state_dict()[key], value)


def test_beta_zero_loads_no_reference(tiny_model_dir):
    module = GRPOModule(tiny_model_dir, grpo=GRPOConfig(beta=0.0))
    module.configure_model()
    assert module.reference is None


def test_sample_groups_and_masks(tiny_model_dir):
    torch.manual_seed(0)
    module = GRPOModule(tiny_model_dir, grpo=GRPOConfig(num_generations=3, max_completion_length=10))
    module.configure_model()
    prompts = [[{"role": "user", "content": "What is 2 + 3?"}], [{"role": "user", "content": "Hi"}]]
    rollout, completions = module.rollouts.sample(prompts, 3)
    assert rollout.completion_ids.shape[0] == 6 and len(completions) == 6
    # Each group repeats its own prompt.
    assert torch.equal(rollout.prompt_ids[0], rollout.prompt_ids[2])
    assert not torch.equal(rollout.prompt_ids[0], rollout.prompt_ids[3])
    eos = module.tokenizer.eos_token_id
    for ids, mask, truncated in zip(
        rollout.completion_ids, rollout.completion_mask, rollout.truncated, strict=True
    ):
        n = int(mask.sum())
        assert mask[:n].all() and not mask[n:].any()  # mask is a prefix
        assert truncated == (eos not in ids[:n].tolist())
        if not truncated:
            assert ids[n - 1] == eos


def test_prompt_without_chat_template_is_a_clear_error(tiny_model_dir):
    module = GRPOModule(tiny_model_dir)
    module.tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        module.rollouts.encoder.encode([[{"role": "user", "content": "hi"}]], "cpu")


def test_validate_then_fit_with_validation(tiny_model_dir, tmp_path):
    """`trainer.validate` (inference mode) before a `fit` that validates (no_grad): the demo's sequence."""

    from grpo_lightning.training.data import GSM8KDataModule

    module = GRPOModule(
        tiny_model_dir, grpo=GRPOConfig(num_generations=2, max_completion_length=4, preflight=False)
    )
    data = GSM8KDataModule(
        source="arithmetic", batch_size=2, val_size=4, val_batch_size=4, arithmetic_size=20
    )
    trainer = quiet_trainer(max_steps=2, val_check_interval=1, default_root_dir=str(tmp_path))
    before = trainer.validate(module, data)[0]
    trainer.fit(module, data)
    assert 0.0 <= before["val/accuracy"] <= 1.0
    assert "val/accuracy" in trainer.logged_metrics


def test_num_iterations_reuses_one_rollout_for_several_updates(tiny_model_dir, tmp_path, monkeypatch):
    """mu = 2: one rollout, two optimizer steps, the second against the sampling policy's log-probs."""

    import grpo_lightning.core.update as module_file
    from grpo_lightning.training.data import GSM8KDataModule

    seen_old = []
    real_loss = module_file.grpo_loss

    def spy(logprobs, *args, old_logprobs=None, **kwargs):
        seen_old.append((old_logprobs.clone(), logprobs.detach().clone()))
        return real_loss(logprobs, *args, old_logprobs=old_logprobs, **kwargs)

    monkeypatch.setattr(module_file, "grpo_loss", spy)
    grpo = GRPOConfig(
        num_generations=2, max_completion_length=6, num_iterations=2, learning_rate=1e-2, preflight=False
    )

    def alternating_reward(completions, **kwargs):  # each group of 2 gets 0 and 1: the advantages are never 0
        return [float(i % 2) for i in range(len(completions))]

    module = GRPOModule(tiny_model_dir, reward_funcs=[alternating_reward], grpo=grpo)
    data = GSM8KDataModule(source="arithmetic", batch_size=2, val_size=2, arithmetic_size=20)
    trainer = quiet_trainer(max_steps=2, limit_val_batches=0, default_root_dir=str(tmp_path))
    trainer.fit(module, data)
    assert trainer.global_step == 2 and trainer.fit_loop.epoch_loop.batch_progress.total.completed == 1
    (old_1, new_1), (old_2, new_2) = seen_old
    torch.testing.assert_close(old_1, old_2)  # both passes compare with the same sampling-time log-probs
    torch.testing.assert_close(new_1, old_1, atol=1e-5, rtol=0)  # first pass: policy = sampling policy
    assert (new_2 - old_2).abs().max() > 1e-4  # second pass: the policy moved after the first update
