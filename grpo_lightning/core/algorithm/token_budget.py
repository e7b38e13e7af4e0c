"""Micro-batches by token budget (verl's `use_dynamic_bsz`, OpenRLHF's `dynamic_batch_enable`).

A rollout's rows differ widely in length (MATH: most completions of 100-300 tokens, a few at the limit).
Cut into micro-batches of a fixed number of rows and padded to the rollout's longest row, most of the
compute goes to padding. Here rows of similar length go together, and each micro-batch holds as many rows
as fit the budget: `rows x its longest row <= max_tokens`, the size of its padded `[rows, longest]` batch
when padded only to its own longest row.

Pure functions of the rows' lengths: nothing here imports torch or Lightning.
"""

from __future__ import annotations

from collections.abc import Sequence


def token_budget_micro_batches(
    lengths: Sequence[int], max_tokens: int, group_size: int = 1, at_least: int = 1
) -> list[list[int]]:
    """Partition rows `0 .. len(lengths) - 1` into micro-batches of at most `max_tokens` padded tokens.

    Args:
        lengths: each row's tokens (prompt + completion, no padding), `[B]`.
        max_tokens: the budget of one micro-batch: its rows x its longest row.
        group_size: rows that stay in one micro-batch, the contiguous groups `[i * g, (i + 1) * g)` (a
            prompt's G completions with `share_prompt`, whose prompt pass they share); 1: any row alone.
        at_least: the fewest micro-batches to return. Under DDP or FSDP every rank must run as many
            forward/backward passes as the others (each one synchronises): the module asks each rank for
            the largest count of any rank. Micro-batches of several units are split in two (the one with
            the most units first, its longer half first) until there are that many.

    Returns:
        Row indices per micro-batch, ascending within each; micro-batches from the longest rows to the
        shortest. Every row is in exactly one. Units (rows, or groups) are taken longest first and added to
        the current micro-batch while the budget holds, so neighbours in length share a micro-batch (first
        fit decreasing on one bin at a time). A unit whose own rows x longest row exceed the budget cannot be
        split: it gets a micro-batch of its own, over the budget (`over_budget` says which).
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens_per_micro_batch={max_tokens}: must be >= 1")
    if group_size < 1 or len(lengths) % group_size:
        raise ValueError(f"{len(lengths)} rows cannot be cut into groups of {group_size}")
    units = [list(range(start, start + group_size)) for start in range(0, len(lengths), group_size)]
    units.sort(key=lambda rows: max(lengths[r] for r in rows), reverse=True)  # stable: ties keep row order
    micro_batches: list[list[int]] = []
    current: list[int] = []
    longest = 0  # the current micro-batch's longest row: its first unit's, as units come longest first
    for unit in units:
        unit_longest = max(lengths[r] for r in unit)
        if current and (len(current) + len(unit)) * longest > max_tokens:
            micro_batches.append(current)
            current = []
        if not current:
            longest = unit_longest
        current.extend(unit)
    if current:
        micro_batches.append(current)
    return [sorted(rows) for rows in _split_to(micro_batches, at_least, group_size)]


def _split_to(micro_batches: list[list[int]], count: int, group_size: int) -> list[list[int]]:
    """Split the micro-batch of the most units in two, at a unit boundary, until there are `count`."""
    micro_batches = list(micro_batches)
    while len(micro_batches) < count:
        widest = max(range(len(micro_batches)), key=lambda i: len(micro_batches[i]))
        rows = micro_batches[widest]
        if len(rows) < 2 * group_size:
            raise ValueError(
                f"{len(micro_batches)} micro-batches of single units (rows or groups of {group_size}) cannot "
                f"become the {count} that another rank runs: lower max_tokens_per_micro_batch so that each "
                "rank's rollout makes as many"
            )
        half = len(rows) // group_size // 2 * group_size  # rows kept in order: longest units first
        micro_batches[widest : widest + 1] = [rows[:half], rows[half:]]
    return micro_batches


def over_budget(lengths: Sequence[int], micro_batches: Sequence[Sequence[int]], max_tokens: int) -> list[int]:
    """Indices of the micro-batches over the budget: each a single unit too long to fit it alone."""
    return [
        i for i, rows in enumerate(micro_batches) if len(rows) * max(lengths[r] for r in rows) > max_tokens
    ]
