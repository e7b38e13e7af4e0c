"""Asynchronous rollouts: the servers sample the next batches while the trainer learns from an older one
(`AsyncGroupSource`, picked by `group_source.group_source` when `async_rollouts.max_staleness` > 0).

With `max_staleness` = k and one optimizer step per batch, the source keeps k batches in flight. Each training
step hands it the data loader's next batch: the source submits it at once, under the weights the step starts
from (the engine pushes them first), and returns the groups of the oldest batch in flight, which the servers
sampled k optimizer steps ago; the trainer learns from them while the servers sample. Each batch is sampled
entirely under one weight version, so each group's staleness (the policy's version now minus the version
stamped on the groups) is exact. The first k steps of a run fill the pipeline and make no update (as dynamic
sampling's waiting steps); the last k batches of a run stay in flight and are saved with the final checkpoint,
so no prompt is trained twice or lost, and a resumed run goes on with them.

A batch older than k when its turn comes (a step that made more optimizer steps than planned) never reaches
the loss (`stale_groups`): "drop" samples its prompts again under the current weights, at the end of the
queue, as verl's fully asynchronous trainer drops stale samples; "wait" samples them again now and waits for
them.

The loss corrects for the staleness (`off_policy_correction`, Espeholt et al.'s and AReaL's setting:
arXiv:1802.01561, arXiv:2505.24298): `update.py` recomputes `old_logprobs` under the weights the step starts
from (the proximal policy, the PPO clip's anchor, since the groups' version is not the policy's), and each
token's policy term is weighted by the ratio of those to the sampler's own log-probs (`sampler_correction`).

No Lightning here: the sampler, the scoring and the trainer's state come in as objects.
"""

from __future__ import annotations

import time
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Protocol

import torch
from transformers import TrainerState

from grpo_lightning.core.algorithm.dynamic_sampling import _plain, _scored_groups
from grpo_lightning.core.options import Alias, NonNegativeInt, check_fields
from grpo_lightning.core.ranks import Ranks
from grpo_lightning.core.types import Rollout, ScoredGroups

__all__ = ["AsyncGroupSource", "AsyncRolloutOptions", "OFF_POLICY_CORRECTIONS"]

StaleGroups = Literal["drop", "wait"]
# How the loss weighs a stale batch's tokens (`update.sampler_correction` applies them):
OFF_POLICY_CORRECTIONS = ("importance_sampling", "decoupled", "none")
OffPolicyCorrection = Literal[OFF_POLICY_CORRECTIONS]


@dataclass(frozen=True)
class AsyncRolloutOptions:
    """Asynchronous rollouts (`GRPOConfig.async_rollouts`): the servers of the `vllm_server` engine sample
    up to `max_staleness` batches ahead of the trainer (`core.async_group_source`)."""

    max_staleness: Annotated[NonNegativeInt, Alias("max_staleness")] = 0
    """How many optimizer steps old a batch may be when the trainer learns from it: the batches the servers
    sample ahead, under the weights of the step that submitted them, while the trainer learns from the
    oldest (times `optimizer_steps_per_batch`; must be a multiple of it). 0: each batch sampled by the
    policy it trains, no overlap. Needs the `vllm_server` engine (the in-process engines share the trainer's
    device). TRL's asynchronous GRPO: `max_staleness`."""
    stale_groups: Annotated[StaleGroups, Alias("stale_groups")] = "drop"
    """A batch older than `max_staleness` when its turn comes (a step made more optimizer steps than
    planned): "drop" samples its prompts again under the current weights, queued behind the batches in
    flight; "wait" samples them again now and the step waits for them. It never reaches the loss either way
    (verl's fully asynchronous trainer: `staleness_threshold`)."""
    off_policy_correction: Annotated[OffPolicyCorrection, Alias("off_policy_correction")] = (
        "importance_sampling"
    )
    """The correction of a batch sampled by an older policy, whose anchor `old_logprobs` is recomputed under
    the weights the step starts from (the proximal policy): "importance_sampling" weights each token's
    policy term by pi_old / pi_sampler bounded as the `sampler_correction` section says (its defaults,
    token_truncate at 2.0, when that section is off; Yao et al.'s TIS); "decoupled" is AReaL's decoupled
    PPO objective (arXiv:2505.24298 eq. 5): the clip around the proximal policy, each token weighted by the
    unbounded pi_prox / pi_behaviour; "none": no weight, the gradient biased towards the sampler's
    distribution (warned: plain PPO at staleness 1 collapsed where TIS learned, marin-community/marin#8955).
    Read only with `max_staleness` > 0."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.max_staleness > 0 and self.off_policy_correction == "none":
            warnings.warn(
                f"async_rollouts.off_policy_correction: none with max_staleness={self.max_staleness}: stale "
                "batches are learned from as if on-policy (biased; uncorrected staleness has collapsed runs)",
                stacklevel=3,
            )


class PendingSample(Protocol):
    """A batch's rollout in flight (`training.rollouts.PolicyRollouts.submit_batch`)."""

    def wait(self) -> None:
        """Until every completion has arrived."""
        ...

    def result(self) -> tuple[Rollout, list[str], Any]:
        """Wait for it: the rollout, its decoded completions, what a multi-turn rollout adds (None)."""
        ...

    @property
    def sampled_seconds(self) -> float:
        """From submission to the last completion's arrival (valid after `result`)."""
        ...


