"""`build_trajectory` alone: the loss mask, the KL charged to the reward, group advantages (also with the
batch std over several ranks), step credit, and the update pieces that read a trajectory."""

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer

from grpo_lightning.core.algorithm.advantages import AdvantageOptions, group_advantages
from grpo_lightning.core.algorithm.credit import step_credit_penalties
from grpo_lightning.core.algorithm.kl import kl_in_reward
from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.types import Rollout, ScoredGroups
from grpo_lightning.core.update import MicroBatchSums, build_trajectory, loss_mask
from grpo_lightning.training.manual_optimization import StepGuard

G = 4


def scored(rewards: list[float], T: int = 5, truncated: list[bool] | None = None, ids=None) -> ScoredGroups:
    B = len(rewards)
    completion_ids = ids if ids is not None else torch.arange(B * T).view(B, T) % 50 + 3  # [B, T]
    completion_mask = torch.ones(B, T, dtype=torch.long)
    completion_mask[::2, -2:] = 0  # ragged: every other completion ended early
    rollout = Rollout(
        torch.ones(B, 3, dtype=torch.long),
        torch.ones(B, 3, dtype=torch.long),
        completion_ids,
        completion_mask,
        torch.tensor(truncated if truncated is not None else [False] * B),
    )
    total = torch.tensor(rewards)  # [B]
    return ScoredGroups([f"p{i}" for i in range(B // G)], rollout, [""] * B, total[:, None], total, G)


def test_loss_mask_drops_truncated_completions_only_when_asked():
    groups = scored([1.0, 0.0, 1.0, 0.0], truncated=[False, True, False, False])
    kept = loss_mask(groups.rollout, mask_truncated_completions=False)
    assert torch.equal(kept, groups.rollout.completion_mask.float())
    dropped = loss_mask(groups.rollout, mask_truncated_completions=True)
    assert dropped[1].sum() == 0 and torch.equal(dropped[[0, 2, 3]], kept[[0, 2, 3]])
    built = build_trajectory(groups, GRPOConfig(num_generations=G, mask_truncated_completions=True))
    assert torch.equal(built.loss_mask, dropped)


@pytest.mark.parametrize(("scale", "baseline"), [("group", "mean"), ("none", "loo"), ("batch", "mean")])
def test_advantages_are_the_groups_of_the_rewards(scale, baseline):
    rewards = [1.0, 0.0, 0.5, 0.0, 2.0, 2.0, 1.0, 0.0]
    cfg = GRPOConfig(num_generations=G, scale_rewards=scale, baseline=baseline)
    t = build_trajectory(scored(rewards), cfg)
    expected = group_advantages(torch.tensor(rewards), G, AdvantageOptions(scale, baseline))
    torch.testing.assert_close(t.advantages, expected, atol=0, rtol=0)
    assert t.token_advantages is t.advantages and t.stats == {}  # no step credit, no KL in the reward


def test_batch_std_over_ranks_uses_every_ranks_rewards():
    """Two ranks' rewards: each rank's advantages are its slice of the advantages of the whole batch, which
    differ from those of its own rewards alone (the batch std is not the rank's)."""
    ranks = [[1.0, 0.0, 0.0, 0.0], [3.0, 0.0, 5.0, 1.0, 0.0, 0.0, 0.0, 2.0]]  # B differs between ranks
    everyone = torch.tensor(sum(ranks, []))
    cfg = GRPOConfig(num_generations=G, scale_rewards="batch")
    whole = group_advantages(everyone, G, AdvantageOptions("batch"))  # [12]
    start = 0
    for rank, own in enumerate(ranks):
        others = SimpleNamespace(world_size=2, rank=rank, gather=lambda values: ranks)  # core's `Ranks`
        gathered = build_trajectory(scored(own), cfg, ranks=others)
        alone = build_trajectory(scored(own), cfg)
        torch.testing.assert_close(gathered.advantages, whole[start : start + len(own)], atol=0, rtol=0)
        assert not torch.allclose(gathered.advantages, alone.advantages)
        start += len(own)


def test_kl_in_reward_moves_the_outcome_before_the_advantages():
    rewards = [1.0, 0.0, 1.0, 0.0]
    groups = scored(rewards)
    torch.manual_seed(0)
    old, ref = torch.randn(4, 5), torch.randn(4, 5)  # [B, T]
    cfg = GRPOConfig(num_generations=G, beta=0.1, use_kl_in_reward=True, kl_estimator="k1")
    t = build_trajectory(groups, cfg, old_logprobs=old, ref_logprobs=ref)
    outcome = kl_in_reward(torch.tensor(rewards), old, ref, groups.rollout.completion_mask, 0.1, "k1")  # [B]
    torch.testing.assert_close(t.advantages, group_advantages(outcome, G))
    torch.testing.assert_close(t.stats["kl_reward_penalty"], (torch.tensor(rewards) - outcome).mean())
    assert torch.equal(t.rewards, torch.tensor(rewards))  # the logged rewards are the functions'
    assert t.old_logprobs is old and t.ref_logprobs is ref


def test_step_credit_adds_the_penalties_per_token(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    texts = ["3 + 4 = 8", "3 + 4 = 7", "3 * 4 = 7", "no step"]
    encoded = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    T = max(map(len, encoded))
    ids = torch.tensor([e + [tokenizer.pad_token_id] * (T - len(e)) for e in encoded])  # [B, T]
    groups = scored([0.0, 1.0, 1.0, 0.0], T=T, ids=ids)
    groups.rollout.completion_mask = torch.tensor([[1] * len(e) + [0] * (T - len(e)) for e in encoded])
    t = build_trajectory(groups, GRPOConfig(num_generations=G, step_credit=0.5), tokenizer=tokenizer)
    penalties = step_credit_penalties(tokenizer, ids, groups.rollout.completion_mask, 0.5)  # [B, T]
    assert penalties[0].min() == -0.5 and penalties[2].min() == -0.5 and penalties[[1, 3]].abs().max() == 0
    torch.testing.assert_close(t.token_advantages, t.advantages[:, None] + penalties)
    frac = (penalties < 0).sum() / groups.rollout.completion_mask.sum()
    torch.testing.assert_close(t.stats["step_credit/frac_tokens"], frac)


def test_micro_batch_sums_add_the_loss_and_weight_the_means():
    sums = MicroBatchSums()
    sums.add(
        torch.tensor(1.0), {"policy_loss": torch.tensor(0.5), "kl": torch.tensor(2.0)}, torch.tensor(0.25)
    )
    sums.add(
        torch.tensor(3.0), {"policy_loss": torch.tensor(1.5), "kl": torch.tensor(4.0)}, torch.tensor(0.75)
    )
    assert sums.loss == 4.0 and sums.values["policy_loss"] == 2.0 and sums.values["kl"] == 3.5


def test_step_guard_skips_non_finite_updates_and_stops_after_max_bad_steps():
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    guard = StepGuard(max_bad_steps=2)
    weight.grad = torch.ones(2)
    with pytest.warns(UserWarning, match="not finite"):
        assert guard.step(optimizer, torch.tensor(float("nan")), torch.tensor(1.0), False, 0) is False
    assert guard.bad_steps == 1 and torch.equal(weight.detach(), torch.ones(2))
    weight.grad = torch.ones(2)
    assert guard.step(optimizer, torch.tensor(1.0), torch.tensor(1.0), False, 1) is True
    assert guard.bad_steps == 0 and torch.equal(weight.detach(), torch.zeros(2))
    with pytest.warns(UserWarning), pytest.raises(FloatingPointError, match="max_bad_steps=2"):
        for step in range(2):
            guard.step(optimizer, torch.tensor(1.0), torch.tensor(float("inf")), False, step)
