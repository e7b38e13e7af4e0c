"""The GRPO update of one scored rollout, in the order it runs; no Lightning here.

1. The trajectory (`build_trajectory`): the loss mask, the KL charged to the reward (`use_kl_in_reward`), the
   group-relative advantages (DeepSeekMath arXiv:2402.03300 sec. 4.1.2) and step credit, after the frozen
   passes over the rollout's micro-batches: the reference's, and the ratio's anchor where a step of the update
   runs on a policy other than the one that sampled the groups (`needs_old_logprobs`: the groups carry the
   policy version that sampled them, the update is told the policy's now).
2. Mini-batches (`steps_per_generation`; TRL's `steps_per_generation`, verl's `ppo_mini_batch_size`): the
   rollout's groups shuffled and cut into that many mini-batches of whole groups, one optimizer step each,
   each normalising its loss over its own mini-batch (`mini_batch_denominators`), as TRL and verl do.
3. Micro-batches, one forward/backward each: slices of `micro_batch_size` rows (padded to the rollout's
   longest row, as sampled), or the token-budget partition (`token_budget`, `max_tokens_per_micro_batch`)
   as index tensors, each taken out and trimmed to its own longest row (`Rollout.select`).
4. The loss of each micro-batch (`loss.grpo_loss`) with the whole mini-batch's denominators, so that the
   micro-batch losses add up to the mini-batch's (`micro_batch_losses`, for the caller's backward; bnpo's,
   as TRL's, to the mean of the micro-batches' own token means on this rank), and
   the sampler/scorer gap of its tokens (importance weights where asked,
   `sampler_correction.logprob_gap_stats`); their statistics weighted by token share (`MicroBatchSums`).
5. The optimizer step, skipped when the loss or the gradient is not finite
   (`training.manual_optimization.StepGuard`, beside the module's backward).

`RolloutUpdate` holds what these need from outside: the log-prob scorer (`generation.scorer.LogProbScorer`)
and the other processes (`core.ranks.Ranks`: sums, maxima and gathers).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, fields
from typing import Protocol

import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo_lightning.core.algorithm.advantages import AdvantageOptions, group_advantages
from grpo_lightning.core.algorithm.batches import (
    MicroBatch,
    micro_batch_part,
    micro_batches,
    mini_batch_denominators,
    mini_batches,
)
from grpo_lightning.core.algorithm.credit import step_credit_penalties
from grpo_lightning.core.algorithm.kl import KLOptions, kl_in_reward
from grpo_lightning.core.algorithm.loss import PolicyLossOptions, grpo_loss
from grpo_lightning.core.algorithm.sampler_correction import (
    SamplerCorrectionOptions,
    decoupled_weights,
    importance_weights,
    logprob_gap_stats,
)
from grpo_lightning.core.async_group_source import AsyncRolloutOptions
from grpo_lightning.core.generation.sampling import SamplingOptions
from grpo_lightning.core.generation.scorer import LogProbScorer
from grpo_lightning.core.options import AtLeastOne, check_fields, option_error
from grpo_lightning.core.ranks import Ranks
from grpo_lightning.core.types import Rollout, ScoredGroups, Trajectory

# (model, rollout, rows, with_entropy) -> (logprobs, entropies) [b, T] each: `scorer.LogProbScorer`
Score = Callable[..., tuple[Tensor, Tensor]]


# ----------------------------------------------------------------------------------------- the options


@dataclass(frozen=True)
class UpdateOptions:
    """How one rollout becomes optimizer steps: passes, mini-batches, micro-batches (`GRPOConfig.update`)."""

    num_iterations: AtLeastOne = 1
    """Optimisation passes over each rollout, PPO's mu (arXiv:2402.03300 alg. 1), each over its
    `steps_per_generation` mini-batches. With mu > 1 the sampling-time log-probs are kept as the old
    policy's.
    """
    steps_per_generation: AtLeastOne = 1
    """Optimizer steps per rollout: the rollout's groups (one per prompt of the batch) are shuffled, from
    the training random stream that checkpoints keep, and cut into this many mini-batches of whole groups,
    one optimizer step each; with `num_iterations` = mu, mu passes over them (a new shuffle each), so a
    training step makes steps_per_generation x mu optimizer steps, each counted by the trainer's
    `global_step` and `max_steps`, the learning-rate schedule and `ref_model_sync_steps`. Advantages are
    computed over the whole rollout before the cut; the sampling policy's log-probs are taken at rollout
    time, so from the second step on the clipped ratio compares the updated policy with the one that
    sampled. Each step normalises its loss over its own mini-batch (dapo: the mini-batch's loss tokens
    on all ranks; bnpo: each micro-batch's own tokens, on this rank, averaged over the step's micro-batches;
    grpo: its sequences; dr_grpo: its sequences x max_completion_length), as TRL and verl do.
    A batch must hold at least this many prompts. Checkpoints fall between training steps, so never
    between two mini-batches of one rollout: set `every_n_train_steps` of a `ModelCheckpoint` to a multiple
    of steps_per_generation x num_iterations. TRL: `steps_per_generation` counts forward/backward passes of
    `per_device_train_batch_size` completions, `gradient_accumulation_steps` of them to an optimizer step,
    so this option is TRL's steps_per_generation / gradient_accumulation_steps, and TRL's
    `generation_batch_size` (completions on all processes) is data.batch_size x num_generations x processes
    here; verl: `ppo_mini_batch_size` (prompts) = data.batch_size / steps_per_generation. 1: one optimizer
    step per rollout.
    """
    micro_batch_size: AtLeastOne | None = None
    """Sequences per forward/backward; each optimizer step's rows (the rollout of prompts x G sequences, or
    its mini-batch with `steps_per_generation`) are split and the gradients accumulated, with the loss
    normalised over all of them (bnpo: over each micro-batch's own tokens, as TRL's gradient accumulation),
    and every micro-batch padded to the rollout's longest row. None: all at once.
    """
    max_tokens_per_micro_batch: AtLeastOne | None = None
    """A token budget per micro-batch instead of `micro_batch_size` rows, in the policy update (within each
    optimizer step's rows) and the reference and old-policy passes: rows of similar length go together,
    each micro-batch holding as many as fit in rows x its longest row's tokens (prompt + completion) <= this
    budget, and padded only to its own longest row; with `share_prompt` a prompt's G rows stay in one
    micro-batch. A row (or shared group) longer than the budget alone gets a micro-batch of its own. Under
    DDP or FSDP each rank runs as many micro-batches as the busiest one (each forward/backward
    synchronises them), splitting its widest. The loss and gradients are those of the fixed-size path
    (tests/test_token_budget.py), except bnpo's, which depend on how the rows are cut.
    Partition: `grpo_lightning.core.algorithm.token_budget`. Excludes `micro_batch_size`; must be >=
    `max_completion_length`. None: `micro_batch_size`. verl: `use_dynamic_bsz` with
    `ppo_max_token_len_per_gpu`; OpenRLHF: `dynamic_batch_enable`.
    """
    max_bad_steps: AtLeastOne = 3
    """Stop after this many consecutive steps whose loss is not finite (each is skipped)."""

    @property
    def optimizer_steps_per_batch(self) -> int:
        """The optimizer steps of one training step: num_iterations x steps_per_generation."""
        return self.num_iterations * self.steps_per_generation

    def __post_init__(self) -> None:
        check_fields(self)
        budget = self.max_tokens_per_micro_batch
        if budget is not None and self.micro_batch_size is not None:
            raise option_error(
                self, "max_tokens_per_micro_batch", budget, "set it or micro_batch_size, not both"
            )


class UpdateSections(Protocol):
    """The sections of the run's options that the update reads (`GRPOConfig` has them all)."""

    sampling: SamplingOptions
    advantages: AdvantageOptions
    loss: PolicyLossOptions
    kl: KLOptions
    sampler_correction: SamplerCorrectionOptions | None
    async_rollouts: AsyncRolloutOptions
    update: UpdateOptions


# ------------------------------------------------------------------------------------- 1. the trajectory
def loss_mask(rollout: Rollout, mask_truncated_completions: bool) -> Tensor:
    """`[B, T]` float: the completion tokens the model drew (tool turns left out), without the completions
    that never stopped when asked (DAPO sec. 3.4, overlong filtering)."""
    mask = rollout.model_mask.float()  # [B, T]
    if mask_truncated_completions:
        mask = mask * (~rollout.truncated).float()[:, None]
    return mask


def sampler_correction(
    cfg: UpdateSections, scorer: Tensor, sampler: Tensor, mask: Tensor
) -> tuple[Tensor, Tensor] | None:
    """The weights `[B, T]` of `cfg`'s sampler correction and where its bounds changed them
    (`sampler_correction.importance_weights` in its mode, bounded by its floor and cap), None when it is
    off. Sampling ahead (`async_rollouts.max_staleness` > 0), its `off_policy_correction`: the section's
    weights (its defaults where it is off), AReaL's unbounded decoupled weights, or none."""
    options = cfg.sampler_correction
    asynchronous = cfg.async_rollouts
    if asynchronous.max_staleness > 0:
        if asynchronous.off_policy_correction == "decoupled":
            return decoupled_weights(scorer, sampler, mask)
        if asynchronous.off_policy_correction == "importance_sampling":
            options = options or SamplerCorrectionOptions()
    if options is None:
        return None
    return importance_weights(scorer, sampler, mask, options.mode, options.cap, options.floor)


def advantages_of(outcome: Tensor, cfg: UpdateSections, ranks: Ranks | None = None) -> Tensor:
    """Group-relative advantages `[B]` of this rank's outcome. With `ranks` (scale_rewards="batch" over
    several ranks) the std is that of the whole batch over all ranks, as TRL computes it."""
    args = (cfg.sampling.num_generations, cfg.advantages)
    if ranks is None:
        return group_advantages(outcome, *args)  # [B]
    # As lists: B may differ between ranks (dynamic sampling's update at an epoch's short last batch).
    per_rank = ranks.gather(outcome.tolist())
    everyone = torch.tensor(sum(per_rank, []), dtype=outcome.dtype, device=outcome.device)  # [sum of B]
    start = sum(len(r) for r in per_rank[: ranks.rank])
    return group_advantages(everyone, *args)[start : start + outcome.numel()]  # [B]


def build_trajectory(
    scored: ScoredGroups,
    cfg: UpdateSections,
    *,
    old_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    ranks: Ranks | None = None,
    stats: dict[str, Tensor] | None = None,
) -> Trajectory:
    """The trajectory of `scored`'s groups: loss mask, KL in the reward (verl's `use_kl_in_reward`, needs
    `old_logprobs` and `ref_logprobs`), group advantages (over all `ranks` when given) and step credit
    (`credit.step_credit_penalties`, needs the `tokenizer`). `stats` are earlier metrics of the step
    (dynamic sampling's), extended with those of the options used here, and with `old_logprobs` and the
    sampler's, the gap between them over the whole rollout (`sampler_correction.logprob_gap_stats`; one
    update per rollout measures it in the loss instead, which then has the scorer's log-probs)."""
    rollout, rewards = scored.rollout, scored.rewards  # rewards: [B]
    stats = dict(stats or {})
    outcome = rewards  # [B]
    if cfg.kl.in_reward:
        outcome = kl_in_reward(
            rewards, old_logprobs, ref_logprobs, rollout.model_mask, cfg.kl.beta, cfg.kl.estimator
        )  # [B]
        stats["kl_reward_penalty"] = (rewards - outcome).mean()
    advantages = advantages_of(outcome, cfg, ranks)  # [B]
    token_advantages = advantages  # [B], or [B, T] with step credit
    if cfg.advantages.step_credit > 0:
        penalties = step_credit_penalties(
            tokenizer, rollout.completion_ids, rollout.completion_mask, cfg.advantages.step_credit
        )  # [B, T]
        token_advantages = advantages[:, None] + penalties  # [B, T]
        model_tokens = rollout.model_mask  # [B, T]
        stats["step_credit/frac_tokens"] = ((penalties < 0) * model_tokens).sum() / model_tokens.sum()
    mask = loss_mask(rollout, cfg.loss.mask_truncated_completions)  # [B, T]
    if old_logprobs is not None and rollout.sampler_logprobs is not None:
        correction = sampler_correction(cfg, old_logprobs, rollout.sampler_logprobs, mask)  # or None
        stats.update(logprob_gap_stats(old_logprobs, rollout.sampler_logprobs, mask, correction))
    return Trajectory(
        **{f.name: getattr(scored, f.name) for f in fields(ScoredGroups)},  # what the groups hold
        loss_mask=mask,
        old_logprobs=old_logprobs,
        ref_logprobs=ref_logprobs,
        advantages=advantages,
        token_advantages=token_advantages,
        stats=stats,
    )


@torch.no_grad()
def logprobs_in_micro_batches(score: Score, model, rollout: Rollout, parts: list[MicroBatch]) -> Tensor:
    """`rollout`'s per-token log-probs `[B, T]` under `model`, scored micro-batch by micro-batch (a frozen
    pass: reference, sampling policy); the columns a trimmed micro-batch drops (padding) hold 0."""
    ids = rollout.completion_ids
    logprobs = torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)  # [B, T], as scorers give
    for rows in parts:
        part, part_rows = micro_batch_part(rollout, rows)
        scored = score(model, part, part_rows)[0]  # [b, T']
        logprobs[rows, : scored.size(1)] = scored
    return logprobs


