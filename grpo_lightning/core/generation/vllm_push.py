"""The trainer's weights into running `vllm serve` processes, over one of three data planes
(`VLLMServerOptions.weight_plane`), each a `push(weights, version)`:

- `DiskPlane`: the weights in their checkpoint names as one safetensors file in a fresh folder the servers can
  read (shared memory where present), loaded by every server's workers (`/collective_rpc reload_weights`,
  which reprocesses each layer as at load; a tied LM head is repacked after it by the workers' extension,
  `io.vllm_worker`, as vLLM's CPU build needs). Works anywhere
  the servers see the trainer's files: CPU, CI, or GPUs that cannot reach the trainer over NCCL.
- `LoRAPlane`: the adapter alone, saved as a PEFT adapter and loaded under a new name per push
  (`/v1/load_lora_adapter`), the last push's unloaded; the frozen base is never sent (the servers serve the
  policy's base checkpoint).
- `NCCLPlane`: vLLM's weight-transfer protocol, GPUs only: the trainer joins the servers' workers in one NCCL
  group once (`/init_weight_transfer_engine` with a unique id the trainer minted: trainer rank 0, each
  server's workers after it), then per push `/start_weight_update`, `/update_weights` (names, dtypes,
  shapes) while the trainer broadcasts the weights in packed buffers, `/finish_weight_update`. The
  collective runs in a thread of its own and the HTTP calls in others, so that every step keeps a timeout.
  The trainer's side is torch's NCCL alone (`nccl_weights`).

After every plane: each server's prefix cache reset (its blocks carry no weight version) and its weight
version set and read back (`stamp_version`). No Lightning and no vLLM here.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import torch
from torch import Tensor

from grpo_lightning.core.generation.nccl_weights import (
    PACKED_BUFFER_BYTES,
    TrainerGroup,
    nccl_init_bodies,
    packed_buffers,
    root_at,
    send_order,
    update_info,
)
from grpo_lightning.core.generation.vllm_client import ServerError, ServerRouter, VLLMServer

SHARED_MEMORY = "/dev/shm"


def push_folder(root: str | None) -> str:
    """A fresh folder for the pushed files under `root`; None: shared memory where present (a folder in
    RAM: no disk in the way), else the system's temporary folder."""
    if root is None:
        root = SHARED_MEMORY if os.path.isdir(SHARED_MEMORY) else tempfile.gettempdir()
    os.makedirs(root, exist_ok=True)
    return tempfile.mkdtemp(prefix="grpo-push-", dir=root)


class DiskPlane:
    """Weights as safetensors in `folder`/VERSION, reloaded by every server (`reload_weights`)."""

    def __init__(self, router: ServerRouter, folder: str, tied_head: bool = False) -> None:
        self.router, self.folder, self.tied_head = router, folder, tied_head
        self.last: str | None = None  # the last push's folder, removed after the next one loads

    def push(self, weights: Iterable[tuple[str, Tensor]], version: str) -> int:
        """Write `weights` (checkpoint names) and have every server load them; the bytes written."""
        from safetensors.torch import save_file

        # Copies: under FSDP2 a unit's gathered tensors are freed once the source moves to the next unit.
        tensors = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in weights}
        folder = os.path.join(self.folder, version)
        os.makedirs(folder, exist_ok=True)
        save_file(tensors, os.path.join(folder, "model.safetensors"))
        body = {"method": "reload_weights", "kwargs": {"weights_path": folder}}
        self.router.each("/collective_rpc", body)
        if self.tied_head:  # a no-op on GPU; on CPU the packed head copy takes the embedding's new values
            self.router.each("/collective_rpc", {"method": "repack_tied_head"})
        if self.last is not None:
            shutil.rmtree(self.last, ignore_errors=True)
        self.last = folder
        return sum(t.numel() * t.element_size() for t in tensors.values())


class LoRAPlane:
    """The adapter as a PEFT folder in `folder`/VERSION, served under the name VERSION; the frozen base once,
    at the first push, through the disk plane (whatever the servers held before)."""

    def __init__(
        self,
        router: ServerRouter,
        folder: str,
        adapter: str,
        save_config: Callable[[str], None],
        tied_head: bool = False,
    ) -> None:
        self.router, self.folder, self.adapter, self.save_config = router, folder, adapter, save_config
        self.base = DiskPlane(router, folder, tied_head)
        self.last: str | None = None

    def push(self, weights: Iterable[tuple[str, Tensor]], version: str) -> int:
        """Load the adapter of `weights` (the PEFT model's names: the adapter's alone after the first push,
        every weight at the first) on every server as `version`; the bytes written."""
        from safetensors.torch import save_file

        adapter: dict[str, Tensor] = {}

        def base_weights() -> Iterator[tuple[str, Tensor]]:
            for name, tensor in weights:
                if "lora_" in name:
                    key = "base_model.model." + name.replace(f".{self.adapter}.", ".")
                    adapter[key] = tensor.detach().to("cpu", copy=True).contiguous()
                else:
                    yield name, tensor

        base = checkpoint_weights(base_weights())
        sent = self.base.push(base, "base") if self.last is None else 0
        for _ in base:  # after the first push only the adapter's tensors come: this collects them
            pass
        folder = os.path.join(self.folder, version)
        os.makedirs(folder, exist_ok=True)
        save_file(adapter, os.path.join(folder, "adapter_model.safetensors"))
        self.save_config(folder)
        self.router.each("/v1/load_lora_adapter", {"lora_name": version, "lora_path": folder})
        self.router.serve(version)
        if self.last is not None:
            self.router.each("/v1/unload_lora_adapter", {"lora_name": os.path.basename(self.last)})
            shutil.rmtree(self.last, ignore_errors=True)
        self.last = folder
        return sent + sum(t.numel() * t.element_size() for t in adapter.values())


