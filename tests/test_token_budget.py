"""The token-budget partition of a rollout into micro-batches: every row once, groups intact, the budget
held (a unit too long for it alone gets its own micro-batch), rows of similar length together."""

from itertools import pairwise

import lightning as L
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_lightning.core.algorithm.token_budget import (
    over_budget,
    token_budget_micro_batches,
)
from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.generation.scorer import LogProbScorer
from grpo_lightning.core.ranks import OneProcess
from grpo_lightning.core.types import ScoredGroups
from grpo_lightning.core.update import (
    MicroBatchSums,
    build_trajectory,
    logprobs_in_micro_batches,
    micro_batch_losses,
    micro_batches,
    mini_batch_denominators,
)
from grpo_lightning.training.data import GSM8KDataModule
from tests.helpers import length_reward, quiet_trainer, tiny_module
from tests.test_share_prompt import PROMPTS, float64_norms, grads, load_tiny, make_rollout


def unit_longest(lengths, rows, group_size):
    """The longest row of each unit (group) in `rows`."""
    starts = sorted({r - r % group_size for r in rows})
    return [max(lengths[s : s + group_size]) for s in starts]


def padded_tokens(lengths: list[int], micro_batches: list[list[int]]) -> int:
    """Tokens computed when each micro-batch is padded to its own longest row: sum of rows x longest."""
    return sum(len(rows) * max(lengths[r] for r in rows) for rows in micro_batches)


@settings(max_examples=300, deadline=None)
@given(
    group_size=st.integers(1, 4),
    groups=st.integers(1, 12),
    budget=st.integers(1, 400),
    data=st.data(),
)
def test_partition_invariants(group_size, groups, budget, data):
    lengths = data.draw(
        st.lists(st.integers(1, 100), min_size=groups * group_size, max_size=groups * group_size)
    )
    micro_batches = token_budget_micro_batches(lengths, budget, group_size)

    rows = sorted(r for mb in micro_batches for r in mb)
    assert rows == list(range(len(lengths)))  # every row exactly once
    for mb in micro_batches:
        assert mb == sorted(mb)
        for r in mb:  # a group never straddles two micro-batches
            assert all(g in mb for g in range(r - r % group_size, r - r % group_size + group_size))
    too_long = over_budget(lengths, micro_batches, budget)
    for i, mb in enumerate(micro_batches):
        if i in too_long:  # over the budget only as one unit that does not fit it alone
            assert len(mb) == group_size and group_size * max(lengths[r] for r in mb) > budget
    # Longest first, and contiguous in length: no unit of a later micro-batch is longer than one before.
    for earlier, later in pairwise(micro_batches):
        assert min(unit_longest(lengths, earlier, group_size)) >= max(
            unit_longest(lengths, later, group_size)
        )
    # Padding each micro-batch to its own longest row never costs more than padding all to the longest.
    assert sum(lengths) <= padded_tokens(lengths, micro_batches) <= len(lengths) * max(lengths)


def test_a_worked_example():
    lengths = [300, 120, 110, 1000, 130, 100]
    # Budget 400: 1000 alone (over), 300 alone (300 + 130 padded to 300 would be 600), then
    # 130, 120, 110 (3 x 130 = 390), then 100.
    micro_batches = token_budget_micro_batches(lengths, 400)
    assert micro_batches == [[3], [0], [1, 2, 4], [5]]
    assert over_budget(lengths, micro_batches, 400) == [0]
    assert padded_tokens(lengths, micro_batches) == 1000 + 300 + 390 + 100

    # Groups of 2 (shared prompts): rows (0, 1), (2, 3), (4, 5) move together.
    assert token_budget_micro_batches(lengths, 2000, group_size=2) == [[2, 3], [0, 1, 4, 5]]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="5 rows cannot be cut into groups of 2"):
        token_budget_micro_batches([1] * 5, 10, group_size=2)
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch=0: must be >= 1"):
        token_budget_micro_batches([1], 0)


# The loss types whose micro-batch losses add up to the step's whatever the cut (bnpo's, TRL's, do not).
LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "cispo")


