"""KL in the reward (verl's `algorithm.use_kl_in_reward`): reward_i -= beta * sum_t KL_t before the
advantages are computed, and then no KL term in the loss."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import grpo_lightning.core.update
from grpo_lightning.core.algorithm.advantages import group_advantages
from grpo_lightning.core.algorithm.kl import kl_in_reward
from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.generation.logprobs import completion_logprobs
from grpo_lightning.training.module import GRPOModule
from tests.test_dynamic_sampling import G, StepSpy, fit_on_rows, rows

LOGPROBS = torch.tensor([[-0.5, -1.0, -2.0], [-0.1, -0.3, math.nan]])  # [2, 3], padding holds garbage
REF_LOGPROBS = torch.tensor([[-0.7, -0.4, -2.0], [-0.2, -0.1, math.inf]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
REWARDS = torch.tensor([1.0, 0.0])


def test_k1_in_the_reward_subtracts_beta_times_the_summed_log_ratio():
    # k1 = log pi - log pi_ref: row 0: 0.2 - 0.6 + 0 = -0.4, row 1: 0.1 - 0.2 = -0.1 (padding left out).
    penalised = kl_in_reward(REWARDS, LOGPROBS, REF_LOGPROBS, MASK, beta=0.1, estimator="k1")
    torch.testing.assert_close(penalised, torch.tensor([1.0 + 0.04, 0.0 + 0.01]))


def test_k3_in_the_reward_uses_the_k3_estimate():
    def k3(log_ratio: float) -> float:  # r - log r - 1 with log r = log pi_ref - log pi
        return math.exp(log_ratio) - log_ratio - 1

    expected = [1.0 - 0.1 * (k3(-0.2) + k3(0.6) + k3(0.0)), 0.0 - 0.1 * (k3(-0.1) + k3(0.2))]
    penalised = kl_in_reward(REWARDS, LOGPROBS, REF_LOGPROBS, MASK, beta=0.1, estimator="k3")
    torch.testing.assert_close(penalised, torch.tensor(expected))


def test_kl_in_reward_needs_beta():
    with pytest.raises(ValueError, match="use_kl_in_reward"):
        GRPOConfig(use_kl_in_reward=True, beta=0.0)


def zero_reward(completions: list[str], **kwargs) -> list[float]:
    return [0.0] * len(completions)


@pytest.mark.parametrize("use_kl_in_reward", [False, True])
def test_the_kl_moves_from_the_loss_into_the_advantages(tiny_model_dir, monkeypatch, use_kl_in_reward):
    beta = 0.5
    module = GRPOModule(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        AutoTokenizer.from_pretrained(tiny_model_dir),
        reward_funcs=[zero_reward],  # every group flat: any advantage comes from the KL
        grpo=GRPOConfig(
            num_generations=G,
            max_completion_length=6,
            learning_rate=1e-3,
            beta=beta,
            kl_estimator="k1" if use_kl_in_reward else "k3",  # k1 in the loss is refused
            use_kl_in_reward=use_kl_in_reward,
            log_completions_every=0,
            preflight=False,
        ),
    )
    torch.manual_seed(0)
    with torch.no_grad():  # a reference away from the policy, so that the KL is not zero
        for p in module.reference.parameters():
            p.add_(0.05 * torch.randn_like(p))

    betas = []
    loss = grpo_lightning.core.update.grpo_loss

    def recording_loss(logprobs, advantages, mask, options, kl, **kwargs):
        betas.append(kl.loss_beta)
        return loss(logprobs, advantages, mask, options, kl, **kwargs)

    monkeypatch.setattr(grpo_lightning.core.update, "grpo_loss", recording_loss)

    @torch.no_grad()
    def logprobs_before_the_update(rollout, mask):
        T = rollout.completion_ids.size(1)
        return [
            completion_logprobs(m, rollout.input_ids, rollout.attention_mask, T)[0]  # [B, T]
            for m in (module.policy, module.reference)
        ]

    spy = StepSpy(module, hook=logprobs_before_the_update)
    recorder = fit_on_rows(module, rows("a", "b"), max_steps=1)

    (call,) = spy.calls
    (update,) = recorder.updates
    assert update.metrics["train/kl"] > 0  # the KL is measured either way
    if not use_kl_in_reward:
        assert betas == [beta]
        assert call.advantages.eq(0).all()
        return
    assert betas == [0.0]  # no KL term in the loss
    policy, reference = call.extra
    kl_sums = ((policy - reference) * call.rollout.completion_mask).sum(dim=1)  # [B] k1 over the tokens
    expected = group_advantages(-beta * kl_sums, G)  # [B]
    assert expected.abs().min() > 0.1
    torch.testing.assert_close(call.advantages, expected, atol=1e-4, rtol=1e-4)
    assert update.metrics["train/kl_reward_penalty"] == pytest.approx(float(beta * kl_sums.mean()), rel=1e-4)
    assert update.metrics["train/reward"] == 0.0  # the reward functions' total, as logged
