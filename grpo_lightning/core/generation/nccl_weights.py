"""The trainer's end of vLLM's NCCL weight transfer, with torch alone (no vLLM on the trainer): what
`vllm_push.NCCLPlane` sends and how.

- **Joining.** The trainer mints an NCCL unique id (`torch.cuda.nccl.unique_id`) and sends it, base64, in
  each server's `/init_weight_transfer_engine` body (`nccl_init_bodies`: vLLM's unique-id rendezvous, no
  TCP store); the servers' workers join with it as ranks 1.. while the trainer joins as rank 0
  (`TrainerGroup`), then every rank runs the one-element all-reduce that vLLM's communicator runs right
  after joining. The id carries the address every rank dials first, NCCL's root on the trainer, which
  `root_at` puts at a chosen host and port.
- **Sending.** `/update_weights` names each tensor's name, dtype and shape in order (`send_order`,
  `update_info`); the trainer then broadcasts their bytes packed in buffers (`packed_buffers`) that vLLM's
  workers cut and read back from those names, dtypes and shapes alone
  (`packed_tensor.packed_nccl_broadcast_consumer`).

`tests/vllm_backend/test_vllm_nccl_layout.py` checks the bodies and the buffers against vLLM's own parsing
and unpacking code.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

# Bytes of one packed buffer, sent to the workers at init (both sides must cut the same buffers). Smaller
# than vLLM's 1 GiB default: a buffer is a copy on the training GPU while it is sent.
PACKED_BUFFER_BYTES = 256 * 2**20


def nccl_init_bodies(unique_id: bytes, world_sizes: list[int], buffer_bytes: int) -> list[dict]:
    """Each server's `/init_weight_transfer_engine` body: one group of the trainer (rank 0) and every
    server's workers (`world_sizes`: each server's `/get_world_size`), server i's from rank 1 + the workers
    of the servers before it, joined with `unique_id`; packed buffers of `buffer_bytes`."""
    total = 1 + sum(world_sizes)
    encoded = base64.b64encode(unique_id).decode("ascii")  # vLLM takes standard base64, not URL-safe
    return [
        {
            "init_info": {
                "nccl_unique_id_b64": encoded,
                "rank_offset": 1 + sum(world_sizes[:i]),
                "world_size": total,
                "packed": True,
                "packed_buffer_size_bytes": buffer_bytes,
            }
        }
        for i in range(len(world_sizes))
    ]


def send_order(weights: list[tuple[str, Tensor]]) -> list[tuple[str, Tensor]]:
    """`weights` widest element first (in their order otherwise): each tensor then starts in its packed
    buffer at a multiple of its element size, which vLLM's workers need to view its bytes as its dtype (a
    float32 after an odd number of bfloat16 elements could not be read)."""
    return sorted(weights, key=lambda item: -item[1].element_size())


def update_info(weights: list[tuple[str, Tensor]]) -> dict:
    """`/update_weights`' body for `weights` in the order they are broadcast."""
    return {
        "update_info": {
            "names": [name for name, _ in weights],
            "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in weights],
            "shapes": [list(t.shape) for _, t in weights],
        }
    }


def packed_buffers(tensors: Iterable[Tensor], buffer_bytes: int) -> Iterator[Tensor]:
    """The tensors' bytes as vLLM's workers read them: back to back in order, no padding, in uint8 buffers
    each closed right after the tensor that takes it past `buffer_bytes` (a tensor larger than that ends
    the buffer it joins), the last one holding what remains."""
    parts: list[Tensor] = []
    size = 0
    for tensor in tensors:
        data = tensor.contiguous().view(-1).view(torch.uint8)
        parts.append(data)
        size += data.numel()
        if size > buffer_bytes:
            yield torch.cat(parts)
            parts, size = [], 0
    if parts:
        yield torch.cat(parts)


@contextmanager
def root_at(host: str, port: int) -> Iterator[None]:
    """Within: NCCL's root, which every rank of a new group dials first, at `host`:`port` (an address of
    this machine) for the unique ids minted and the groups joined as rank 0 in this process. NCCL reads
    `NCCL_COMM_ID` at both (without it the root takes a free port on an interface NCCL picks); the variable
    is as it was after."""
    before = os.environ.get("NCCL_COMM_ID")
    os.environ["NCCL_COMM_ID"] = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        yield
    finally:
        if before is None:
            del os.environ["NCCL_COMM_ID"]
        else:
            os.environ["NCCL_COMM_ID"] = before


class TrainerGroup:
    """Rank 0 of an NCCL group on `device`, over torch's own NCCL bindings (`torch.cuda.nccl`)."""

    @staticmethod
    def unique_id() -> bytes:
        """A fresh NCCL unique id (128 bytes): its holders can join one group."""
        import torch.cuda.nccl

        return torch.cuda.nccl.unique_id()

    def __init__(self, unique_id: bytes, world_size: int, device: torch.device) -> None:
        """Join as rank 0; returns once every rank has joined and run the warm-up all-reduce."""
        import torch.cuda.nccl

        self.nccl, self.device = torch.cuda.nccl, device
        with torch.cuda.device(device):  # the communicator binds to the current device of this thread
            self.comm = self.nccl.init_rank(world_size, unique_id, 0)
            # vLLM's communicator all-reduces one float32 right after joining: every rank must match it.
            self.nccl.all_reduce([torch.zeros(1, device=device)], comms=[self.comm])
            self.synchronize()

    def broadcast(self, buffer: Tensor) -> None:
        """Send `buffer` (on `device`) from rank 0 to every other rank (enqueued on the current stream)."""
        self.nccl.broadcast([buffer], root=0, comms=[self.comm])

    def synchronize(self) -> None:
        """Wait until every broadcast enqueued so far has been sent."""
        torch.cuda.current_stream(self.device).synchronize()
