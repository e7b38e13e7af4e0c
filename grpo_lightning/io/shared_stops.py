"""A stop request (SIGTERM) shared by every rank of a run: `SharedStops`, the ranks' agreement on whether
to stop (`any_rank`, which `core.stop_requests` asks before a step's first collective) and a thread that
makes a stop requested on one rank every rank's, within a fraction of a second.

A scheduler may signal every process of a job (torchrun and SLURM forward SIGTERM to each task), or one
only, and not at the same moment. A rank deep in a slow reward function or tool call cannot learn of
another's stop through a collective (that would wait for it to finish): each rank's thread publishes its
own process's stop request in the process group's key-value store, and looks there for the others'. A
rank told so gets SIGTERM on its main thread, as if signalled itself: a `time.sleep` or a subprocess's
wait returns early, and its signal handler (the interrupt checkpoint's) decides what stops.

No Lightning here.
"""

from __future__ import annotations

import signal
import threading
import time

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store

from grpo_lightning.core.stop_requests import stop_requested

POLL_SECONDS = 0.1  # how often each rank's thread looks for the others' stop requests


class SharedStops:
    """Every rank's stop requests shared between them for one run, under `key` in the default process
    group's store (the same on every rank, a new one per run); `device` holds the agreement's tensor (the
    process group's backend's: CPU for gloo, the rank's GPU for NCCL). Every rank builds one; `close` it
    when the run ends, before the signal handlers are put back."""

    def __init__(self, key: str, device: torch.device) -> None:
        self.key, self.device = key, device
        self.store = _get_default_store()  # the process group's own: no server, no port of ours
        self._closed = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="grpo-lightning-stops", daemon=True)
        self._watcher.start()

    def any_rank(self, stop: bool) -> bool:
        """Whether any rank asks to stop, `stop` saying whether this one does: a collective, every rank
        calls it. Its wait runs in Python, so that a signal's handler runs meanwhile: a rank that waits
        here for another still in its rollout is stopped by its own SIGTERM too, and tells the others.
        It is the very collective of `core.ranks.failures_agreed` (two flags, failure and stop, their
        maximum): a rank that left a rollout on a stop meets there another still inside that block."""
        flags = torch.tensor([0.0, float(stop)], device=self.device)  # [2] no failure of ours, the stop
        work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, async_op=True)
        while not work.is_completed():
            time.sleep(POLL_SECONDS / 10)
        work.wait()  # raises what the collective failed with
        return bool(flags[1].item())

    def close(self) -> None:
        """Stop looking for the other ranks' requests (a signal the thread sent has arrived once this
        returns)."""
        self._closed.set()
        self._watcher.join()

    def _watch(self) -> None:
        published = delivered = False
        main = threading.main_thread().ident
        try:
            while not self._closed.wait(POLL_SECONDS):
                if stop_requested():
                    if not published:
                        self.store.set(self.key, "stop")
                        published = True
                elif not delivered and self.store.check([self.key]):
                    delivered = True
                    signal.pthread_kill(main, signal.SIGTERM)
        except (RuntimeError, OSError):  # the store went with its process (rank 0's): nothing left to tell
            return
