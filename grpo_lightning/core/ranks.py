"""The other processes of a run, as the core asks them: `Ranks` (sums, maxima and gathers, every rank calling
each method in the same order) and `OneProcess`, a single process's. The training layer supplies a
strategy's (`io.distributed.StrategyRanks`).
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor


class Ranks(Protocol):
    """What an update asks of the other processes; every rank calls each method, in the same order."""

    world_size: int
    rank: int

    def sum(self, value: Tensor) -> Tensor:
        """`value` summed over the ranks."""
        ...

    def max(self, value: int) -> int:
        """The largest of the ranks' `value`s."""
        ...

    def gather(self, values: list) -> list[list]:
        """Every rank's `values` (lists of any length), in rank order."""
        ...


class OneProcess:
    """`Ranks` of a single process: nothing to ask."""

    world_size, rank = 1, 0

    def sum(self, value: Tensor) -> Tensor:
        return value

    def max(self, value: int) -> int:
        return value

    def gather(self, values: list) -> list[list]:
        return [values]
