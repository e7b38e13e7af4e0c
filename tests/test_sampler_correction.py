"""The sampler/scorer gap and its truncated importance-sampling correction (Yao et al. 2025): the weights on
a hand-computed case, no change at all where the sampler is the scorer, and the gap logged every training
step (about 0 for the eager engine in float32)."""

import lightning as L
import pytest
import torch

from grpo_lightning.core.algorithm.loss import grpo_loss
from grpo_lightning.core.algorithm.sampler_correction import importance_weights, logprob_gap_stats
from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.types import Rollout, Trajectory
from grpo_lightning.core.update import micro_batch_loss
from grpo_lightning.training.data import GSM8KDataModule
from tests.helpers import length_reward, quiet_trainer, tiny_module


def test_weights_and_loss_by_hand():
    """One completion of 3 tokens, advantage 2, on-policy (ratio 1), cap 2, dapo: each token's loss is
    -w_t * A / 3 with w = min(exp(log pi - log pi_sampler), 2), and so is its gradient."""
    logprobs = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    sampler = torch.tensor([[-1.2, -1.0, -2.5]])  # log-ratios 0.2, -1.0, 2.0 (the last above log 2)
    weights, _ = importance_weights(logprobs, sampler, torch.ones(1, 3), "token_truncate", cap=2.0)
    expected = torch.tensor([[1.2214028, 0.3678794, 2.0]])  # e^0.2, e^-1, min(e^2, 2)
    torch.testing.assert_close(weights, expected)
    assert not weights.requires_grad
    loss, _ = grpo_loss(logprobs, torch.tensor([2.0]), torch.ones(1, 3), importance_weights=weights)
    torch.testing.assert_close(loss, torch.tensor(-2.0 / 3 * (1.2214028 + 0.3678794 + 2.0)))
    loss.backward()
    torch.testing.assert_close(logprobs.grad, -2.0 / 3 * expected)
    mask = torch.tensor([[1, 1, 0]])  # the last is padding
    gap = logprob_gap_stats(logprobs, sampler, mask, importance_weights(logprobs, sampler, mask, cap=2.0))
    torch.testing.assert_close(gap["rollout/logp_gap_mean"], torch.tensor(0.6))
    torch.testing.assert_close(gap["rollout/logp_gap_max"], torch.tensor(1.0))
    torch.testing.assert_close(gap["rollout/logp_gap_frac_above"], torch.tensor(1.0))
    torch.testing.assert_close(gap["rollout/is_weight_mean"], torch.tensor((1.2214028 + 0.3678794) / 2))
    assert float(gap["rollout/is_weight_frac_capped"]) == 0.0


CAPS = [round(1 + i / 10, 1) for i in range(91)]  # 1.0, 1.1, ..., 10.0


def test_the_capped_share_counts_every_capped_weight_whatever_the_cap():
    """float32, for each of 91 caps from 1 to 10: the first row's weights are all far above the cap (its
    sampler 5 nats below the scorer), the second row's below 1. The share is one half for every cap: the
    capped weight itself, exp(log cap) in float32, lands one step below the cap for some (3.5, 7.0, ...),
    so the share is read before capping."""
    scorer = torch.full((2, 4), -1.0)  # [B, T] float32
    sampler = torch.stack([scorer[0] - 5.0, scorer[1] + 0.5])  # [B, T]
    wrong = {}
    for cap in CAPS:
        mask = torch.ones(2, 4)
        stats = logprob_gap_stats(scorer, sampler, mask, importance_weights(scorer, sampler, mask, cap=cap))
        if float(stats["rollout/is_weight_frac_capped"]) != 0.5:
            wrong[cap] = float(stats["rollout/is_weight_frac_capped"])
    assert wrong == {}
    weights, _ = importance_weights(scorer, sampler, torch.ones(2, 4), cap=3.5)
    assert float(weights[0].max()) < 3.5  # the capped weight rounds below its cap, as said above


def trajectory(sampler_equals_scorer: bool, with_old: bool, seed: int = 0) -> tuple[Trajectory, torch.Tensor]:
    """Two groups of 2 completions of 5 tokens (some padding), and the policy's log-probs (with grad)."""
    g = torch.Generator().manual_seed(seed)
    B, T = 4, 5
    logprobs = (-torch.rand(B, T, generator=g) * 3).requires_grad_()
    mask = torch.ones(B, T)
    mask[1, 3:] = mask[3, 4:] = 0
    old = logprobs.detach() + 0.05 * torch.randn(B, T, generator=g) if with_old else None
    scorer = old if with_old else logprobs.detach()
    sampler = scorer.clone() if sampler_equals_scorer else scorer + 0.3 * torch.randn(B, T, generator=g)
    ids = torch.zeros(B, T, dtype=torch.long)
    rollout = Rollout(
        ids[:, :2], torch.ones(B, 2), ids, mask.long(), torch.zeros(B, dtype=torch.bool), sampler
    )
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    return Trajectory(
        prompts=["a", "b"],
        rollout=rollout,
        completions=[""] * B,
        loss_mask=mask,
        old_logprobs=old,
        ref_logprobs=None,
        rewards_per_func=torch.zeros(B, 1),
        rewards=torch.zeros(B),
        advantages=advantages,
        token_advantages=advantages,
        num_generations=2,
    ), logprobs


def loss_and_grad(trajectory_: Trajectory, logprobs: torch.Tensor, correction: bool, loss_type: str):
    cfg = GRPOConfig(importance_sampling_correction=correction, loss_type=loss_type, beta=0.0)
    logprobs.grad = None
    loss, stats = micro_batch_loss(
        trajectory_,
        slice(None),
        logprobs,
        torch.zeros_like(logprobs),
        cfg,
        torch.tensor(17.0),
        torch.tensor(4.0),
    )
    loss.backward()
    return loss.detach(), logprobs.grad.clone(), stats


