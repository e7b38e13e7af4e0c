"""Dynamic sampling (DAPO, Yu et al., arXiv:2503.14476, sec. 3.2): a group whose G completions all get the
same reward has zero advantages, so it adds no policy gradient and only dilutes token-mean losses.
`GroupBuffer` keeps the informative groups (`informative_groups`) of successive generation rounds until an
update has enough; a round's groups with their rewards are `ScoredGroups` (`core/types.py`), whose `cat`
stacks rollouts of different widths so that groups of several rounds share one update.

Pure torch: nothing here knows about Lightning.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields
from typing import Annotated

import torch
from torch import Tensor

from grpo_lightning.core.options import Alias, NonNegativeInt, check_fields
from grpo_lightning.core.ranks import Ranks
from grpo_lightning.core.types import Rollout, ScoredGroups

__all__ = ["GroupBuffer", "informative_groups"]


def informative_groups(rewards: Tensor, group_size: int) -> Tensor:
    """`[N]` bool: the groups whose rewards are not all equal. The rule is `group_advantages`' own test
    for a constant group, so exactly the groups it would give zero advantages are the uninformative ones."""
    grouped = rewards.view(-1, group_size)  # [N, G]
    return grouped.amax(dim=1) != grouped.amin(dim=1)  # [N]


class GroupBuffer:
    """Dynamic sampling over successive training batches (DAPO, arXiv:2503.14476, sec. 3.2).

    `add` keeps a round's informative groups; `ready` says when an update can be made: the buffer holds as
    many informative groups as the first round had prompts, or `max_extra_rounds` rounds beyond the first
    have run. `pop` then returns the update's groups and empties the buffer. No update happens between
    rounds, so every buffered group is exactly on-policy. Informative groups beyond the target are dropped
    rather than kept for the next update, where they would be off-policy (as verl's DAPO recipe does).

    At the cap, instead of stopping as verl does, the update is topped up with the latest round's
    uninformative groups (zero advantage): it then has the usual size, and every rank the same size.

    `metric` is the column of `rewards_per_func` that decides which groups are informative (DAPO: the
    accuracy); None uses the weighted total `rewards`.
    """

    OPTIONS = ("max_extra_rounds", "metric")  # set by the config: not part of a checkpoint's state

    def __init__(self, max_extra_rounds: int, metric: int | None = None) -> None:
        self.max_extra_rounds = max_extra_rounds
        self.metric = metric
        self._reset()

    @classmethod
    def filtering_on(cls, metric: str | None, reward_names: list[str], max_extra_rounds: int) -> GroupBuffer:
        """The buffer that filters on the reward function `metric` names (a column of `rewards_per_func`),
        or on the weighted total when None."""
        if metric is None:
            return cls(max_extra_rounds)
        if metric not in reward_names:
            raise ValueError(
                f"GRPOConfig.dynamic_sampling.metric={metric!r} (dynamic_sampling_metric) is not one of the "
                f"reward functions {reward_names}: name the one that says whether a completion is right, or "
                "null for their weighted total"
            )
        return cls(max_extra_rounds, reward_names.index(metric))

    def _reset(self) -> None:
        self.kept: list[ScoredGroups] = []
        self.target = 0  # groups per update: the number of prompts of the first round
        self.rounds = 0
        self.generated = 0  # groups sampled over the rounds
        self.dropped = 0  # of which uninformative
        self._latest: ScoredGroups | None = None
        self._latest_uninformative = torch.zeros(0, dtype=torch.long)

    @property
    def num_kept(self) -> int:
        return sum(len(groups) for groups in self.kept)

    def add(self, groups: ScoredGroups) -> None:
        metric = groups.rewards if self.metric is None else groups.rewards_per_func[:, self.metric]  # [N*G]
        informative = informative_groups(metric.nan_to_num(0.0), groups.num_generations)  # [N]
        if self.rounds == 0:
            self.target = len(groups)
        self.rounds += 1
        self.generated += len(groups)
        self.dropped += int((~informative).sum())
        self.kept.append(groups.select(informative.nonzero()[:, 0]))
        self._latest, self._latest_uninformative = groups, (~informative).nonzero()[:, 0]

    def ready(self) -> bool:
        return self.num_kept >= self.target or self.rounds > self.max_extra_rounds

    def fill(
        self, groups: ScoredGroups, ranks: Ranks, pad_token_id: int
    ) -> tuple[ScoredGroups, dict[str, Tensor]] | None:
        """Keep this round's informative groups; once every rank has enough, the update's groups and their
        `dynamic_sampling/...` statistics, else None (every rank must update together: DDP and FSDP
        synchronise inside the update)."""
        self.add(groups)
        waiting = torch.tensor(float(not self.ready()), device=groups.rewards.device)
        if ranks.sum(waiting) > 0:
            return None
        groups, stats = self.pop(pad_token_id)
        return groups, {f"dynamic_sampling/{key}": torch.tensor(value) for key, value in stats.items()}

    def pop(self, pad_token_id: int) -> tuple[ScoredGroups, dict[str, float]]:
        """The update's groups and `{"frac_dropped", "extra_rounds"}` of the rounds that filled it."""
        if self._latest is None:
            raise RuntimeError("GroupBuffer.pop before any add")
        missing = max(0, self.target - self.num_kept)
        if missing:
            warnings.warn(
                f"dynamic sampling: {self.rounds} generation rounds found {self.num_kept} of {self.target} "
                f"groups with unequal rewards; the update is topped up with groups that carry no signal. The "
                "task is too hard or too easy for the model, or raise dynamic_sampling_max_rounds",
                stacklevel=2,
            )
        fill = self._latest.select(self._latest_uninformative[:missing])
        groups = ScoredGroups.cat([*self.kept, fill], pad_token_id)
        groups = groups.select(torch.arange(min(len(groups), self.target)))  # the oldest first
        stats = {"frac_dropped": self.dropped / self.generated, "extra_rounds": float(self.rounds - 1)}
        self._reset()
        return groups, stats

    def state_dict(self) -> dict:
        """The waiting groups and the rounds' counts (not the options), as plain dicts of tensors, which
        `torch.load(weights_only=True)` reads without importing grpo-lightning."""
        return {k: _plain(v) for k, v in vars(self).items() if k not in self.OPTIONS}

    def load_state_dict(self, state: dict) -> None:
        """Take back a `state_dict`'s groups and counts; groups stored as the dataclasses themselves (older
        checkpoints) load as they are."""
        vars(self).update({k: _scored_groups(v) for k, v in state.items()})


def _plain(value: object) -> object:
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, ScoredGroups):
        plain = {f.name: getattr(value, f.name) for f in fields(ScoredGroups)}
        return {**plain, "rollout": dict(vars(value.rollout))}
    return value


