"""Numerical safety of the training step: non-finite steps are skipped and counted, empty masks give a
finite zero, bf16 models get float32 log-probs and loss. (The loss's own guards and its hypothesis
properties are in test_loss.py and test_loss_properties.py.)"""

import math

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision
from transformers import AutoModelForCausalLM

from grpo_lightning.core.algorithm.loss import grpo_loss
from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.io.models import ModelOptions
from grpo_lightning.training.data import GSM8KDataModule
from grpo_lightning.training.module import GRPOModule
from tests.helpers import length_reward, quiet_trainer


class Poisoned(GRPOModule):
    """The policy's log-probs turn NaN on the training batches numbered in `poisoned` (1-based), as a
    policy that overflows would; gradients through them are NaN too."""

    def __init__(self, *args, poisoned: set[int], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.poisoned, self.batches = poisoned, 0

    def training_step(self, batch, batch_idx):
        self.batches += 1
        return super().training_step(batch, batch_idx)

    def on_fit_start(self) -> None:
        super().on_fit_start()
        score = self.update.score

        def poisoned_score(model, rollout, rows, with_entropy=False):
            logprobs, entropies = score(model, rollout, rows, with_entropy)
            if self.batches in self.poisoned:
                logprobs = logprobs * math.nan
            return logprobs, entropies

        self.update.score = poisoned_score


class Snapshots(L.Callback):
    """The trainable weights, the optimizer's step count and the logged metrics after every batch."""

    def __init__(self) -> None:
        self.weights: list[dict[str, torch.Tensor]] = []
        self.skipped: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        named = pl_module.policy.named_parameters()
        self.weights.append({k: v.detach().clone() for k, v in named if v.requires_grad})
        self.skipped.append(float(trainer.callback_metrics["train/skipped_steps"]))


def setup_run(model_dir: str, root, poisoned: set[int], max_steps: int, **grpo):
    """A module, its data, a trainer and the snapshots callback, ready for `trainer.fit(module, data)`."""
    options = {
        "num_generations": 2,
        "max_completion_length": 4,
        "learning_rate": 1e-2,
        "max_bad_steps": 3,
        "preflight": False,
    } | grpo
    module = Poisoned(model_dir, reward_funcs=[length_reward], grpo=GRPOConfig(**options), poisoned=poisoned)
    data = GSM8KDataModule(
        source="arithmetic", system_prompt=None, arithmetic_size=30, batch_size=2, val_size=2
    )
    snapshots = Snapshots()
    trainer = quiet_trainer(
        max_steps=max_steps, limit_val_batches=0, callbacks=[snapshots], default_root_dir=str(root)
    )
    return module, data, trainer, snapshots


def assert_same_weights(a: dict, b: dict) -> None:
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)


def test_non_finite_steps_are_skipped_counted_and_training_goes_on(tiny_model_dir, tmp_path):
    module, data, trainer, snapshots = setup_run(tiny_model_dir, tmp_path, poisoned={2, 3}, max_steps=3)
    with pytest.warns(UserWarning, match="loss or gradient not finite, update skipped") as caught:
        trainer.fit(module, data)
    assert sum("update skipped" in str(w.message) for w in caught) == 2
    # Batches 2 and 3 changed nothing; 1, 4 and 5 updated: max_steps counts updates.
    assert len(snapshots.weights) == 5 and trainer.global_step == 3
    assert_same_weights(snapshots.weights[1], snapshots.weights[0])
    assert_same_weights(snapshots.weights[2], snapshots.weights[0])
    assert not torch.equal(snapshots.weights[3]["lm_head.weight"], snapshots.weights[0]["lm_head.weight"])
    assert snapshots.skipped == [0, 1, 2, 0, 0]  # consecutive bad steps, reset by a good one
    optimizer = trainer.optimizers[0]
    assert all(int(s["step"]) == 3 for s in optimizer.state.values())  # AdamW saw only the 3 good steps
    assert all(torch.isfinite(p).all() for p in module.policy.parameters())