def float64_trajectory(model_dir: str, share_prompt: bool, seed: int = 0):
    """A float64 tiny policy, its scorer and a trajectory of 3 groups of 4 rows (prompts of 3 lengths,
    completions of 1-12 tokens) with old and reference log-probs away from the policy's, so that ratios
    clip and the KL counts."""
    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = load_tiny(model_dir, torch.float64)
    float64_norms(model)
    G = 4
    rollout = make_rollout(tok, G, T=12, seed=seed)
    scorer = LogProbScorer(G, share_prompt=share_prompt)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        logprobs = scorer(model, rollout, slice(None))[0]  # [B, T]
    shifted = [logprobs + 0.3 * torch.randn(logprobs.shape, generator=g) for _ in range(2)]
    rewards = torch.randn(rollout.completion_ids.size(0), generator=g)  # [B]
    scored = ScoredGroups(
        PROMPTS, rollout, ["x"] * len(rewards), rewards[:, None], rewards, num_generations=G
    )
    cfg = GRPOConfig(num_generations=G, max_completion_length=12, beta=0.04)
    trajectory = build_trajectory(scored, cfg, old_logprobs=shifted[0], ref_logprobs=shifted[1])
    return model, scorer, trajectory


@pytest.mark.parametrize("share_prompt", [True, False], ids=["shared", "unshared"])
def test_budget_micro_batches_give_the_fixed_paths_loss_and_gradients_in_float64(
    tiny_model_dir, share_prompt
):
    """Every loss type but bnpo, the normalisations that count tokens or sequences across micro-batches
    included: the token-budget micro-batches (trimmed to their own longest row, groups kept together when
    shared) give the loss and the gradients of fixed micro-batches of 5 rows (which cut groups), to 1e-6."""
    model, scorer, trajectory = float64_trajectory(tiny_model_dir, share_prompt)
    rollout = trajectory.rollout
    group = 4 if share_prompt else 1
    budget = 60  # a few micro-batches of this rollout's 12 rows (prompt + completion: 4-23 tokens)
    fixed_parts = micro_batches(rollout, 5)
    budget_parts = micro_batches(rollout, None, budget, group)
    assert len(budget_parts) > 1
    widths = [rollout.select(rows, trim=True).completion_ids.size(1) for rows in budget_parts]
    assert min(widths) < rollout.completion_ids.size(1)  # some micro-batch is really trimmed
    denominators = mini_batch_denominators(trajectory, OneProcess())
    for loss_type in LOSS_TYPES:
        cfg = GRPOConfig(num_generations=4, max_completion_length=12, beta=0.04, loss_type=loss_type)
        results = []
        for parts in (fixed_parts, budget_parts):
            sums = MicroBatchSums()
            for loss in micro_batch_losses(scorer, model, trajectory, parts, cfg, *denominators, sums):
                loss.backward()
            results.append((sums.values, grads(model)))
        (fixed, fixed_grads), (by_budget, budget_grads) = results
        assert abs(float(fixed["loss"])) > 1e-4, loss_type
        for key, value in fixed.items():  # float32 sums (the log-probs are float32): their rounding only
            torch.testing.assert_close(by_budget[key], value, rtol=1e-6, atol=1e-7, msg=f"{loss_type} {key}")
        assert fixed_grads.keys() == budget_grads.keys()
        for name, grad in fixed_grads.items():
            torch.testing.assert_close(
                budget_grads[name], grad, rtol=1e-6, atol=1e-9, msg=f"{loss_type} {name}"
            )


def test_bnpo_micro_batches_are_each_a_step_of_their_own_over_their_number(tiny_model_dir):
    """bnpo, TRL's gradient accumulation: the token-budget micro-batches (of different token counts) give
    the mean of the losses and gradients each gives alone as a whole step (dapo over its own tokens), not
    the step's token mean (dapo over all of them)."""
    model, scorer, trajectory = float64_trajectory(tiny_model_dir, share_prompt=True)
    parts = micro_batches(trajectory.rollout, None, 60, 4)
    tokens = [float(trajectory.loss_mask[rows].sum()) for rows in parts]
    assert len(set(tokens)) > 1, tokens
    results = {}
    for loss_type in ("bnpo", "dapo"):
        cfg = GRPOConfig(num_generations=4, max_completion_length=12, beta=0.04, loss_type=loss_type)
        denominators = mini_batch_denominators(trajectory, OneProcess())
        sums = MicroBatchSums()
        for loss in micro_batch_losses(scorer, model, trajectory, parts, cfg, *denominators, sums):
            loss.backward()
        results[loss_type] = sums.loss, grads(model)
    cfg = GRPOConfig(num_generations=4, max_completion_length=12, beta=0.04, loss_type="dapo")
    alone_loss = 0.0
    for rows in parts:
        part = trajectory.select(rows, trim=True)
        sums = MicroBatchSums()
        denominators = mini_batch_denominators(part, OneProcess())
        for loss in micro_batch_losses(scorer, model, part, [slice(None)], cfg, *denominators, sums):
            (loss / len(parts)).backward()
        alone_loss = alone_loss + sums.loss / len(parts)
    alone_grads = grads(model)
    (bnpo, bnpo_grads), (dapo, dapo_grads) = results["bnpo"], results["dapo"]
    torch.testing.assert_close(bnpo, alone_loss, rtol=1e-6, atol=1e-7)
    for name, grad in alone_grads.items():
        torch.testing.assert_close(bnpo_grads[name], grad, rtol=1e-6, atol=1e-9, msg=name)
    assert abs(float(bnpo - dapo)) > 1e-3
    assert max(float((bnpo_grads[name] - dapo_grads[name]).abs().max()) for name in dapo_grads) > 1e-4


