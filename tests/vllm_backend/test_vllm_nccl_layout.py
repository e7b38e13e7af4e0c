"""What the NCCL plane's trainer side (`core.generation.nccl_weights`, torch alone) sends, read by vLLM's own
worker code on CPU, no server and no GPU: only the NCCL transport and the CUDA streams are stood in for.

- The init bodies parse as vLLM's `NCCLWeightTransferInitInfo` and give back the trainer's 128-byte unique
  id, the group's size and the buffer size; vLLM's worker rank arithmetic puts every server's workers (1 or
  2 servers, tensor parallel 1 or 2) on distinct ranks 1..N after the trainer's 0.
- The packed buffers, fed to vLLM's `receive_weights` (its `/update_weights` on a worker: the update info
  parsed, the buffers cut by `packed_nccl_broadcast_consumer`, unpacked by `unpack_tensor`), come back as the
  trainer's tensors (names, dtypes incl. bfloat16, shapes, values) over several buffers, every buffer read;
  they are byte for byte what vLLM's own producer would broadcast.
"""

from __future__ import annotations

import contextlib
import json
from types import SimpleNamespace

import pytest
import torch

from grpo_lightning.core.generation.nccl_weights import (
    nccl_init_bodies,
    packed_buffers,
    send_order,
    update_info,
)

UNIQUE_ID = bytes((i * 37 + 11) % 256 for i in range(128))  # its base64 holds "+" and "/": not URL-safe


@pytest.fixture(autouse=True)
def no_cuda(monkeypatch):
    """vLLM's packing code on CPU: device 0 and its streams stood in for (no-ops)."""
    from vllm.distributed.weight_transfer import packed_tensor

    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    no_stream = SimpleNamespace(synchronize=lambda: None)
    monkeypatch.setattr(packed_tensor, "_get_streams", lambda device, n: (no_stream,) * n)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())


def worker_engine(monkeypatch, group: object):
    """vLLM's NCCL engine as a server's worker holds it, without a model or a device: joining a group
    gives back `group` and records the id, rank and world size it was joined with."""
    from vllm.distributed.weight_transfer import nccl_common
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    joins = []

    def join(unique_id, rank, world_size, device):
        joins.append((unique_id, rank, world_size))
        return group

    monkeypatch.setattr(nccl_common, "uid_init_process_group", join)
    engine = NCCLWeightTransferEngine.__new__(NCCLWeightTransferEngine)  # its __init__ wants a vLLM config
    engine.device = torch.device("cpu")
    return engine, joins


@pytest.mark.parametrize("world_sizes", [[1], [2], [1, 1], [2, 2], [1, 2]])
def test_the_init_bodies_parse_as_vllms_and_give_every_worker_its_own_rank(monkeypatch, world_sizes):
    engine, joins = worker_engine(monkeypatch, group=None)
    bodies = json.loads(json.dumps(nccl_init_bodies(UNIQUE_ID, world_sizes, 4096)))  # as sent over HTTP
    for body, size in zip(bodies, world_sizes, strict=True):
        info = engine.parse_init_info(body["init_info"])
        assert info.nccl_unique_id_bytes == UNIQUE_ID
        total = 1 + sum(world_sizes)
        assert (info.world_size, info.packed, info.packed_buffer_size_bytes) == (total, True, 4096)
        for worker in range(size):  # the server's tensor-parallel workers, one data-parallel rank
            engine.parallel_config = SimpleNamespace(data_parallel_index=0, world_size=size, rank=worker)
            engine.init_transfer_engine(info)
    assert [j[0] for j in joins] == [UNIQUE_ID] * sum(world_sizes)
    assert {j[2] for j in joins} == {1 + sum(world_sizes)}
    assert sorted(j[1] for j in joins) == list(range(1, 1 + sum(world_sizes))), "rank 0 is the trainer's"


class Wire:
    """The group as a worker sees it: each broadcast fills the worker's buffer with the trainer's next one,
    which must have the size the worker cut."""

    def __init__(self, sent: list[torch.Tensor]) -> None:
        self.sent, self.received = sent, 0

    def broadcast(self, tensor: torch.Tensor, src: int, stream=None) -> None:
        assert src == 0 and self.received < len(self.sent), "the worker waits for a buffer never sent"
        buffer = self.sent[self.received]
        cut = f"buffer {self.received} cut apart"
        assert (tensor.dtype, tensor.shape) == (buffer.dtype, buffer.shape), cut
        tensor.copy_(buffer)
        self.received += 1


def test_vllms_worker_reads_the_packed_buffers_back_as_the_trainers_tensors(monkeypatch):
    g = torch.Generator().manual_seed(0)
    weights = [  # the trainer's order: an odd number of bfloat16 elements before float32 ones
        ("embed.weight", torch.randn(7, 3, generator=g).to(torch.bfloat16)),
        ("norm.weight", torch.randn(5, generator=g)),
        ("big.weight", torch.randn(40, generator=g)),  # 160 bytes: past a buffer alone
        ("layer.0.weight", torch.randn(2, 3, generator=g).to(torch.bfloat16)),
        ("layer.0.bias", torch.randn(3, generator=g).to(torch.float16)),
        ("layer.1.weight", torch.randn(4, 4, generator=g)),  # 64 bytes: a buffer's size exactly
        ("scale", torch.tensor(2.5)),
    ]
    ordered = send_order(weights)
    sent = list(packed_buffers((t for _, t in ordered), 64))
    assert len(sent) >= 3, "the small buffer splits the weights"
    wire = Wire(sent)
    engine, _ = worker_engine(monkeypatch, group=wire)
    loaded = []
    engine.model = SimpleNamespace(load_weights=lambda pairs: loaded.extend((n, t.clone()) for n, t in pairs))
    engine.parallel_config = SimpleNamespace(data_parallel_index=0, world_size=1, rank=0)
    engine.init_transfer_engine(engine.parse_init_info(nccl_init_bodies(UNIQUE_ID, [1], 64)[0]["init_info"]))
    body = json.loads(json.dumps(update_info(ordered)))
    engine.receive_weights(engine.parse_update_info(body["update_info"]))
    assert wire.received == len(sent), "every buffer read"
    assert [n for n, _ in loaded] == [n for n, _ in ordered]
    assert sorted(n for n, _ in loaded) == sorted(n for n, _ in weights)
    for (name, got), (_, want) in zip(loaded, ordered, strict=True):
        assert (got.dtype, got.shape) == (want.dtype, want.shape), name
        assert torch.equal(got, want), name


def test_the_packed_buffers_are_what_vllms_own_producer_broadcasts():
    from vllm.distributed.weight_transfer import packed_tensor

    g = torch.Generator().manual_seed(1)
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.bfloat16, torch.float16] * 3
    weights = send_order([(f"w{i}", torch.randn(i + 1, generator=g).to(d)) for i, d in enumerate(dtypes)])
    theirs = []
    group = SimpleNamespace(broadcast=lambda tensor, src: theirs.append(tensor.clone()))
    packed_tensor.packed_nccl_broadcast_producer(iter(weights), group, 0, lambda item: item[1], 64, 2)
    ours = list(packed_buffers((t for _, t in weights), 64))
    assert len(ours) == len(theirs) > 2
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