def _all_within(calls: list[Callable[[], object]], timeout: float, what: str) -> list[object]:
    """Run `calls` at once, each in a thread (a collective and the HTTP calls that meet it); their results,
    or one `ServerError` when any is not done within `timeout` seconds or fails (an NCCL error too: the
    engine ends every rank on a `ServerError`). A thread stuck in a collective is left behind: the group is
    unusable and the run ends."""
    pool = ThreadPoolExecutor(max_workers=len(calls), thread_name_prefix="vllm-nccl")
    try:
        futures = [pool.submit(call) for call in calls]
        try:
            return [f.result(timeout=timeout) for f in futures]
        except FutureTimeout:
            raise ServerError(f"vLLM weight transfer: {what} not done within {timeout:g} s") from None
        except ServerError:
            raise
        except Exception as err:
            raise ServerError(f"vLLM weight transfer: {what} failed: {err}") from err
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


class NCCLPlane:
    """vLLM's NCCL weight transfer from this process (the trainer's rank 0, on `device`) to every server's
    workers, with torch alone (`nccl_weights`). The group's root listens at `host`:`port`; `group` makes
    this rank's end of it (`TrainerGroup`: torch's NCCL)."""

    def __init__(
        self,
        router: ServerRouter,
        host: str,
        port: int,
        timeout: float,
        device: torch.device,
        buffer_bytes: int = PACKED_BUFFER_BYTES,
        group: type[TrainerGroup] = TrainerGroup,
    ) -> None:
        self.router, self.host, self.port, self.timeout = router, host, port, timeout
        self.device, self.buffer_bytes, self.group_type = device, buffer_bytes, group
        self.group: TrainerGroup | None = None  # opened at the first push

    def _open(self) -> None:
        sizes = [int(s.get("/get_world_size")["world_size"]) for s in self.router.servers]
        with root_at(self.host, self.port):
            unique_id = self.group_type.unique_id()
            bodies = nccl_init_bodies(unique_id, sizes, self.buffer_bytes)
            calls: list[Callable[[], object]] = [
                _posting(s, "/init_weight_transfer_engine", b)
                for s, b in zip(self.router.servers, bodies, strict=True)
            ]

            def join() -> TrainerGroup:
                return self.group_type(unique_id, 1 + sum(sizes), self.device)

            results = _all_within([join, *calls], self.timeout, "the NCCL group's start")
        self.group = results[0]

    def push(self, weights: Iterable[tuple[str, Tensor]], version: str) -> int:
        """Broadcast `weights` (checkpoint names) to every server in packed buffers; the bytes sent."""
        if self.group is None:
            self._open()
        group = self.group
        tensors = send_order([(name, t.detach().to(self.device)) for name, t in weights])
        self.router.each("/start_weight_update")

        def broadcast() -> None:
            for buffer in packed_buffers((t for _, t in tensors), self.buffer_bytes):
                group.broadcast(buffer)
            group.synchronize()

        updates = [_posting(s, "/update_weights", update_info(tensors)) for s in self.router.servers]
        _all_within([broadcast, *updates], self.timeout, "a push's broadcast")
        self.router.each("/finish_weight_update", {"weight_version": version})
        return sum(t.numel() * t.element_size() for _, t in tensors)


def _posting(server: VLLMServer, route: str, body: dict) -> Callable[[], dict]:
    return lambda: server.post(route, body)


def stamp_version(router: ServerRouter, version: str) -> None:
    """After a push: every server's prefix cache reset, then its weight version set to `version` and read
    back; raises `ServerError` naming a server that keeps either."""
    for server in router.servers:
        if not server.post("/reset_prefix_cache").get("success", False):
            raise ServerError(
                f"vLLM server {server.url}: POST /reset_prefix_cache kept the cache after a push"
            )
        server.post("/update_weight_version", {"new_version": version})
        served = server.get("/weight_info").get("weight_version")
        if served != version:
            raise ServerError(
                f"vLLM server {server.url}: serves weight version {served!r} after pushing {version!r}"
            )
    router.forget()


def checkpoint_weights(weights: Iterator[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """A policy's weights in a checkpoint's names (a PEFT-wrapped layer's base weight as the plain
    layer's)."""
    for name, tensor in weights:
        yield name.replace(".base_layer.", "."), tensor