@pytest.mark.parametrize("share_prompt", [True, False], ids=["shared", "unshared"])
def test_budget_micro_batches_give_the_frozen_passes_log_probs(tiny_model_dir, share_prompt):
    """The reference and old-policy passes: the log-probs of every completion token are the whole
    rollout's, whichever micro-batches score them."""
    model, scorer, trajectory = float64_trajectory(tiny_model_dir, share_prompt)
    rollout, mask = trajectory.rollout, trajectory.completion_mask.bool()
    whole = logprobs_in_micro_batches(scorer, model, rollout, micro_batches(rollout, None))
    parts = micro_batches(rollout, None, 60, 4 if share_prompt else 1)
    by_budget = logprobs_in_micro_batches(scorer, model, rollout, parts)
    torch.testing.assert_close(by_budget[mask], whole[mask], rtol=1e-6, atol=1e-9)
    assert (by_budget[~mask] == 0).any()  # the columns trimmed away were never scored


def test_the_module_takes_the_budget(tiny_model_dir, tmp_path):
    """A training step with the budget changes the weights, with the loss and gradient norm of fixed
    micro-batches."""
    initial, losses = AutoModelForCausalLM.from_pretrained(tiny_model_dir), {}
    for name, options in {
        "fixed": {"micro_batch_size": 3},
        "budget": {"max_tokens_per_micro_batch": 64},
    }.items():
        L.seed_everything(0)
        module = tiny_module(
            tiny_model_dir, reward_funcs=[length_reward], num_generations=4, advantage_clip=0.5, **options
        )
        data = GSM8KDataModule(
            source="arithmetic", system_prompt=None, arithmetic_size=30, batch_size=2, val_size=2
        )
        trainer = quiet_trainer(max_steps=1, limit_val_batches=0, default_root_dir=str(tmp_path / name))
        trainer.fit(module, data)
        assert not torch.equal(module.policy.lm_head.weight, initial.lm_head.weight)
        metrics = trainer.callback_metrics
        losses[name] = float(metrics["train/policy_loss"]), float(metrics["train/grad_norm"])
    assert abs(losses["fixed"][0]) > 1e-3  # clipped advantages: the on-policy loss is not 0
    assert losses["budget"] == pytest.approx(losses["fixed"], rel=1e-4)


@settings(max_examples=200, deadline=None)
@given(
    group_size=st.integers(1, 3),
    groups=st.integers(1, 8),
    budget=st.integers(1, 300),
    extra=st.integers(0, 8),
    data=st.data(),
)
def test_at_least_splits_to_the_count_another_rank_runs(group_size, groups, budget, extra, data):
    """`at_least` (the busiest rank's count under DDP/FSDP): exactly that many micro-batches when the
    budget's own are fewer, every row once, groups intact, none over the budget that was not already."""
    lengths = data.draw(
        st.lists(st.integers(1, 60), min_size=groups * group_size, max_size=groups * group_size)
    )
    own = token_budget_micro_batches(lengths, budget, group_size)
    count = len(own) + extra
    if count > groups:  # more micro-batches than units: refused, naming the option
        with pytest.raises(ValueError, match="lower max_tokens_per_micro_batch"):
            token_budget_micro_batches(lengths, budget, group_size, at_least=count)
        return
    split = token_budget_micro_batches(lengths, budget, group_size, at_least=count)
    assert len(split) == count
    assert sorted(r for mb in split for r in mb) == list(range(len(lengths)))
    for mb in split:
        assert all(r % group_size == 0 for r in mb[::group_size]) and len(mb) % group_size == 0
    assert len(over_budget(lengths, split, budget)) <= len(over_budget(lengths, own, budget))