# ------------------------------------------------------------------------------------- 4. the loss
def micro_batch_loss(
    trajectory: Trajectory,
    rows: slice,
    logprobs: Tensor,
    entropies: Tensor,
    cfg: UpdateSections,
    total_tokens: Tensor,
    total_sequences: Tensor,
    num_micro_batches: int = 1,
) -> tuple[Tensor, dict[str, Tensor]]:
    """`grpo_loss` of `trajectory`'s `rows` given the policy's `logprobs` / `entropies` `[b, T]` there,
    normalised by `total_tokens` / `total_sequences` (`mini_batch_denominators`), or for bnpo by its own
    tokens and the `num_micro_batches` of the optimizer step it is one of. With the sampler's
    log-probs, the statistics hold the gap to the scorer's, pi_old: the rollout-time log-probs, or with one
    optimizer step per rollout the policy's own (the same weights), so the gap costs no extra pass; with
    `importance_sampling_correction` the loss weights each token by `sampler_correction`'s weights."""
    t = trajectory
    old_logprobs = None if t.old_logprobs is None else t.old_logprobs[rows]  # [b, T]
    weights, gap = None, {}
    if t.rollout.sampler_logprobs is not None:
        scorer = old_logprobs if old_logprobs is not None else logprobs.detach()  # [b, T] pi_old
        sampler = t.rollout.sampler_logprobs[rows]  # [b, T]
        correction = sampler_correction(cfg, scorer, sampler, t.loss_mask[rows])  # ([b, T], [b, T]) or None
        gap = logprob_gap_stats(scorer, sampler, t.loss_mask[rows], correction)
        weights = None if correction is None else correction[0]
    loss, stats = grpo_loss(
        logprobs,
        t.token_advantages[rows],
        t.loss_mask[rows],
        cfg.loss,
        cfg.kl,  # its loss_beta is 0 when the KL is in the rewards already
        old_logprobs=old_logprobs,
        ref_logprobs=None if t.ref_logprobs is None else t.ref_logprobs[rows],
        max_completion_length=cfg.sampling.max_completion_length,
        entropies=entropies,
        total_tokens=total_tokens,
        total_sequences=total_sequences,
        importance_weights=weights,
        num_micro_batches=num_micro_batches,
    )
    return loss, {**stats, **gap}