def _scored_groups(value: object) -> object:
    if isinstance(value, list):
        return [_scored_groups(v) for v in value]
    if isinstance(value, dict) and "rollout" in value:
        return ScoredGroups(**{**value, "rollout": Rollout(**value["rollout"])})
    return value


@dataclass(frozen=True)
class DynamicSamplingOptions:
    """Dynamic sampling (`GRPOConfig.dynamic_sampling`, None: off): drop the groups whose completions all got
    the same reward (they carry no gradient) and sample the next batches' prompts until an update has one
    informative group per prompt of a batch (DAPO, arXiv:2503.14476, sec. 3.2). Rounds without an update
    make no optimizer step, so `max_steps` still counts updates. Logs `train/dynamic_sampling/frac_dropped`
    and `train/dynamic_sampling/extra_rounds`. TRL: none; verl: `algorithm.filter_groups`."""

    max_rounds: Annotated[NonNegativeInt, Alias("dynamic_sampling_max_rounds")] = 9
    """Extra generation rounds an update may wait for; after them it is topped up with uninformative groups
    (verl's DAPO recipe stops with an error after 10 rounds, `max_num_gen_batches=10`).
    """
    metric: Annotated[str | None, Alias("dynamic_sampling_metric")] = "accuracy_reward"
    """The reward function (by name, as logged under `train/rewards/<name>`) whose values decide whether a
    group carries signal, as the DAPO paper filters on accuracy (verl:
    `algorithm.filter_groups.metric=acc`); None filters on the weighted total of the reward functions,
    before any KL in the reward. With a shaped total such as accuracy + format, an all-wrong group that
    differs only in format passes a total-reward filter, and updates made of such groups can teach the
    format while accuracy falls (BENCHMARKS.md measured it).
    """

    def __post_init__(self) -> None:
        check_fields(self)
