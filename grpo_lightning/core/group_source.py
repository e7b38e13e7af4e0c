"""Where a training step's scored groups come from: `GroupSource`, what the module's training step asks
(`next(batch, state)`: the groups of an update, or None when this batch makes none), and
`SynchronousGroupSource`, which owns every stage before the update:

1. sampling: G completions per prompt of the batch by the policy's rollouts (`Sampler`), as the policy is now;
2. the rollout checks (`Sampler.check`: a rollout that cannot teach anything is warned about);
3. the reward functions' inputs (`reward_inputs`: a multi-turn rollout adds its own, `Turns`);
4. scoring (`rewards.scoring.score_completions`, TRL's call) and weighting (`weighted_groups`);
5. dynamic sampling's buffer (`algorithm.dynamic_sampling.GroupBuffer`), which may hold the groups back until
   an update has enough (None meanwhile).

Each `ScoredGroups` is stamped with the policy version that sampled it (the optimizer steps taken before,
`state.global_step`), which the update compares with the policy's own (`update.needs_old_logprobs`). A
source's `state_dict` is what an exact resume needs of it (the waiting groups), saved with every
checkpoint; `report` is what its last `next` measured, for the step's metrics.

No Lightning here: the rollouts and the reward functions come in as objects, the trainer's state with each
batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor
from transformers import TrainerState

from grpo_lightning.core.algorithm.dynamic_sampling import DynamicSamplingOptions, GroupBuffer
from grpo_lightning.core.async_group_source import AsyncGroupSource, AsyncRolloutOptions
from grpo_lightning.core.generation.sampling import SamplingOptions
from grpo_lightning.core.ranks import OneProcess, Ranks
from grpo_lightning.core.rewards.scoring import RewardInputs, score_completions, weighted_groups
from grpo_lightning.core.types import Rollout, ScoredGroups

__all__ = [
    "GroupSource",
    "Sampler",
    "SourceReport",
    "SynchronousGroupSource",
    "Turns",
    "group_source",
    "reward_inputs",
]


class Turns(Protocol):
    """What a multi-turn rollout adds to the reward functions' inputs
    (`training.tool_rollouts.SampledTurns`)."""

    def reward_inputs(
        self, batch: dict[str, list], rollout: Rollout, completions: list[str], state: TrainerState
    ) -> RewardInputs: ...


def reward_inputs(
    batch: dict[str, list],
    rollout: Rollout,
    completions: list[str],
    state: TrainerState,
    turns: Turns | None,
) -> RewardInputs:
    """What the reward functions score of a sampled batch (`Sampler.sample_batch`): `RewardInputs.of_rollout`,
    and what a multi-turn rollout adds (`Turns.reward_inputs`). Validation's reward calls take the same."""
    if turns is None:
        return RewardInputs.of_rollout(batch, rollout, completions, state)
    return turns.reward_inputs(batch, rollout, completions, state)


class Sampler(Protocol):
    """What a source samples with: the policy's rollouts (`training.rollouts.PolicyRollouts`)."""

    def sample_batch(
        self, batch: dict[str, list], num_generations: int
    ) -> tuple[Rollout, list[str], Turns | None]: ...

    def check(self, rollout: Rollout, completions: list[str]) -> None: ...


class SourceSections(Protocol):
    """The sections of the run's options that a source reads (`GRPOConfig` has them all)."""

    sampling: SamplingOptions
    dynamic_sampling: DynamicSamplingOptions | None
    async_rollouts: AsyncRolloutOptions
    optimizer_steps_per_batch: int  # an update's optimizer steps


@dataclass
class SourceReport:
    """What a source's latest `next` measured, for the training step's metrics."""

    generate_seconds: float = 0.0  # sampling this batch
    reward_metrics: dict[str, float] = field(default_factory=dict)  # this batch's `log_metric` means
    # the reward functions' `log_extra` columns of the groups returned; {} for groups of several rounds
    columns: dict[str, list] = field(default_factory=dict)
    stats: dict[str, Tensor] = field(default_factory=dict)  # dynamic sampling's, of the groups returned


class GroupSource(Protocol):
    """Where a training step's scored groups come from (`GRPOModule.group_source`)."""

    ranks: Ranks  # the other processes, set when training starts: updates are made together
    report: SourceReport

    def next(self, batch: dict[str, list], state: TrainerState) -> ScoredGroups | None:
        """The groups the update of this training step learns from, stamped with the policy version that
        sampled them; None: no update on this batch (dynamic sampling waits for more groups)."""
        ...

    def state_dict(self) -> dict:
        """What an exact resume needs (tensors and plain values only), saved with each checkpoint."""
        ...

    def load_state_dict(self, state: dict) -> None: ...


