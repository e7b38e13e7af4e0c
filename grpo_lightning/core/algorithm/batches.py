"""The rows each step of the update runs on (`core/update.py`'s steps 2 and 3): a rollout's groups shuffled
and cut into mini-batches of whole groups, one optimizer step each, with the denominators each normalises
its loss by; micro-batches of fixed rows or of the token-budget partition, each taken out and trimmed to
its own longest row. No Lightning here.
"""

from __future__ import annotations

from typing import TypeVar

import torch
from torch import Tensor

from grpo_lightning.core.algorithm.token_budget import token_budget_micro_batches
from grpo_lightning.core.ranks import Ranks
from grpo_lightning.core.types import Rollout, Trajectory

MicroBatch = slice | Tensor  # rows of the rollout: a slice (full width) or indices (trimmed to their longest)
Part = TypeVar("Part", Rollout, Trajectory)  # what a micro-batch takes its rows of


# ------------------------------------------------------------------------------------- 2. mini-batches
def shuffled_mini_batches(
    num_groups: int, steps: int, generator: torch.Generator | None = None
) -> list[Tensor]:
    """The group indices of each of `steps` mini-batches: a permutation of `0 .. num_groups - 1` drawn from
    `generator` (None: torch's default CPU generator, the training stream that checkpoints keep) and cut
    into `steps` parts whose sizes differ by at most one."""
    if num_groups < steps:
        raise ValueError(
            f"grpo.update.steps_per_generation={steps}: this rollout has only {num_groups} groups "
            "(prompts) to cut "
            "into that many optimizer steps; lower it or raise data.batch_size"
        )
    order = torch.randperm(num_groups, generator=generator)  # [N]
    return list(torch.tensor_split(order, steps))


def group_rows(groups: Tensor, num_generations: int) -> Tensor:
    """The rows `[len(groups) * G]` of `groups`, each group's G rows together, in the groups' order."""
    G = num_generations
    return (groups[:, None] * G + torch.arange(G)).reshape(-1)  # [n * G]


def mini_batches(
    trajectory: Trajectory, steps: int, generator: torch.Generator | None = None
) -> list[Trajectory]:
    """The trajectories of `steps` optimizer steps on one rollout: its groups shuffled (from `generator`,
    None: torch's default CPU generator, which checkpoints keep) and cut into `steps` mini-batches of whole
    groups. One step: the trajectory itself, nothing drawn."""
    if steps == 1:
        return [trajectory]
    G = trajectory.num_generations
    cut = shuffled_mini_batches(trajectory.rewards.numel() // G, steps, generator)
    return [trajectory.select(group_rows(groups, G)) for groups in cut]


def mini_batch_denominators(mini_batch: Trajectory, ranks: Ranks) -> tuple[Tensor, Tensor]:
    """`(total_tokens, total_sequences)` that one optimizer step's loss is normalised by: the loss tokens
    of its mini-batch on every rank, divided by the world size (DDP averages the ranks' gradients), and
    this rank's sequences in it."""
    mask = mini_batch.loss_mask  # [b, T]
    total_tokens = ranks.sum(mask.sum()) / ranks.world_size
    return total_tokens, torch.tensor(float(mask.size(0)), device=mask.device)


# ------------------------------------------------------------------------------------- 3. micro-batches
def micro_batches(
    rollout: Rollout,
    micro_batch_size: int | None,
    max_tokens: int | None = None,
    group_size: int = 1,
    at_least: int = 1,
) -> list[MicroBatch]:
    """The micro-batches of `rollout`'s rows: with `max_tokens`, the token-budget partition (a row's
    length: its prompt and completion tokens; `group_size` rows kept together; `at_least` micro-batches,
    as many as another rank runs), as index tensors; else slices of at most `micro_batch_size` rows (one
    slice when None)."""
    size = rollout.completion_ids.size(0)
    if max_tokens is None:
        step = micro_batch_size or size
        return [slice(i, min(i + step, size)) for i in range(0, size, step)]
    lengths = (rollout.prompt_mask.sum(1) + rollout.completion_mask.sum(1)).tolist()  # [B]
    device = rollout.completion_ids.device
    parts = token_budget_micro_batches(lengths, max_tokens, group_size, at_least)
    return [torch.tensor(rows, dtype=torch.long, device=device) for rows in parts]


def micro_batch_part(whole: Part, rows: MicroBatch) -> tuple[Part, slice]:
    """What a micro-batch is scored on (a `Rollout`) or its loss reads (a `Trajectory`), and its rows there:
    `whole` itself for a slice; for indices, their own part trimmed to their longest row, all of its rows."""
    if isinstance(rows, slice):
        return whole, rows
    return whole.select(rows, trim=True), slice(None)
