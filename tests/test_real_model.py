"""One GRPO step of the real SmolLM2-135M-Instruct (from the PyPI package through `offline.smollm2`, no
hub) on a GSM8K prompt."""

import math

import pytest
import torch

from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.training.data import GSM8KDataModule
from grpo_lightning.training.module import GRPOModule
from tests.helpers import GSM8K_DIR, quiet_trainer


def test_chat_template_prompt(smollm2_dir):
    module = GRPOModule(smollm2_dir)
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
    ids, mask = module.rollouts.encoder.encode([prompt], "cpu")
    text = module.tokenizer.decode(ids[0][mask[0].bool()])
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert text.endswith("<|im_start|>assistant\n")
    assert module.tokenizer.eos_token == "<|im_end|>"


@pytest.mark.long
def test_one_grpo_step_on_smollm2(smollm2_dir):
    torch.manual_seed(0)
    module = GRPOModule(
        smollm2_dir,
        # No pre-flight: its sampling and reward audit cost about a quarter of this test's CPU time, and
        # tests/test_preflight.py covers them.
        grpo=GRPOConfig(
            num_generations=2, max_completion_length=16, learning_rate=1e-5, beta=0.04, preflight=False
        ),
    )
    data = GSM8KDataModule(source=GSM8K_DIR, batch_size=1, val_size=1, train_size=1)
    trainer = quiet_trainer(max_steps=1, limit_val_batches=0)
    before = module.policy  # loaded lazily
    assert before is None
    trainer.fit(module, data)
    m = {k: float(v) for k, v in trainer.logged_metrics.items()}
    for key in ["train/reward", "train/kl", "train/entropy", "train/grad_norm", "train/completion_length"]:
        assert math.isfinite(m[key]), key
    assert 1 <= m["train/completion_length"] <= 16
    assert m["train/kl"] == pytest.approx(0.0, abs=1e-6)  # on-policy first step: the policy is the reference
    assert (
        0.5 < m["train/entropy"] < 10.0
    )  # a trained LM: neither uniform over 49k tokens (10.8) nor collapsed
    assert 0.0 <= m["train/rewards/accuracy_reward"] <= 1.0