def test_training_stops_after_max_bad_steps_with_the_weights_of_the_last_good_step(tiny_model_dir, tmp_path):
    module, data, trainer, snapshots = setup_run(tiny_model_dir, tmp_path, poisoned={2, 3, 4}, max_steps=10)
    with pytest.raises(FloatingPointError) as error, pytest.warns(UserWarning, match="update skipped"):
        trainer.fit(module, data)
    assert str(error.value).startswith(
        "3 consecutive steps with a non-finite loss or gradient (max_bad_steps=3): lower the learning rate"
    )
    assert trainer.global_step == 1 and module.batches == 4
    after = {k: v for k, v in module.policy.named_parameters() if v.requires_grad}
    assert_same_weights(after, snapshots.weights[0])  # no NaN reached the weights
    saved = torch.load(tmp_path / "checkpoints" / "interrupted.ckpt", weights_only=True)  # to resume from
    assert saved["global_step"] == 1 and saved["grpo_state"]["bad_steps"] == 3


def test_a_step_with_every_token_masked_is_finite_and_not_skipped(tiny_model_dir, tmp_path):
    # EOS suppressed, so every completion is truncated, and masking truncated completions masks all tokens.
    module, data, trainer, snapshots = setup_run(
        tiny_model_dir,
        tmp_path,
        poisoned=set(),
        max_steps=2,
        min_completion_length=4,
        mask_truncated_completions=True,
    )
    with pytest.warns(UserWarning) as caught:  # "all completions truncated", and nothing about non-finite
        trainer.fit(module, data)
    assert not any("not finite" in str(w.message) for w in caught)
    assert trainer.global_step == 2 and snapshots.skipped == [0, 0]
    assert float(trainer.callback_metrics["train/loss"]) == 0.0


def test_bf16_policy_gets_float32_logprobs_and_loss(tiny_model_dir):
    module = GRPOModule(
        tiny_model_dir,
        model_options=ModelOptions(dtype="bfloat16"),
        # Padded passes, as the reference below: bf16 rounds the same rows otherwise in another layout
        # (packed rows differ from it by up to 2e-3 here), which is not what this test is about.
        grpo=GRPOConfig(num_generations=2, max_completion_length=6, preflight=False, packed_sequences=False),
    )
    module.configure_model()
    assert module.policy.dtype == torch.bfloat16
    torch.manual_seed(0)
    rollout, _ = module.rollouts.sample([[{"role": "user", "content": "What is 2 + 3?"}]], 2)
    scorer = module.rollouts.scorer
    logprobs, entropies = scorer(module.policy, rollout, slice(None), with_entropy=True)  # [2, T]
    assert logprobs.dtype == torch.float32 and entropies.dtype == torch.float32

    # The reference: the bf16 model's logits, upcast before the log-softmax.
    T = rollout.completion_ids.size(1)
    with torch.no_grad():
        logits = module.policy(input_ids=rollout.input_ids, attention_mask=rollout.attention_mask).logits
    logits = logits[:, -T - 1 : -1]  # [2, T, V] bf16, position t predicting token t + 1
    targets = rollout.completion_ids[..., None]  # [2, T, 1]
    expected = logits.float().log_softmax(-1).gather(-1, targets)[..., 0]  # [2, T]
    mask = rollout.completion_mask.bool()
    torch.testing.assert_close(logprobs[mask], expected[mask], rtol=0, atol=1e-5)
    # A bf16 log-softmax would be off by far more than that (bf16 keeps about 3 significant digits).
    in_bf16 = logits.log_softmax(-1).gather(-1, targets)[..., 0]  # [2, T]
    assert (in_bf16.float() - expected)[mask].abs().max() > 1e-3

    loss, _ = grpo_loss(logprobs, torch.tensor([1.0, -1.0]), rollout.completion_mask)
    assert loss.dtype == torch.float32


