"""Several optimizer steps per rollout (`grpo.steps_per_generation`): the rollout's groups shuffled and cut
into mini-batches of whole groups, each an optimizer step against the log-probs of the policy that sampled
them (`training/manual_optimization.py`); the trainer's step count, the schedule's length and an
interrupted run's resume follow."""

import os
import signal
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from grpo_lightning.core.algorithm.batches import (
    group_rows,
    mini_batch_denominators,
    mini_batches,
    shuffled_mini_batches,
)
from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.types import Rollout, ScoredGroups
from grpo_lightning.core.update import build_trajectory
from grpo_lightning.training.callbacks.interrupt_checkpoint import INTERRUPT_FILENAME
from grpo_lightning.training.data import GSM8KDataModule
from grpo_lightning.training.manual_optimization import ManualOptimization
from tests.helpers import length_reward, quiet_trainer, tiny_module
from tests.test_resume import assert_same_continuation, fit

G = 3


def test_mini_batches_are_a_seeded_permutation_of_the_groups_cut_evenly():
    cut = shuffled_mini_batches(7, 3, torch.Generator().manual_seed(0))
    assert [len(groups) for groups in cut] == [3, 2, 2]
    assert sorted(torch.cat(cut).tolist()) == list(range(7))
    again = shuffled_mini_batches(7, 3, torch.Generator().manual_seed(0))
    assert all(torch.equal(a, b) for a, b in zip(cut, again, strict=True))
    orders = {tuple(torch.cat(shuffled_mini_batches(7, 3)).tolist()) for _ in range(20)}
    assert len(orders) > 1  # shuffled, not cut in row order
    assert group_rows(torch.tensor([2, 0]), G).tolist() == [6, 7, 8, 0, 1, 2]
    with pytest.raises(ValueError, match="steps_per_generation=4: this rollout has only 3 groups"):
        shuffled_mini_batches(3, 4)


def rollout_of(num_groups: int) -> Rollout:
    """Random groups of G rows, completions of 1-5 tokens."""
    B, T = num_groups * G, 5
    g = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(3, 50, (num_groups, 4), generator=g).repeat_interleave(G, 0)  # [B, 4]
    lengths = torch.randint(1, T + 1, (B,), generator=g)  # [B]
    completion_mask = (torch.arange(T)[None, :] < lengths[:, None]).long()  # [B, T]
    completion_ids = torch.randint(3, 50, (B, T), generator=g) * completion_mask
    return Rollout(prompt_ids, torch.ones_like(prompt_ids), completion_ids, completion_mask, lengths == T)


def test_mini_batches_hold_whole_groups_advantaged_over_the_rollout():
    num_groups = 5
    rollout = rollout_of(num_groups)
    rewards = torch.arange(num_groups * G, dtype=torch.float32) % 4  # [B]: groups differ in mean and std
    scored = ScoredGroups(
        list(range(num_groups)), rollout, ["c"] * len(rewards), rewards[:, None], rewards, G
    )
    trajectory = build_trajectory(scored, GRPOConfig(num_generations=G, scale_rewards="batch"))
    parts = mini_batches(trajectory, 2, torch.Generator().manual_seed(3))
    assert [len(part.prompts) for part in parts] == [3, 2]
    seen = []
    for part in parts:
        groups = part.prompts  # the prompts are the group indices here
        rows = group_rows(torch.tensor(groups), G)
        seen += groups
        assert torch.equal(part.completion_ids, rollout.completion_ids[rows])
        # Advantages as over the whole rollout ("batch": its std), not recomputed on the mini-batch.
        assert torch.equal(part.advantages, trajectory.advantages[rows])
        tokens, sequences = mini_batch_denominators(
            part, SimpleNamespace(world_size=2, sum=lambda total: total * 2)
        )
        assert float(tokens) == float(rollout.completion_mask[rows].sum())  # this mini-batch's tokens
        assert float(sequences) == len(rows)
    assert sorted(seen) == list(range(num_groups))
    assert mini_batches(trajectory, 1) == [trajectory]  # one step: nothing drawn, nothing copied


