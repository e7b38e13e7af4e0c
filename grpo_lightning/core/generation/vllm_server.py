"""Rollouts from stock `vllm serve` processes beside the trainer (`generation_backend: vllm_server`, TRL's
`vllm_mode: server`): N servers started apart (`python cli.py vllm-serve`, or any `vllm serve` with the flags
it adds), on other GPUs or another node, each serving the policy's checkpoint.

- **What it samples.** Each prompt's ids go to `/v1/completions` as ids, its G completions one request
  (`n=G`: the prompt prefilled once), every `SamplingSettings` field in the request
  (`vllm_client.completion_body`); each drawn id comes back with its log-prob under the distribution it was
  drawn from (the servers' `processed_logprobs`): `Rollout.sampler_logprobs`, as from the colocated engine.
  Requests run concurrently (at most `max_in_flight`), each server taking the least-loaded share, a
  multi-turn sample's later turns going to the server holding its earlier ones (`vllm_client.ServerRouter`).
  `submit` sends a batch and returns at once; its `result()` waits: requests can run while the trainer works
  (a push waits for them first: each batch is sampled under one weight version).
- **Weights** (`refresh`, before the first rollout after they changed): pushed over the data plane of
  `weight_plane` (`vllm_push`: `disk`, `lora`, `nccl`), then every server's prefix cache reset and its weight
  version set to `policy-K` and read back. Under DDP or FSDP2 every rank reads the weights in lock-step (a
  collective under FSDP2), rank 0 alone pushes, and the others wait at a barrier until it has.
- **Never a hang, never a wrong model.** Every HTTP call times out (`request_timeout`), and a stop request
  (SIGTERM) hangs up the requests in flight (the servers abort them); a server that stops
  answering ends the run with one `ServerError` naming the server and the call. Before any weights load
  (`vllm_server_options.check_servers`, the registry entry's check, from the policy's config and the LoRA
  rank it trains), servers that do not answer within `timeout`, or serve another architecture or
  vocabulary, a `max_model_len` below prompt + completion, or no LoRA (or too small a rank) for a LoRA
  policy, are refused in one line each; an engine built without that check (a script of its own) makes it
  at its first `refresh`.

No Lightning and no vLLM import here: the trainer's side of every plane is torch and HTTP alone.
"""

from __future__ import annotations

import shutil
import time
import uuid
import weakref
from collections.abc import Iterable
from concurrent.futures import Future, wait
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from transformers import PreTrainedModel

from grpo_lightning.core.generation.engines import (
    Backend,
    EngineMemory,
    EngineRequest,
    MemoryRequest,
    PolicyOutline,
    RolloutEngine,
    rollout_speed,
)
from grpo_lightning.core.generation.inference_copy import WeightSource, active_lora, hf_model, own_weights
from grpo_lightning.core.generation.sampling import SamplingOptions, SamplingSettings
from grpo_lightning.core.generation.vllm_client import (
    ServedModel,
    ServerError,
    ServerRouter,
    VLLMServer,
)
from grpo_lightning.core.generation.vllm_engine import _adapter_weights, vllm_unsupported
from grpo_lightning.core.generation.vllm_push import (
    DiskPlane,
    LoRAPlane,
    NCCLPlane,
    checkpoint_weights,
    push_folder,
    stamp_version,
)
from grpo_lightning.core.generation.vllm_server_options import VLLMServerOptions, check_servers
from grpo_lightning.core.options import option_error
from grpo_lightning.core.stop_requests import settle
from grpo_lightning.core.types import Rollout


@dataclass
class PendingRollout:
    """A batch's requests in flight (`VLLMServerEngine.submit`); `result()` waits for them and builds the
    `Rollout`."""

    engine: VLLMServerEngine
    futures: list[Future]
    prompt_ids: Tensor  # [N, P] left-padded
    prompt_mask: Tensor  # [N, P]
    num_generations: int
    settings: SamplingSettings
    do_sample: bool
    start: float

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def result(self) -> Rollout:
        G, s = self.num_generations, self.settings
        try:
            rows = [row for f in self.futures for row in f.result()]
        except BaseException:  # a stop request (SIGTERM), a failed request: nothing left to decode for
            self.engine.router.hang_up()
            raise
        if not self.do_sample:  # one greedy completion per prompt, repeated to the group
            rows = [row for row in rows for _ in range(G)]
        rollout = rollout_of_rows(rows, self.prompt_ids, self.prompt_mask, G, s, self.do_sample)
        seconds = time.perf_counter() - self.start
        self.engine.last_speed = rollout_speed(rollout, rollout.completion_ids.size(1), seconds)
        return rollout