def micro_batch_losses(
    score: Score,
    policy: torch.nn.Module,
    trajectory: Trajectory,
    parts: list[MicroBatch],
    cfg: UpdateSections,
    total_tokens: Tensor,
    total_sequences: Tensor,
    sums: MicroBatchSums,
) -> Iterator[Tensor]:
    """The loss of each micro-batch of `trajectory` in turn, after its policy pass, for the caller's
    backward (the gradients then add up to those of the whole loss; for bnpo, of the mean of the
    micro-batches' token means, this rank's `parts` counted); the losses and statistics are added to
    `sums`."""
    tokens = trajectory.loss_mask.sum().clamp(min=1)
    for rows in parts:
        part, part_rows = micro_batch_part(trajectory, rows)
        logprobs, entropies = score(policy, part.rollout, part_rows, with_entropy=True)  # [b, T'] each
        loss, stats = micro_batch_loss(
            part, part_rows, logprobs, entropies, cfg, total_tokens, total_sequences, len(parts)
        )
        yield loss
        sums.add(loss, stats, token_share=part.loss_mask[part_rows].sum() / tokens)


class MicroBatchSums:
    """An update's loss and statistics over its micro-batches.

    The micro-batch losses are shares of the rollout's (whole-rollout denominators): they add up, as does
    `policy_loss`. Maxima take the largest, minima the smallest; the other statistics are micro-batch means,
    weighted by the micro-batch's token share.
    """

    ADDED = ("policy_loss",)
    MAXED = ("rollout/logp_gap_max", "rollout/is_weight_max")
    MINNED = ("rollout/is_weight_min",)

    def __init__(self) -> None:
        self.values: dict[str, Tensor] = {}

    def add(self, loss: Tensor, stats: dict[str, Tensor], token_share: Tensor) -> None:
        self.values["loss"] = self.values.get("loss", 0.0) + loss.detach()
        for key, value in stats.items():
            if key in self.MAXED:
                self.values[key] = torch.maximum(self.values[key], value) if key in self.values else value
            elif key in self.MINNED:
                self.values[key] = torch.minimum(self.values[key], value) if key in self.values else value
            else:
                self.values[key] = self.values.get(key, 0.0) + (
                    value if key in self.ADDED else value * token_share
                )

    @property
    def loss(self) -> Tensor:
        return self.values["loss"]


