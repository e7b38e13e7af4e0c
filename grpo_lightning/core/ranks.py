"""The other processes of a run, as the core asks them: `Ranks` (sums, maxima and gathers, every rank calling
each method in the same order) and `OneProcess`, a single process's. The training layer supplies a
strategy's (`io.distributed.StrategyRanks`).

An error inside a block that every rank runs at the same point (a rollout: a vLLM server that stops answering
one rank's requests) must end every rank there, not leave the others waiting in their next collective:
`failures_agreed` raises an `AgreedFailure` on every rank, with the failing rank's message.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from grpo_lightning.core.stop_requests import stop_agreed, stop_requested


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


class AgreedFailure(RuntimeError):
    """An error that ended every rank at the same point (`failures_agreed`): its message is the first failing
    rank's, with that rank's number. No rank is left in a collective, so the ranks can still write a
    checkpoint together."""


@contextmanager
def failures_agreed(device: torch.device) -> Iterator[None]:
    """Inside, an error on any rank ends every rank at the block's end, together: each rank says whether it
    failed and whether it was asked to stop (one all-reduce of two flags on `device`, every rank, every
    time); where one was asked to stop, every rank raises the stop (`core.stop_requests`); where one
    failed, every rank raises an `AgreedFailure` with the first failing rank's message, rather than go on
    to a collective the failed rank never joins. Every rank must enter and leave the block at the same
    point, with no collective inside that an error could skip. In one process the block's errors pass
    unchanged."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        yield
        return
    failure: Exception | None = None
    try:
        yield
    except Exception as err:  # said to the other ranks below
        failure = err
    except BaseException:
        if not stop_requested():  # a second Ctrl-C: at once, as on one process
            raise
    # The stop requests go in the same collective: a rank that left the block on a stop (a SIGTERM inside a
    # step's rollout) takes part in it, and every rank stops here with it rather than wait for it. A rank
    # that left the rollout before this block (a stop in a tool call between two generations) meets it in
    # the ranks' agreement on stopping (`io.shared_stops.SharedStops.any_rank`), the same all-reduce.
    flags = torch.tensor([float(failure is not None), float(stop_requested())], device=device)  # [2]
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    if flags[1].item():
        stop_agreed()
    if not flags[0].item():
        return
    messages: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, None if failure is None else str(failure))
    rank, message = next((rank, m) for rank, m in enumerate(messages) if m is not None)
    raise AgreedFailure(f"rank {rank}: {message}") from failure