@pytest.mark.parametrize("with_old", [False, True], ids=["one-step", "old-logprobs"])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "cispo"])
def test_correction_changes_nothing_where_the_sampler_is_the_scorer(with_old, loss_type):
    same, logprobs = trajectory(sampler_equals_scorer=True, with_old=with_old)
    loss, grad, stats = loss_and_grad(same, logprobs, correction=False, loss_type=loss_type)
    corrected, corrected_grad, corrected_stats = loss_and_grad(same, logprobs, True, loss_type)
    torch.testing.assert_close(corrected, loss, rtol=0, atol=1e-6)
    torch.testing.assert_close(corrected_grad, grad, rtol=0, atol=1e-6)
    assert float(stats["rollout/logp_gap_max"]) == 0.0
    assert float(corrected_stats["rollout/is_weight_mean"]) == pytest.approx(1.0)
    # Where they differ, the correction changes the gradient by the weights: it is not a no-op.
    apart, logprobs = trajectory(sampler_equals_scorer=False, with_old=with_old)
    _, plain_grad, plain_stats = loss_and_grad(apart, logprobs, False, loss_type)
    _, weighted_grad, _ = loss_and_grad(apart, logprobs, True, loss_type)
    scorer = apart.old_logprobs if with_old else logprobs.detach()
    weights = (
        (scorer - apart.rollout.sampler_logprobs).exp().clamp(max=2.0)
    )  # TIS: min(pi_old / pi_sampler, 2)
    torch.testing.assert_close(weighted_grad, plain_grad * weights, rtol=1e-5, atol=1e-7)
    assert float(plain_stats["rollout/logp_gap_mean"]) > 0.1


class StepMetrics(L.Callback):
    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def test_gap_is_logged_every_step_and_about_zero_for_eager_float32(tiny_model_dir):
    """The eager engine samples the float32 policy itself: its log-probs are the scorer's up to rounding.
    With 2 optimizer steps per rollout the gap is taken against the rollout-time log-probs."""
    for steps_per_generation in (1, 2):
        module = tiny_module(
            tiny_model_dir,
            reward_funcs=[length_reward],
            learning_rate=1e-2,
            steps_per_generation=steps_per_generation,
            importance_sampling_correction=True,
        )
        data = GSM8KDataModule(
            source="arithmetic", system_prompt=None, arithmetic_size=16, batch_size=2, val_size=2
        )
        metrics = StepMetrics()
        steps = 2 * steps_per_generation
        quiet_trainer(max_steps=steps, limit_val_batches=0, callbacks=[metrics]).fit(module, data)
        assert len(metrics.steps) == 2
        for logged in metrics.steps:
            assert 0 <= logged["rollout/logp_gap_mean"] < 1e-5, logged
            assert logged["rollout/logp_gap_max"] < 1e-4 and logged["rollout/logp_gap_frac_above"] == 0.0
            assert logged["rollout/is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
            assert logged["rollout/tokens_per_second"] > 0 and logged["rollout/ms_per_decoding_step"] > 0


def test_importance_sampling_modes_bound_tokens_or_sequences_as_trl_does():
    """TRL 1.16's four modes (`vllm_importance_sampling_mode`) on one batch: ratios per token or per
    completion (the product over its tokens), clipped into [floor, cap] or zeroed outside it."""
    from grpo_lightning.core.algorithm.sampler_correction import importance_weights

    scorer = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    sampler = torch.tensor([[-1.5, 0.5, 0.0], [-0.2, -0.1, 0.0]])  # ratios e^1.5, e^-0.5, 1; e^0.2, e^0.1
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # the last token of row 1 is padding
    ratio = (scorer - sampler).exp()  # [2, 3]
    outside = (ratio < 0.7) | (ratio > 2.0)  # [2, 3]
    weights, bounded = importance_weights(scorer, sampler, mask, "token_truncate", cap=2.0, floor=0.7)
    torch.testing.assert_close(weights, ratio.clamp(0.7, 2.0))
    assert torch.equal(bounded, outside)
    weights, bounded = importance_weights(scorer, sampler, mask, "token_mask", cap=2.0, floor=0.7)
    torch.testing.assert_close(weights, torch.where(outside, 0.0, ratio))
    assert torch.equal(bounded, outside)
    sequence = torch.tensor([1.5 - 0.5, 0.2 + 0.1]).exp()  # [2] the masked tokens' product
    weights, bounded = importance_weights(scorer, sampler, mask, "sequence_truncate", cap=1.3, floor=None)
    torch.testing.assert_close(weights, sequence.clamp(max=1.3)[:, None].expand(2, 3))
    assert bounded.tolist() == [[True] * 3, [True] * 3]  # e^1.0 and e^0.3 above the cap 1.3
    weights, bounded = importance_weights(scorer, sampler, mask, "sequence_mask", cap=2.0, floor=None)
    torch.testing.assert_close(weights, torch.tensor([[0.0] * 3, [float(sequence[1])] * 3]))
    assert bounded.tolist() == [[True] * 3, [False] * 3]  # e^1.0 above the cap 2.0, e^0.3 below
    plain, _ = importance_weights(scorer, sampler, mask, "token_truncate", cap=2.0)
    torch.testing.assert_close(
        plain, (scorer - sampler).exp().clamp(max=2.0)
    )  # TIS: min(pi_old / pi_sampler, 2)
