"""The group source (`core/group_source.py`) and the policy version its groups carry: a group sampled at
optimizer step k carries k; the update computes the ratio's anchor exactly when some step of it runs on a
policy other than the one that sampled (the groups' version is not the policy's, or it makes several
steps), and the loss of groups one step old is the hand computation with that anchor; a source whose groups
are one step old plugs into the module unchanged; the source's state round-trips for an exact resume, and
a checkpoint's waiting groups written before they carried a version get the checkpoint's step."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from grpo_lightning.core.group_source import SynchronousGroupSource
from grpo_lightning.core.ranks import OneProcess
from grpo_lightning.core.rewards.verifiable import accuracy_reward
from grpo_lightning.core.types import ScoredGroups
from grpo_lightning.core.update import MicroBatchSums, RolloutUpdate
from grpo_lightning.training.training_state import load_grpo_state, save_grpo_state
from tests.helpers import arithmetic_data, length_reward, quiet_trainer, tiny_module

PROMPTS = ["1 + 1 =", "12 * 3 - 4 ="]


def record_next(module, seen: list) -> None:
    """Record, for each training batch, the policy's version (its optimizer steps) when the module asked
    its source for groups, and the version the groups returned carry (None: no update)."""
    source_next = module.group_source.next

    def next_groups(batch, state):
        groups = source_next(batch, state)
        seen.append((module.global_step, None if groups is None else groups.policy_version))
        return groups

    module.group_source.next = next_groups


def test_groups_carry_the_optimizer_steps_taken_before_they_were_sampled(tiny_model_dir, tmp_path):
    """Two optimizer steps per rollout and dynamic sampling waiting one extra round for each update (the
    random model answers nothing right): batch i is not step i, and the stamps are the optimizer steps."""
    module = tiny_module(
        tiny_model_dir,
        reward_funcs=[accuracy_reward, length_reward],
        steps_per_generation=2,
        dynamic_sampling=True,
        dynamic_sampling_max_rounds=1,
    )
    seen: list = []
    record_next(module, seen)
    trainer = quiet_trainer(max_steps=4, limit_val_batches=0, default_root_dir=str(tmp_path))
    with pytest.warns(UserWarning, match="topped up"):
        trainer.fit(module, arithmetic_data(20))
    assert trainer.global_step == 4
    assert seen == [(0, None), (0, 0), (2, None), (2, 2)]


def sampled(tiny_model_dir, version: int, **grpo):
    """A module on the tiny model, two groups of 2 it sampled (with the sampler's log-probs) stamped
    `version`, and the update of its options."""
    module = tiny_module(tiny_model_dir, reward_funcs=[length_reward], beta=0.0, **grpo)
    module.configure_model()
    torch.manual_seed(0)
    rollout, completions = module.rollouts.sample(PROMPTS, 2)
    assert rollout.sampler_logprobs is not None
    rewards = torch.tensor([0.0, 1.0, 2.0, 0.5])
    groups = ScoredGroups(PROMPTS, rollout, completions, rewards[:, None], rewards, 2, policy_version=version)
    update = RolloutUpdate(module.grpo, module.rollouts.scorer, OneProcess(), module.tokenizer)
    return module, groups, update


@pytest.mark.parametrize(
    ("groups_version", "policy_version", "num_iterations", "anchored"),
    [(3, 3, 1, False), (2, 3, 1, True), (3, 3, 2, True)],
    ids=["current", "one-step-old", "two-passes"],
)
def test_the_anchor_is_computed_exactly_when_a_step_runs_on_another_policy(
    tiny_model_dir, groups_version, policy_version, num_iterations, anchored
):
    module, groups, update = sampled(tiny_model_dir, groups_version, num_iterations=num_iterations)
    passes = []
    frozen = update.frozen_logprobs
    update.frozen_logprobs = lambda rollout, model: passes.append(model) or frozen(rollout, model)
    trajectory = update.trajectory(groups, module.policy, None, {}, policy_version)
    assert trajectory.policy_version == groups_version
    assert (trajectory.old_logprobs is not None) is anchored
    assert passes == ([module.policy] if anchored else [])
    if anchored:  # the policy as it is now, the one the update starts from
        expected = module.rollouts.scorer(module.policy, groups.rollout, slice(None))[0]
        torch.testing.assert_close(trajectory.old_logprobs, expected)


def test_the_loss_of_groups_one_step_old_is_the_hand_computation_with_their_anchor(tiny_model_dir):
    """Groups sampled at step 3, the policy moved once since (step 4): the anchor is the policy now, and the
    sampler correction weights each token by min(pi_old / pi_sampler, 2), which is no longer 1; dapo's loss
    is then sum(-w * min(rho A, clip(rho) A)) / tokens with rho = pi / pi_old."""
    module, groups, update = sampled(tiny_model_dir, 3, importance_sampling_correction=True)
    with torch.no_grad():  # one optimizer step's worth of change
        for weight in module.policy.parameters():
            weight.add_(0.05 * torch.randn_like(weight))
    trajectory = update.trajectory(groups, module.policy, None, {}, policy_version=4)
    [(mini_batch, denominators)] = list(update.mini_batches(trajectory))
    loss = sum(update.losses(module.policy, mini_batch, denominators, MicroBatchSums()))

    rollout, mask = groups.rollout, trajectory.loss_mask.bool()  # [B, T]
    logprobs = module.rollouts.scorer(module.policy, rollout, slice(None))[0].detach()  # [B, T]
    old, sampler = trajectory.old_logprobs, rollout.sampler_logprobs  # [B, T]
    weights = torch.exp(old - sampler).clamp(max=2.0)  # [B, T]
    assert (weights - 1)[mask].abs().max() > 0.05, "the sampler is one step behind the anchor"
    ratio = torch.exp(logprobs - old)  # [B, T]
    advantages = trajectory.advantages[:, None]  # [B, 1]
    surrogate = -torch.min(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages)  # [B, T]
    expected = (weights * surrogate)[mask].sum() / mask.sum()
    torch.testing.assert_close(loss.detach(), expected, atol=1e-6, rtol=1e-5)


class OneStepOld:
    """A source that gives each batch the previous batch's groups (the first batch makes no update): the
    groups of every update but the first were sampled one optimizer step ago."""

    def __init__(self, source: SynchronousGroupSource) -> None:
        self.source, self.waiting = source, None

    ranks = property(lambda self: self.source.ranks, lambda self, ranks: setattr(self.source, "ranks", ranks))
    report = property(lambda self: self.source.report)

    def next(self, batch, state):
        self.waiting, groups = self.source.next(batch, state), self.waiting
        return groups

    def state_dict(self) -> dict:
        return self.source.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.source.load_state_dict(state)


def test_a_source_of_older_groups_plugs_in_and_its_updates_are_anchored(tiny_model_dir, tmp_path):
    module = tiny_module(tiny_model_dir, reward_funcs=[length_reward], learning_rate=1e-2)
    module.group_source = OneStepOld(module.group_source)
    seen: list = []
    record_next(module, seen)
    anchors = []

    class Trajectories(L.Callback):
        def on_train_start(self, trainer, pl_module):
            build = pl_module.update.trajectory
            pl_module.update.trajectory = lambda *args: anchors.append(build(*args)) or anchors[-1]

    trainer = quiet_trainer(
        max_steps=2, limit_val_batches=0, callbacks=[Trajectories()], default_root_dir=str(tmp_path)
    )
    trainer.fit(module, arithmetic_data(20))
    assert seen == [(0, None), (0, 0), (1, 0)]
    assert [(t.policy_version, t.old_logprobs is not None) for t in anchors] == [(0, False), (0, True)]
    assert torch.isfinite(trainer.callback_metrics["train/loss"])


def buffered(tiny_model_dir, version: int) -> SynchronousGroupSource:
    """A module's source with dynamic sampling, one informative group of 2 waiting, sampled at `version`."""
    module = tiny_module(tiny_model_dir, dynamic_sampling=True, dynamic_sampling_metric=None)
    module.configure_model()
    rollout, completions = module.rollouts.sample(PROMPTS, 2)
    rewards = torch.tensor([0.0, 1.0, 1.0, 1.0])  # the first group informative, the second not
    groups = ScoredGroups(PROMPTS, rollout, completions, rewards[:, None], rewards, 2, policy_version=version)
    module.group_source.buffer.add(groups)
    return module.group_source


def test_the_sources_state_round_trips_through_a_weights_only_checkpoint(tiny_model_dir, tmp_path):
    source = buffered(tiny_model_dir, version=5)
    checkpoint = {"global_step": 7}
    save_grpo_state(checkpoint, 0, {}, source.state_dict())
    torch.save(checkpoint, tmp_path / "state.ckpt")
    own = load_grpo_state(torch.load(tmp_path / "state.ckpt", weights_only=True), 0, 1)
    fresh = tiny_module(tiny_model_dir, dynamic_sampling=True, dynamic_sampling_metric=None).group_source
    fresh.load_state_dict(own.group_source)
    before, after = source.buffer, fresh.buffer
    assert (after.rounds, after.target, after.generated, after.dropped) == (1, 2, 2, 1)
    [kept] = after.kept
    assert kept.policy_version == 5  # its own stamp, not the checkpoint's step
    assert kept.completions == before.kept[0].completions and kept.prompts == PROMPTS[:1]
    torch.testing.assert_close(kept.rollout.completion_ids, before.kept[0].rollout.completion_ids)
    torch.testing.assert_close(after._latest_uninformative, before._latest_uninformative)
    assert after._latest.policy_version == 5


def test_waiting_groups_of_a_checkpoint_without_versions_get_its_step(tiny_model_dir):
    source = buffered(tiny_model_dir, version=0)
    checkpoint = {"global_step": 7}
    save_grpo_state(checkpoint, 0, {}, source.state_dict())
    buffer = checkpoint["grpo_state"]["per_rank"][0]["group_buffer"]
    for groups in [*buffer["kept"], buffer["_latest"]]:
        del groups["policy_version"]  # as written before groups carried their version
    own = load_grpo_state(checkpoint, 0, 1)
    source.load_state_dict(own.group_source)
    assert [g.policy_version for g in source.buffer.kept] == [7] and source.buffer._latest.policy_version == 7