class StepRecorder:
    """Wraps `module.optimization.optimizer_step`: each optimizer step's rows and clipped share."""

    def __init__(self, module) -> None:
        self.steps: list[SimpleNamespace] = []
        optimization: ManualOptimization = module.optimization
        original = optimization.optimizer_step

        def record(module, optimizer, trajectory, *rest):
            stats, grad_norm = original(module, optimizer, trajectory, *rest)
            prompts = [str(p) for p in trajectory.prompts]
            clipped = float(stats["clip_ratio/region_mean"])
            self.steps.append(SimpleNamespace(prompts=prompts, clipped=clipped, old=trajectory.old_logprobs))
            return stats, grad_norm

        optimization.optimizer_step = record


def test_each_rollout_makes_its_optimizer_steps_on_its_groups_off_policy(tiny_model_dir, tmp_path):
    """2 rollouts of 2 prompts, 2 steps each: 4 optimizer steps, each on one prompt's group; the first of a
    rollout is on-policy (nothing clipped), the second compares the updated policy with the sampling one;
    a linear schedule bounded by the epoch decays over the 4 optimizer steps."""
    L.seed_everything(0)
    lr = 0.05
    module = tiny_module(
        tiny_model_dir,
        reward_funcs=[length_reward],
        num_generations=4,
        steps_per_generation=2,
        learning_rate=lr,
        epsilon=0.01,
        lr_scheduler_type="linear",
    )
    recorder = StepRecorder(module)
    data = GSM8KDataModule(
        source="arithmetic", system_prompt=None, arithmetic_size=20, batch_size=2, train_size=4, val_size=2
    )
    trainer = quiet_trainer(
        max_epochs=1,
        limit_val_batches=0,
        default_root_dir=str(tmp_path),
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=3, save_top_k=-1)],
    )
    with pytest.warns(
        UserWarning,
        match=r"every_n_train_steps=3\) counts optimizer steps, of which a\s+training step makes 2",
    ):
        trainer.fit(module, data)
    assert trainer.global_step == 4 == len(recorder.steps)
    assert not list(tmp_path.glob("**/*.ckpt"))  # after global steps 2 and 4: never a multiple of 3
    for first, second in (recorder.steps[:2], recorder.steps[2:]):
        assert len(first.prompts) == len(second.prompts) == 1 and first.prompts != second.prompts
        assert first.old is not None and second.old is not None  # taken at rollout time
        assert first.clipped == 0.0  # the policy that sampled: ratio 1
        assert second.clipped > 0.0  # one update later
    # The schedule's length is the fit's optimizer steps (epoch x 2 batches x 2): the last update's rate
    # is lr x (1 - 3/4), not the floor that a length of 2 would give.
    assert float(trainer.callback_metrics["train/learning_rate"]) == pytest.approx(lr / 4)


class SigtermBetweenMiniBatches(L.Callback):
    """Sends this process SIGTERM before the optimizer step `at` (0-based): the second mini-batch of a
    rollout when `at` is odd."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


def test_a_run_stopped_between_mini_batches_resumes_exactly(tiny_model_dir, tmp_path):
    """SIGTERM between the two mini-batches of the third rollout: the step finishes (its second optimizer
    step too) and the checkpoint is of the rollout's end; the resumed run then samples, scores and
    updates as the straight one did, to the same weights."""
    steps = 2  # optimizer steps per rollout
    rollouts, stop_in = 4, 3
    straight, straight_steps = fit(tiny_model_dir, rollouts * steps, None, seed=0, steps_per_generation=steps)
    with pytest.raises(SystemExit):  # Lightning's SIGTERMException, after the step
        fit(
            tiny_model_dir,
            rollouts * steps,
            None,
            seed=0,
            callbacks=(SigtermBetweenMiniBatches(at=(stop_in - 1) * steps + 1),),
            root=str(tmp_path),
            steps_per_generation=steps,
        )
    ckpt = str(tmp_path / "checkpoints" / INTERRUPT_FILENAME)
    assert torch.load(ckpt, weights_only=True)["global_step"] == stop_in * steps  # the rollout's end
    resumed, resumed_steps = fit(
        tiny_model_dir, rollouts * steps, None, seed=1234, ckpt_path=ckpt, steps_per_generation=steps
    )
    assert len(resumed_steps.steps) == rollouts - stop_in
    assert_same_continuation(straight, straight_steps.steps[stop_in:], resumed, resumed_steps.steps)
