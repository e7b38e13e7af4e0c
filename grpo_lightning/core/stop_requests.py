"""A stop request (a scheduler's SIGTERM) answered within seconds, wherever the run is.

A step's rollout can take minutes (a long generation, a slow reward function or tool), longer than a
scheduler's grace period before SIGKILL (SLURM's default is 30 s). Code that may be abandoned at any
point, because what it computes is discarded and redone (a training step's rollout before its first
optimizer step, a validation batch, a prediction batch), runs `interruptible`: a stop requested while it
runs raises at once, from the signal handler (in Python code at the next bytecode; in a long C call such
as one forward pass when it returns; `time.sleep` and a subprocess's wait return early). Requested
elsewhere, the stop waits for the next `interruptible` entry or `check` (between decoding steps, where
`StopCheck` calls it), so that an optimizer step or a checkpoint being written is never cut in two.

On several ranks a rank cannot leave on its own what the others go on with: they would wait for it in
their next collective. A step's rollout there (`enter_rollout`; a validation batch likewise) stays
interruptible only up to the ranks' first collective of the step; before it (`settle`, which every
collective inside a step calls first: the core's `Ranks`, the engines' weight refreshes, FSDP2's gathers,
the module once its groups are in, and the end of each validation batch) the ranks agree whether any of
them was asked to stop, and every rank stops there or goes on. A rank that left
its rollout on a stop tells the others in that same agreement (`abandon`). Outside a step's rollout a stop
waits for the next one. How the ranks agree, and how a stop requested on one rank reaches the others, is
the requester's (`share_between_ranks`).

The requester (the training side's signal handler) gives the exception to raise; this file holds no
Lightning type.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from transformers import StoppingCriteria

_pending: Callable[[], BaseException] | None = None  # the exception of the stop requested, if any
_depth = 0  # how many `interruptible` regions the main thread is in
_in_rollout = False  # in a training step's rollout, entered with `enter_rollout`
# Several ranks: whether any rank asks to stop (a collective, given this rank's answer), and the exception a
# rank raises when another asked; None on one process.
_any_rank: Callable[[bool], bool] | None = None
_agreed_error: Callable[[], BaseException] | None = None
_undecided = False  # several ranks: in a step's rollout that the ranks have not yet agreed to go on with
_rollout_open = False  # in a rollout from `enter_rollout` to `leave_rollout`: one that may `reopen`


def request_stop(error: Callable[[], BaseException]) -> None:
    """Ask the run to stop with `error()`: raised at once inside interruptible code (this is called from a
    signal handler, on the main thread), else at the next `check` or `enter_interruptible`."""
    global _pending
    _pending = error
    if _depth:
        raise error()


def check() -> None:
    """Raise the stop requested, if any (it stays requested until `clear`); on several ranks only inside a
    step's rollout that they have not yet agreed on (elsewhere the others would wait for this rank)."""
    if _pending is not None and (_any_rank is None or _undecided):
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


def enter_rollout() -> None:
    """A training step's rollout (or a validation batch while fitting) starts: interruptible
    (`enter_interruptible`) until `leave_rollout`, or on several ranks until they agree to go on
    (`settle`), and again wherever the rollout `reopen`s."""
    global _in_rollout, _undecided, _rollout_open
    _in_rollout, _undecided, _rollout_open = True, _any_rank is not None, True
    enter_interruptible()


def leave_rollout() -> None:
    """The rollout is over (or abandoned): no longer interruptible, nor to be reopened."""
    global _rollout_open
    _rollout_open = False
    _release()


def _release() -> None:
    global _in_rollout
    if _in_rollout:
        _in_rollout = False
        leave_interruptible()


def settle() -> None:
    """Called before each collective inside a training step. On several ranks, the first call of a step's
    rollout (or the first after it `reopen`ed) ends its interruptible stretch: the ranks agree whether any
    was asked to stop, and every rank raises here (or has raised in its rollout, and says so in `abandon`)
    or goes on. Elsewhere, and on one process, nothing."""
    global _undecided
    if not _undecided:
        return
    _undecided = False
    _release()
    if _any_rank(_pending is not None):
        _raise_agreed()


def reopen() -> None:
    """After collectives inside a rollout that every rank has finished (FSDP2's gathers, an engine's weight
    push), before work that is each rank's own again up to the rollout's next `settle` (a generation on
    gathered weights, reward functions, tool calls): on several ranks the rollout is interruptible again,
    so that a stop requested there leaves it at once instead of at the step's end. Outside a rollout, and
    on one process (where the rollout never stopped being interruptible), nothing."""
    global _in_rollout, _undecided
    if _any_rank is None or not _rollout_open or _undecided:
        return
    _in_rollout, _undecided = True, True
    enter_interruptible()


def end_rollout() -> None:
    """The rollout is in: on several ranks they agree here, if not since it last opened, whether to stop;
    the step's later collectives never reopen it."""
    settle()
    leave_rollout()


def _raise_agreed() -> None:
    """Raise the stop the ranks agreed on; a rank not asked itself takes the agreed one as its own, so that
    every rank leaving on it counts as stopped (`stop_requested`), as `core.ranks.failures_agreed` asks."""
    global _pending
    _pending = _pending or _agreed_error
    raise _pending()


def abandon() -> None:
    """This rank left its step's rollout on a stop: on several ranks, before they agreed, it tells them in
    the agreement that every rank's `settle` (or `abandon`) takes part in, so that they stop too."""
    global _undecided
    leave_rollout()  # first: a second signal during the agreement is not to raise inside it
    if _undecided:
        _undecided = False
        _any_rank(True)


def share_between_ranks(
    any_rank: Callable[[bool], bool] | None, error: Callable[[], BaseException] | None = None
) -> None:
    """Several ranks: `any_rank(stop)`, a collective every rank calls with whether it asks to stop, says
    whether any does; `error()` is what a rank raises when another asked. None: one process."""
    global _any_rank, _agreed_error
    _any_rank, _agreed_error = any_rank, error


def clear() -> None:
    """No stop requested, no interruptible code running: the state of a new run (or after its end)."""
    global _pending, _depth, _in_rollout, _undecided, _rollout_open
    _pending, _depth, _in_rollout, _undecided, _rollout_open = None, 0, False, False, False


def stop_requested() -> bool:
    return _pending is not None


def stop_agreed() -> None:
    """Raise the stop on every rank at a collective of the caller's own that found a rank asking to stop
    (`core.ranks.failures_agreed`): the step's agreement is made there, whether or not it was before."""
    global _undecided
    _undecided = False
    leave_rollout()
    _raise_agreed()


@contextmanager
def checked_only() -> Iterator[None]:
    """Inside, a stop request is not raised wherever the code is when the signal arrives, only at the
    caller's next `check`: for a third-party loop that must not be cut in the middle of a step (vLLM's
    engine, whose requests are then aborted before the stop propagates)."""
    global _depth
    depth, _depth = _depth, 0
    try:
        yield
    finally:
        _depth = depth


class StopCheck(StoppingCriteria):
    """`generate`'s stopping criterion that `check`s for a stop request between decoding steps (it never
    ends a row itself)."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor | None, **kwargs) -> torch.Tensor:
        check()
        return torch.zeros(input_ids.size(0), dtype=torch.bool, device=input_ids.device)  # [b]