def needs_old_logprobs(groups_version: int, policy_version: int, cfg: UpdateSections) -> bool:
    """Whether the update computes the ratio's anchor `old_logprobs` before its first optimizer step: some
    step of it runs on a policy other than the one that sampled the groups (their version is not the policy's
    now, or the update makes several steps: `num_iterations` x `steps_per_generation`), or the KL in the
    reward needs the sampling policy's log-probs. Otherwise `grpo_loss` takes `logprobs.detach()` instead:
    the policy's own log-probs, without a pass."""
    several_steps = cfg.update.optimizer_steps_per_batch > 1
    return groups_version != policy_version or several_steps or cfg.kl.in_reward


class RolloutUpdate:
    """Steps 1-4 above for one policy under `cfg`: what the module's training step calls.

    Args:
        cfg: the algorithm's options.
        score: the per-token log-probs of the policy and reference passes.
        ranks: the other processes, for the loss denominators, the token-budget micro-batch count and
            `scale_rewards="batch"`.
        tokenizer: the policy's, for step credit.
    """

    def __init__(
        self, cfg: UpdateSections, score: LogProbScorer, ranks: Ranks, tokenizer: PreTrainedTokenizerBase
    ) -> None:
        self.cfg, self.score, self.ranks, self.tokenizer = cfg, score, ranks, tokenizer
        # A prompt's G rows stay in one micro-batch where they share its prompt pass.
        self.group_size = cfg.sampling.num_generations if score.share_prompt else 1

    def micro_batches(self, rollout: Rollout) -> list[MicroBatch]:
        """`rollout`'s micro-batches; by token budget, as many as the busiest rank runs (each forward and
        backward synchronises the ranks under DDP and FSDP2)."""
        update = self.cfg.update
        options = (update.micro_batch_size, update.max_tokens_per_micro_batch, self.group_size)
        parts = micro_batches(rollout, *options)
        if self.cfg.update.max_tokens_per_micro_batch is None or self.ranks.world_size == 1:
            return parts
        return micro_batches(rollout, *options, at_least=self.ranks.max(len(parts)))

    def trajectory(
        self,
        scored: ScoredGroups,
        policy: PreTrainedModel,
        reference: PreTrainedModel | None,
        stats: dict[str, Tensor],
        policy_version: int,
    ) -> Trajectory:
        """The reference pass over `scored`'s rollout, and the anchor's (`needs_old_logprobs`: the `policy`
        as it is now, at version `policy_version`, the optimizer steps it has taken), then `build_trajectory`.
        No `reference` with beta > 0: the policy with its LoRA adapters off is the reference."""
        cfg, rollout = self.cfg, scored.rollout
        ref_logprobs = old_logprobs = None
        if cfg.kl.beta > 0:
            with nullcontext() if reference is not None else policy.disable_adapter():
                ref_logprobs = self.frozen_logprobs(rollout, reference or policy)  # [B, T]
        if needs_old_logprobs(scored.policy_version, policy_version, cfg):
            old_logprobs = self.frozen_logprobs(rollout, policy)  # [B, T]
        batch_std_over_ranks = cfg.advantages.scale_rewards == "batch" and self.ranks.world_size > 1
        return build_trajectory(
            scored,
            cfg,
            old_logprobs=old_logprobs,
            ref_logprobs=ref_logprobs,
            tokenizer=self.tokenizer,
            ranks=self.ranks if batch_std_over_ranks else None,
            stats=stats,
        )

    def frozen_logprobs(self, rollout: Rollout, model: PreTrainedModel) -> Tensor:
        return logprobs_in_micro_batches(self.score, model, rollout, self.micro_batches(rollout))  # [B, T]

    def mini_batches(self, trajectory: Trajectory) -> Iterator[tuple[Trajectory, tuple[Tensor, Tensor]]]:
        """`num_iterations` passes over `trajectory`'s `steps_per_generation` mini-batches (a new shuffle
        each), with the denominators of each one's loss: one optimizer step each."""
        for _ in range(self.cfg.update.num_iterations):
            for mini_batch in mini_batches(trajectory, self.cfg.update.steps_per_generation):
                yield mini_batch, mini_batch_denominators(mini_batch, self.ranks)

    def losses(
        self,
        policy: torch.nn.Module,
        mini_batch: Trajectory,
        denominators: tuple[Tensor, Tensor],
        sums: MicroBatchSums,
    ) -> Iterator[Tensor]:
        """Each micro-batch's loss of one optimizer step, for the caller's backward (`micro_batch_losses`)."""
        parts = self.micro_batches(mini_batch.rollout)
        return micro_batch_losses(self.score, policy, mini_batch, parts, self.cfg, *denominators, sums)