def rollout_of_rows(
    rows: list[tuple[list[int], list[float]]],
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    G: int,
    settings: SamplingSettings,
    do_sample: bool,
) -> Rollout:
    """The `Rollout` of N*G completions (ids and each one's log-prob) of `prompt_ids` `[N, P]`: right-padded
    with the pad id, log-probs 0 after the end (None greedy), a row that ended without a stop id truncated."""
    T = max(1, max(len(ids) for ids, _ in rows))
    ids = torch.full((len(rows), T), settings.pad_token_id, dtype=torch.long)  # [N*G, T]
    mask = torch.zeros((len(rows), T), dtype=torch.long)  # [N*G, T]
    logprobs = torch.zeros((len(rows), T), dtype=torch.float32)  # [N*G, T]
    eos = set(settings.eos_token_ids)
    truncated = torch.ones(len(rows), dtype=torch.bool)  # [N*G]
    for i, (tokens, token_logprobs) in enumerate(rows):
        ids[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        mask[i, : len(tokens)] = 1
        truncated[i] = not (tokens and tokens[-1] in eos)
        logprobs[i, : len(tokens)] = torch.tensor(token_logprobs, dtype=torch.float32)
    device = prompt_ids.device
    return Rollout(
        prompt_ids.repeat_interleave(G, dim=0),  # [N*G, P]
        prompt_mask.repeat_interleave(G, dim=0),
        ids.to(device),
        mask.to(device),
        truncated.to(device),
        logprobs.to(device) if do_sample else None,
    )


class VLLMServerEngine(RolloutEngine):
    """Rollouts from running vLLM servers, pushed the policy's weights before the first rollout after they
    changed (see the module docstring).

    Args:
        settings: what every sampled token obeys (a call may pass its own).
        options: the engine's options (`VLLMServerOptions`, each documented there).
        max_len: the longest prompt + completion a request may hold (the pre-flight checks the servers'
            `max_model_len`).
        weights: where the pushed weights come from (`WeightSource`; default the policy's own tensors).
        served: what each server serves, as `check_servers` found it before the weights loaded; None: the
            first `refresh` checks the servers against the loaded policy.
    """

    def __init__(
        self,
        settings: SamplingSettings,
        options: VLLMServerOptions,
        *,
        max_len: int,
        weights: WeightSource = own_weights,
        served: list[ServedModel] | None = None,
    ) -> None:
        self.settings, self.options, self.max_len, self.weights = settings, options, max_len, weights
        self.served = served
        self.router: ServerRouter | None = None  # opened by the first `refresh`
        self.plane = None
        self.stale = True
        self.run_id = uuid.uuid4().hex[:8]
        self.refreshes = 0
        self.push_seconds = 0.0
        self.push_bytes = 0
        self.last_speed: dict[str, float] = {}
        self.folder: str | None = None
        self.in_flight: list[Future] = []  # requests submitted and perhaps not yet answered

    @property
    def reads_live_weights(self) -> bool:
        """Never: the servers hold their own copy, which `refresh` fills."""
        return False

    def weights_changed(self) -> None:
        """The policy's weights changed: they are pushed before the next rollout."""
        self.stale = True

    @staticmethod
    def _pusher() -> bool:
        """Whether this process talks to the servers: rank 0, or a single process."""
        return not dist.is_initialized() or dist.get_rank() == 0

    def _start(self, model: PreTrainedModel, device: torch.device) -> None:
        adapter = active_lora(model)
        servers = self.served
        if servers is None:  # not checked before the weights loaded
            lora_rank = adapter[1].r if adapter is not None else None
            servers = check_servers(self.options, hf_model(model).config, self.max_len, lora_rank)
        timeout, urls = self.options.request_timeout, self.options.urls
        clients = [VLLMServer(url, timeout, m.name) for url, m in zip(urls, servers, strict=True)]
        self.router = ServerRouter(clients, self.options.max_in_flight)
        plane = self.options.weight_plane
        if plane == "auto":
            plane = "lora" if adapter is not None else "nccl" if device.type == "cuda" else "disk"
        if (plane == "lora") != (adapter is not None):
            why = "a LoRA policy pushes its adapter alone" if adapter else "the policy has no LoRA adapter"
            raise option_error(self.options, "weight_plane", plane, why)
        if plane == "nccl" and device.type != "cuda":
            raise option_error(self.options, "weight_plane", plane, "NCCL needs the trainer on CUDA")
        dummy = [url for url, m in zip(urls, servers, strict=True) if m.load_format == "dummy"]
        if plane in ("disk", "lora") and dummy:
            raise ServerError(
                f"vLLM server {dummy[0]} was started with --load-format dummy: the {plane} plane's reload "
                "reads files in the server's load format, which dummy cannot (restart it without it)"
            )
        if not self._pusher():
            return
        if plane in ("disk", "lora"):
            self.folder = push_folder(self.options.weights_dir)
            # Shared memory is RAM: the folder goes with the engine, or at exit, if `close` is never called.
            self._remove_folder = weakref.finalize(self, shutil.rmtree, self.folder, True)
        tied = bool(hf_model(model).config.get_text_config(decoder=True).tie_word_embeddings)
        if plane == "disk":
            self.plane = DiskPlane(self.router, self.folder, tied)
        elif plane == "lora":
            config = model.peft_config[adapter[0]]
            self.plane = LoRAPlane(self.router, self.folder, adapter[0], config.save_pretrained, tied)
        else:
            host = self.options.trainer_host or _trainer_host(self.options.urls)
            timeout = self.options.request_timeout
            self.plane = NCCLPlane(self.router, host, self.options.group_port, timeout, device)

    def refresh(self, model: PreTrainedModel, device: torch.device) -> None:
        """Check the servers on the first call, then push the policy's weights if they changed since the last
        push (every rank at the same point: rank 0 pushes, the others read the weights with it and wait)."""
        if self.router is None:
            self._start(model, torch.device(device))
        if not self.stale:
            return
        # A push never lands in the middle of a batch sampled ahead (`core.async_group_source`): every rank's
        # requests in flight are answered before rank 0 pushes.
        wait(self.in_flight)
        self.in_flight = []
        settle()  # the push is a collective: on several ranks, a step's rollout is no longer left alone
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        version = f"policy-{self.run_id}-{self.refreshes + 1}"  # unique on servers that outlive runs
        failure: Exception | None = None
        with torch.no_grad():
            weights = self._weights(model)
            if self.plane is None:
                for _ in weights:  # another rank: in step with rank 0's gathers
                    pass
            else:
                try:  # every plane reads all the weights before its first call to a server
                    self.push_bytes = self.plane.push(weights, version)
                    stamp_version(self.router, version)
                except Exception as err:  # any error: raised after the other ranks hear of it below
                    failure = err
        if dist.is_initialized():
            # In place of a barrier: the other ranks sample only once rank 0's push is in, and end with it
            # when it failed, rather than wait for it at their next collective.
            failed = torch.tensor([float(failure is not None)], device=device)
            dist.all_reduce(failed)
            if failed.item() and failure is None:
                raise ServerError(
                    "rank 0's push of the weights to the vLLM servers failed (its error says why)"
                )
        if failure is not None:
            raise failure
        self.push_seconds = time.perf_counter() - start
        self.refreshes += 1
        self.stale = False

    def _weights(self, model: PreTrainedModel) -> Iterable[tuple[str, Tensor]]:
        """What this push reads (the same on every rank: gathers under FSDP2): a LoRA policy's adapter alone
        once its base is in, else every weight, in checkpoint names except a LoRA policy's (its plane splits
        them)."""
        if active_lora(model) is None:
            return checkpoint_weights(iter(self.weights(model)))
        return _adapter_weights(model) if self.refreshes else self.weights(model)

    def submit(
        self,
        model: PreTrainedModel,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        *,
        num_generations: int,
        do_sample: bool = True,
        settings: SamplingSettings | None = None,
    ) -> PendingRollout:
        """Send the requests of `num_generations` completions per prompt of `prompt_ids` `[N, P]`
        (left-padded) and return at once; the result's `result()` waits for them (`generate`'s rollout)."""
        self.refresh(model, prompt_ids.device)
        pending = self.send(prompt_ids, prompt_mask, num_generations, do_sample, settings)
        self.hold(pending.futures)
        return pending

    def send(
        self,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        num_generations: int,
        do_sample: bool = True,
        settings: SamplingSettings | None = None,
    ) -> PendingRollout:
        """`submit` under the weights the servers hold, never pushing."""
        s = settings or self.settings
        kept = zip(prompt_ids, prompt_mask.bool(), strict=True)  # [P] each: the prompt without its padding
        prompts = [row[keep].tolist() for row, keep in kept]
        start = time.perf_counter()
        futures = [self.router.submit(p, s, num_generations, do_sample) for p in prompts]
        return PendingRollout(self, futures, prompt_ids, prompt_mask, num_generations, s, do_sample, start)

    def hold(self, futures: list[Future]) -> None:
        """The next push waits for `futures` (a batch's requests, or a whole multi-turn rollout sampled ahead
        on a `PinnedServerEngine`). Called by the trainer's thread alone, as `refresh` is."""
        self.in_flight = [f for f in self.in_flight if not f.done()] + list(futures)

    def generate(
        self,
        model: PreTrainedModel,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        *,
        num_generations: int,
        do_sample: bool = True,
        settings: SamplingSettings | None = None,
    ) -> Rollout:
        """`num_generations` completions per prompt of `prompt_ids` `[N, P]` (left-padded): N*G rows."""
        pending = self.submit(
            model,
            prompt_ids,
            prompt_mask,
            num_generations=num_generations,
            do_sample=do_sample,
            settings=settings,
        )
        return pending.result()

    def metrics(self) -> dict[str, float]:
        """The last call's speed, the pushes so far, the last one's seconds and bytes."""
        pushes = {"weight_pushes": float(self.refreshes), "push_seconds": self.push_seconds}
        return {**self.last_speed, **pushes, "push_bytes": float(self.push_bytes)}

    def close(self) -> None:
        """Stop the request threads and delete the pushed files; the servers keep running."""
        if self.router is not None:
            self.router.close()
        if self.folder is not None:
            self._remove_folder()
            self.folder = None


class PinnedServerEngine:
    """`engine` held at the weight version its servers serve now, for a rollout sampled ahead on another
    thread (a multi-turn rollout, turn after turn): `generate` sends each turn without pushing, so every turn
    of the batch is sampled under that version. The trainer's thread `hold`s the rollout, so that no push
    lands before it ends; one that did would be refused here rather than mix two versions in a batch."""

    def __init__(self, engine: VLLMServerEngine) -> None:
        self.engine, self.settings, self.version = engine, engine.settings, engine.refreshes

    def generate(
        self, model: PreTrainedModel, prompt_ids: Tensor, prompt_mask: Tensor, **kwargs: object
    ) -> Rollout:
        """`VLLMServerEngine.generate` under the pinned version."""
        if self.engine.refreshes != self.version:
            raise RuntimeError("the weights were pushed in the middle of a batch sampled ahead")
        return self.engine.send(prompt_ids, prompt_mask, **kwargs).result()


def _trainer_host(urls: Iterable[str]) -> str:
    """The trainer's address as servers at `urls` reach it: loopback when they all run here."""
    import socket
    from urllib.parse import urlparse

    local = {"127.0.0.1", "localhost", "::1"}
    return "127.0.0.1" if all(urlparse(u).hostname in local for u in urls) else socket.getfqdn()


# -------------------------------------------------------------------------------------- registry entry
def _max_len(sampling: SamplingOptions) -> int:
    """The longest prompt + completion a request holds."""
    return (sampling.max_prompt_length or 0) + sampling.max_completion_length


def _vllm_server(request: EngineRequest, options: VLLMServerOptions) -> VLLMServerEngine:
    max_len = _max_len(request.sampling)
    served = request.checked
    return VLLMServerEngine(
        request.settings, options, max_len=max_len, weights=request.weights, served=served
    )


def _check_before_weights(outline: PolicyOutline, options: VLLMServerOptions) -> list[ServedModel]:
    return check_servers(options, outline.config, _max_len(outline.sampling), outline.lora_rank)


def _server_memory(engine: VLLMServerEngine, policy: PreTrainedModel, rollout: MemoryRequest) -> EngineMemory:
    # The servers hold the weights and KV cache on their own devices: nothing on the trainer's.
    return EngineMemory(0, 0, 0, 0)


VLLM_SERVER_BACKEND = Backend(_vllm_server, vllm_unsupported, _server_memory, check=_check_before_weights)
