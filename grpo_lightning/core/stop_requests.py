"""A stop request (a scheduler's SIGTERM) answered within seconds, wherever the run is.

A step's rollout can take minutes (a long generation, a slow reward function or tool), longer than a
scheduler's grace period before SIGKILL (SLURM's default is 30 s). Code that may be abandoned at any
point, because what it computes is discarded and redone (a training step's rollout before its first
optimizer step, a validation batch, a prediction batch), runs `interruptible`: a stop requested while it
runs raises at once, from the signal handler (in Python code at the next bytecode; in a long C call such
as one forward pass when it returns; `time.sleep` and a subprocess's wait return early). Requested
elsewhere, the stop waits for the next `interruptible` entry or `check` (between decoding steps, where
`StopCheck` calls it), so that an optimizer step or a checkpoint being written is never cut in two.

The requester (the training side's signal handler) gives the exception to raise; this file holds no
Lightning type.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import StoppingCriteria

_pending: Callable[[], BaseException] | None = None  # the exception of the stop requested, if any
_depth = 0  # how many `interruptible` regions the main thread is in


def request_stop(error: Callable[[], BaseException]) -> None:
    """Ask the run to stop with `error()`: raised at once inside interruptible code (this is called from a
    signal handler, on the main thread), else at the next `check` or `enter_interruptible`."""
    global _pending
    _pending = error
    if _depth:
        raise error()


def check() -> None:
    """Raise the stop requested, if any (it stays requested until `clear`)."""
    if _pending is not None:
        raise _pending()


def enter_interruptible() -> None:
    """Code from here to `leave_interruptible` may be abandoned at any point: a stop requested before
    raises now, one requested while it runs raises there."""
    global _depth
    check()
    _depth += 1


def leave_interruptible() -> None:
    global _depth
    _depth = max(0, _depth - 1)


def clear() -> None:
    """No stop requested, no interruptible code running: the state of a new run (or after its end)."""
    global _pending, _depth
    _pending, _depth = None, 0


def stop_requested() -> bool:
    return _pending is not None


class StopCheck(StoppingCriteria):
    """`generate`'s stopping criterion that `check`s for a stop request between decoding steps (it never
    ends a row itself)."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor | None, **kwargs) -> torch.Tensor:
        check()
        return torch.zeros(input_ids.size(0), dtype=torch.bool, device=input_ids.device)  # [b]