class SynchronousGroupSource:
    """Each batch sampled by the current policy and scored before the update that learns from it; with dynamic
    sampling (`cfg.dynamic_sampling`), its informative groups held until an update has enough (DAPO sec. 3.2).

    Args:
        cfg: the options it reads (group size, dynamic sampling).
        sampler: the policy's rollouts.
        reward_funcs: the reward functions, called as TRL calls them (`rewards.scoring`).
        reward_weights: one weight per reward function.
        reward_names: their names (dynamic sampling's metric is one of them).
        pad_token_id: what pads the rollouts of several rounds stacked into one update.
    """

    def __init__(
        self,
        cfg: SourceSections,
        sampler: Sampler,
        reward_funcs: list[Callable],
        reward_weights: list[float],
        reward_names: list[str],
        pad_token_id: int,
    ) -> None:
        self.sampler, self.reward_funcs, self.pad_token_id = sampler, reward_funcs, pad_token_id
        self.num_generations = cfg.sampling.num_generations
        self.reward_weights = torch.tensor(reward_weights, dtype=torch.float32)  # [F]
        self.dynamic = cfg.dynamic_sampling is not None
        dynamic = cfg.dynamic_sampling or DynamicSamplingOptions()  # off: its buffer is never filled
        metric = dynamic.metric if self.dynamic else None
        self.buffer = GroupBuffer.filtering_on(metric, reward_names, dynamic.max_rounds)
        self.ranks: Ranks = OneProcess()
        self.report = SourceReport()

    def next(self, batch: dict[str, list], state: TrainerState) -> ScoredGroups | None:
        start = time.perf_counter()
        sampled = self.sampler.sample_batch(batch, self.num_generations)
        generate_seconds = time.perf_counter() - start
        self.sampler.check(*sampled[:2])
        scored = self.scored_groups(batch, sampled, state, generate_seconds)
        scored.policy_version = state.global_step
        return self.buffered(scored)

    def scored_groups(
        self,
        batch: dict[str, list],
        sampled: tuple[Rollout, list[str], Turns | None],
        state: TrainerState,
        generate_seconds: float,
    ) -> ScoredGroups:
        """`batch`'s sampled groups scored and weighted; the report holds what it measured."""
        rollout, completions, turns = sampled
        inputs = reward_inputs(batch, rollout, completions, state, turns)
        scores = score_completions(self.reward_funcs, inputs)
        device = rollout.completion_ids.device
        rewards_per_func = scores.rewards.to(device)  # [B, F]
        weights = self.reward_weights.to(device)  # [F]
        scored = weighted_groups(
            batch["prompt"], rollout, completions, rewards_per_func, weights, self.num_generations
        )
        self.report = SourceReport(generate_seconds, scores.metrics, scores.extra)
        return scored

    def buffered(self, scored: ScoredGroups) -> ScoredGroups | None:
        """`scored` itself, or with dynamic sampling the groups of an update once its buffer has enough."""
        if not self.dynamic:
            return scored
        filled = self.buffer.fill(scored, self.ranks, self.pad_token_id)
        if filled is None:
            return None
        scored, self.report.stats = filled
        self.report.columns = {}  # the columns belong to this round, not to the update's groups
        return scored

    def state_dict(self) -> dict:
        return {"group_buffer": self.buffer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.buffer.load_state_dict(state["group_buffer"])


def group_source(
    cfg: SourceSections,
    sampler: Sampler,
    reward_funcs: list[Callable],
    reward_weights: list[float],
    reward_names: list[str],
    pad_token_id: int,
) -> GroupSource:
    """The source that `cfg` asks for, the one place that chooses: sampling ahead with
    `async_rollouts.max_staleness` > 0 (`AsyncGroupSource`, over the synchronous source's scoring), else
    synchronously."""
    source = SynchronousGroupSource(cfg, sampler, reward_funcs, reward_weights, reward_names, pad_token_id)
    options = cfg.async_rollouts
    if options.max_staleness == 0:
        return source
    G, steps = cfg.sampling.num_generations, cfg.optimizer_steps_per_batch
    return AsyncGroupSource(options, sampler, source, G, steps)