def first_step_metrics(model_dir: str, root, trainer_kwargs: dict | None = None, **grpo) -> dict[str, float]:
    """The metrics logged by one training step of a tiny policy on the arithmetic task (seed 0)."""
    L.seed_everything(0)
    options = {"num_generations": 4, "max_completion_length": 6, "preflight": False} | grpo
    module = GRPOModule(model_dir, reward_funcs=[length_reward], grpo=GRPOConfig(**options))
    data = GSM8KDataModule(
        source="arithmetic", system_prompt=None, arithmetic_size=30, batch_size=2, val_size=2
    )
    trainer = quiet_trainer(
        max_steps=1, limit_val_batches=0, default_root_dir=str(root), **(trainer_kwargs or {})
    )
    trainer.fit(module, data)
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


def test_policy_loss_is_the_rollouts_whatever_the_micro_batches(tiny_model_dir, tmp_path):
    # Clipped advantages no longer sum to 0 over a group, so the on-policy loss is not 0 either.
    whole = first_step_metrics(tiny_model_dir, tmp_path / "whole", advantage_clip=0.5)
    split = first_step_metrics(tiny_model_dir, tmp_path / "split", advantage_clip=0.5, micro_batch_size=2)
    assert abs(whole["train/policy_loss"]) > 1e-3
    assert split["train/policy_loss"] == pytest.approx(whole["train/policy_loss"], rel=1e-4)  # was 1/4 of it
    assert split["train/loss"] == pytest.approx(whole["train/loss"], rel=1e-4)
    assert split["train/entropy"] == pytest.approx(whole["train/entropy"], rel=1e-4)


def test_16_mixed_clips_and_logs_the_unscaled_gradient(tiny_model_dir, tmp_path):
    """Under 16-mixed the loss is scaled by the GradScaler (2**16 here) before backward: the gradient norm
    logged and clipped is the true one, as with float32, not 65536 times it."""
    full = first_step_metrics(tiny_model_dir, tmp_path / "fp32")
    # Lightning keeps a GradScaler for CUDA only; on CPU the test hands one to the precision plugin.
    scaled = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**16))
    mixed = first_step_metrics(tiny_model_dir, tmp_path / "fp16", {"plugins": [scaled]})
    assert full["train/grad_norm"] > 0
    assert mixed["train/grad_norm"] == pytest.approx(full["train/grad_norm"], rel=0.05)


def test_16_mixed_overflow_lowers_the_loss_scale_instead_of_stopping(tiny_model_dir, tmp_path):
    L.seed_everything(0)
    module = GRPOModule(
        tiny_model_dir,
        reward_funcs=[length_reward],
        grpo=GRPOConfig(num_generations=4, max_completion_length=6, max_bad_steps=1, preflight=False),
    )
    data = GSM8KDataModule(
        source="arithmetic", system_prompt=None, arithmetic_size=30, batch_size=2, val_size=2
    )
    # A scale that overflows fp16 at once, and a back-off that makes the next one fit.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40, backoff_factor=2.0**-30)
    snapshots = Snapshots()
    trainer = quiet_trainer(
        max_steps=2,
        limit_val_batches=0,
        default_root_dir=str(tmp_path),
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
        callbacks=[snapshots],
    )
    with pytest.warns(UserWarning, match="fp16 gradients overflowed, update skipped") as caught:
        trainer.fit(module, data)  # max_bad_steps=1: an overflow counted as a bad step would stop here
    assert sum("overflowed" in str(w.message) for w in caught) == 1
    assert scaler.get_scale() == 2.0**10
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir).lm_head.weight
    assert torch.equal(snapshots.weights[0]["lm_head.weight"], initial)  # the overflowed step changed nothing
    assert not torch.equal(snapshots.weights[1]["lm_head.weight"], initial)  # the second one updated