class AsyncSampler(Protocol):
    """What the asynchronous source samples with: the policy's rollouts on the server engine."""

    def submit_batch(self, batch: dict[str, list], num_generations: int) -> PendingSample: ...

    def check(self, rollout: Rollout, completions: list[str]) -> None: ...


class GroupScoring(Protocol):
    """The synchronous source's stages after sampling (`group_source.SynchronousGroupSource`): scoring and
    weighting (`scored_groups`), dynamic sampling's buffer (`buffered`), and what they measured."""

    ranks: Ranks
    report: Any  # its `group_source.SourceReport`

    def scored_groups(
        self, batch: dict[str, list], sampled: tuple, state: TrainerState, generate_seconds: float
    ) -> ScoredGroups: ...

    def buffered(self, scored: ScoredGroups) -> ScoredGroups | None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass
class InFlight:
    """A batch submitted for sampling: its prompts, the policy version it is sampled under, and either its
    pending rollout or, once a checkpoint waited for it, its scored groups and reward metrics."""

    batch: dict[str, list]
    version: int
    state: TrainerState | None  # the reward functions' `trainer_state` at submission; None: a checkpoint's
    pending: PendingSample | None = None
    scored: ScoredGroups | None = None
    reward_metrics: dict[str, float] | None = None


class AsyncGroupSource:
    """Up to `max_staleness` batches sampled ahead by the server engine, each trained on once, in order (see
    the module docstring).

    Args:
        options: `max_staleness`, `stale_groups`.
        sampler: the policy's rollouts (`submit_batch` on the server engine).
        scoring: the synchronous source, whose scoring, weighting and dynamic sampling the groups go through.
        num_generations: G, completions per prompt.
        optimizer_steps_per_batch: optimizer steps per update (`num_iterations` x `steps_per_generation`):
            `max_staleness` / this many batches are kept ahead.
    """

    def __init__(
        self,
        options: AsyncRolloutOptions,
        sampler: AsyncSampler,
        scoring: GroupScoring,
        num_generations: int,
        optimizer_steps_per_batch: int = 1,
    ) -> None:
        self.max_staleness = options.max_staleness
        self.stale_groups = options.stale_groups
        self.ahead = options.max_staleness // optimizer_steps_per_batch  # batches in flight beyond this one
        self.sampler, self.scoring, self.num_generations = sampler, scoring, num_generations
        self.in_flight: deque[InFlight] = deque()
        self.resampled = 0  # stale batches sampled again, over the run
        self.last_call: float | None = None

    # The synchronous source's `ranks` and `report` are this source's.
    @property
    def ranks(self) -> Ranks:
        return self.scoring.ranks

    @ranks.setter
    def ranks(self, ranks: Ranks) -> None:
        self.scoring.ranks = ranks

    @property
    def report(self) -> Any:
        return self.scoring.report

    def submit(self, batch: dict[str, list], state: TrainerState) -> InFlight:
        """`batch` submitted under the policy as it is now (version `state.global_step`)."""
        pending = self.sampler.submit_batch(batch, self.num_generations)
        return InFlight(batch, state.global_step, state, pending)

    def next(self, batch: dict[str, list], state: TrainerState) -> ScoredGroups | None:
        now = time.perf_counter()
        since_last = None if self.last_call is None else now - self.last_call
        self.last_call = now
        # The weights are pushed between batches, never in the middle of one: the batches in flight first
        # arrive (most of them did while the last step trained).
        for entry in self.in_flight:
            if entry.pending is not None:
                entry.pending.wait()
        waited = time.perf_counter() - now
        self.in_flight.append(self.submit(batch, state))
        if len(self.in_flight) <= self.ahead:  # filling the pipeline: nothing old enough yet
            self.scoring.report = type(self.scoring.report)()
            return None
        entry = self.in_flight.popleft()
        while state.global_step - entry.version > self.max_staleness:
            self.resampled += 1
            if self.stale_groups == "wait":
                entry = self.submit(entry.batch, state)
                break
            self.in_flight.append(self.submit(entry.batch, state))
            entry = self.in_flight.popleft()
        waited_now, scored, sampled_seconds = self._scored(entry)
        waited += waited_now
        staleness = float(state.global_step - scored.policy_version)
        samples = float(len(scored.completions))
        groups = self.scoring.buffered(scored)
        hidden = 0.0 if sampled_seconds <= 0 else min(1.0, max(0.0, 1.0 - waited / sampled_seconds))
        metrics = {
            "async/staleness_mean": staleness,
            "async/staleness_max": staleness,
            "async/in_flight": float(len(self.in_flight)),
            "async/resampled": float(self.resampled),
            "async/generation_hidden_frac": hidden,
        }
        if since_last is not None and since_last > 0:
            metrics["async/samples_per_second"] = samples / since_last
        report = self.scoring.report
        report.generate_seconds = waited
        report.stats = {**report.stats, **{k: torch.tensor(v) for k, v in metrics.items()}}
        return groups

    def _scored(self, entry: InFlight) -> tuple[float, ScoredGroups, float]:
        """`entry`'s scored groups (waiting for its rollout), the seconds waited, its sampling's seconds."""
        if entry.scored is not None:  # a checkpoint's: scored when it was saved
            self.scoring.report = type(self.scoring.report)(reward_metrics=dict(entry.reward_metrics or {}))
            return 0.0, entry.scored, 0.0
        start = time.perf_counter()
        sampled = entry.pending.result()
        waited = time.perf_counter() - start
        self.sampler.check(*sampled[:2])
        scored = self.scoring.scored_groups(entry.batch, sampled, entry.state, waited)
        scored.policy_version = entry.version
        return waited, scored, entry.pending.sampled_seconds

    def state_dict(self) -> dict:
        """The batches in flight, waited for and scored, with the policy version each was sampled under, and
        the synchronous source's state (dynamic sampling's buffer)."""
        saved = []
        for entry in self.in_flight:
            if entry.scored is None:
                _, entry.scored, _ = self._scored(entry)
                entry.reward_metrics, entry.pending = dict(self.scoring.report.reward_metrics), None
            saved.append(
                {
                    "batch": entry.batch,
                    "version": entry.version,
                    "scored": _plain(entry.scored),
                    "reward_metrics": entry.reward_metrics,
                }
            )
        return {**self.scoring.state_dict(), "in_flight": saved, "resampled": self.resampled}

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        saved = state.pop("in_flight", [])
        self.resampled = state.pop("resampled", 0)
        self.scoring.load_state_dict(state)
        self.in_flight = deque(
            InFlight(
                s["batch"],
                s["version"],
                None,
                scored=_scored_groups(s["scored"]),
                reward_metrics=s["reward_metrics"],
            )
            for s in saved
        )
