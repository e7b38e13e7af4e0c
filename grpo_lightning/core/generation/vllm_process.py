"""The trainer's process around a colocated vLLM engine: this rank's local index (`local_rank`), vLLM's
start-up with the trainer's threads, random generators, garbage collector and environment kept
(`TrainerProcessGuard`), and its shutdown with the trainer's default process group kept
(`default_group_kept`).

No Lightning here.
"""

from __future__ import annotations

import contextlib
import gc
import os
import socket
from collections.abc import Iterator

import torch

from grpo_lightning.core.rng import capture_rng_states, restore_rng_states


def local_rank(device: torch.device) -> int:
    """This process's index among its node's devices: a CUDA device's own index, else `LOCAL_RANK`
    (set by Lightning and torchrun), else `SLURM_LOCALID` (set by `srun`), else 0."""
    if device.type == "cuda" and device.index is not None:
        return device.index
    for name in ("LOCAL_RANK", "SLURM_LOCALID"):
        if os.environ.get(name):
            return int(os.environ[name])
    return 0


class TrainerProcessGuard:
    """Around vLLM's start-up in the trainer's process: its torch threads, `torch.set_num_threads`, random
    generators and garbage collector kept as they were, and the variables vLLM's `external_launcher` reads
    (rank, world size, local rank, rendezvous) set from the trainer's process group and `local_rank`, or for
    one process without a group."""

    def __init__(self, local_rank: int) -> None:
        dist = torch.distributed
        self.grouped = grouped = dist.is_available() and dist.is_initialized()
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if grouped else (0, 1)
        self.local_rank = local_rank

    def __enter__(self) -> None:
        self.threads, self.set_threads = torch.get_num_threads(), torch.set_num_threads
        self.rng = capture_rng_states()
        launch = {"RANK": str(self.rank), "WORLD_SIZE": str(self.world), "LOCAL_RANK": str(self.local_rank)}
        launch["MASTER_ADDR"] = os.environ.get("MASTER_ADDR", "127.0.0.1")
        launch["MASTER_PORT"] = os.environ.get("MASTER_PORT") or str(_free_port())
        launch["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", str(self.threads))  # unset, vLLM sets 1
        launch["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process
        self.saved = {name: os.environ.get(name) for name in launch}
        os.environ.update(launch)

    def __exit__(self, *exc: object) -> None:
        for name, value in self.saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        torch.set_num_threads = self.set_threads
        torch.set_num_threads(self.threads)
        gc.unfreeze()  # vLLM freezes the objects alive at start-up: the trainer's garbage stays collectable
        restore_rng_states(self.rng)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def default_group_kept() -> Iterator[None]:
    """Inside: `torch.distributed.destroy_process_group()` of the default group does nothing (vLLM's
    shutdown calls it at its end); its own groups are destroyed as it asks."""
    destroy = torch.distributed.destroy_process_group

    def destroy_but_the_default(group: object = None) -> None:
        if group is not None:
            destroy(group)

    torch.distributed.destroy_process_group = destroy_but_the_default
    try:
        yield
    finally:
        torch.distributed.destroy_process_group = destroy
