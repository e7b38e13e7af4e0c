"""How one rollout is cut for the update: mini-batches (one optimizer step each) and micro-batches (one
forward/backward each).

- Mini-batches (`steps_per_generation`; TRL's `steps_per_generation`, verl's `ppo_mini_batch_size`): the
  rollout's groups in a random order, cut into that many mini-batches of whole groups. The advantages were
  computed over whole groups before the cut; each optimizer step normalises its loss over its own
  mini-batch (`update.mini_batch_denominators`).
- Micro-batches: consecutive row slices of `micro_batch_size` rows (padded to the rollout's longest row,
  as sampled), or the token-budget partition of `core.token_budget` (`max_tokens_per_micro_batch`), whose
  micro-batches are index tensors: each is taken out of the rollout and trimmed to its own longest row
  (`Rollout.select`, `Trajectory.select`).
- `logprobs_in_micro_batches`: a frozen pass (reference, old policy) over a rollout, micro-batch by
  micro-batch.

No Lightning here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from grpo_lightning.core.algorithm.token_budget import token_budget_micro_batches
from grpo_lightning.core.types import Rollout

MicroBatch = slice | Tensor  # rows of the rollout: a slice (full width) or indices (trimmed to their longest)
# (model, rollout, rows, with_entropy) -> (logprobs, entropies) [b, T] each: `rollout.LogProbScorer`
Score = Callable[..., tuple[Tensor, Tensor]]


def shuffled_mini_batches(
    num_groups: int, steps: int, generator: torch.Generator | None = None
) -> list[Tensor]:
    """The group indices of each of `steps` mini-batches: a permutation of `0 .. num_groups - 1` drawn from
    `generator` (None: torch's default CPU generator, the training stream that checkpoints keep) and cut
    into `steps` parts whose sizes differ by at most one."""
    if num_groups < steps:
        raise ValueError(
            f"grpo.steps_per_generation={steps}: this rollout has only {num_groups} groups (prompts) to cut "
            "into that many optimizer steps; lower it or raise data.batch_size"
        )
    order = torch.randperm(num_groups, generator=generator)  # [N]
    return list(torch.tensor_split(order, steps))


def group_rows(groups: Tensor, num_generations: int) -> Tensor:
    """The rows `[len(groups) * G]` of `groups`, each group's G rows together, in the groups' order."""
    G = num_generations
    return (groups[:, None] * G + torch.arange(G)).reshape(-1)  # [n * G]


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


def micro_batch_rollout(rollout: Rollout, rows: MicroBatch) -> tuple[Rollout, slice]:
    """The rollout a micro-batch is scored on and its rows there: `rollout` itself for a slice; for
    indices, their own rollout trimmed to their longest row, all of its rows."""
    if isinstance(rows, slice):
        return rollout, rows
    return rollout.select(rows, trim=True), slice(None)


@torch.no_grad()
def logprobs_in_micro_batches(score: Score, model, rollout: Rollout, parts: list[MicroBatch]) -> Tensor:
    """`rollout`'s per-token log-probs `[B, T]` under `model`, scored micro-batch by micro-batch; the
    columns a trimmed micro-batch drops (padding in each of its rows) hold 0."""
    ids = rollout.completion_ids
    logprobs = torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)  # [B, T], as scorers give
    for rows in parts:
        part, part_rows = micro_batch_rollout(rollout, rows)
        scored = score(model, part, part_rows)[0]  # [b, T']
        logprobs[rows, : scored.size(1)] = scored
    return logprobs
