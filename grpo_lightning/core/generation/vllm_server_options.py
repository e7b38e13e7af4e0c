"""The server engine's options and the check of the servers before any weights load
(`generation_backend: vllm_server`, TRL's `vllm_mode: server`).

`VLLMServerOptions` is `GRPOConfig.engine.vllm_server`: where the servers are, how long to wait for them,
how the weights reach them. `check_servers` refuses, in one line each, a server that does not answer or
serves another model than the policy (architecture, vocabulary, context, LoRA rank, a CPU server's tied
head): the engine (`vllm_server.VLLMServerEngine`) samples from servers that passed it.

No Lightning and no vLLM import here: HTTP alone (`vllm_client`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from transformers import PretrainedConfig

from grpo_lightning.core.generation.vllm_client import (
    ServedModel,
    ServerError,
    VLLMServer,
    served_model,
    wait_until_up,
)
from grpo_lightning.core.options import Alias, PositiveFloat, PositiveInt, Range, check_fields

WeightPlane = Literal["auto", "nccl", "disk", "lora"]
WORKER_EXTENSION = "grpo_lightning.io.vllm_worker.PushExtension"  # `cli.py vllm-serve` starts servers with it


@dataclass(frozen=True)
class VLLMServerOptions:
    """The server engine's options (`GRPOConfig.engine.vllm_server`), read with `engine.backend: vllm_server`
    (or TRL's `vllm_mode: server`)."""

    base_url: Annotated[str | list[str] | None, Alias("vllm_server_base_url")] = None
    """The servers' URLs (`http://host:port`), one or a list (several servers share the requests); None: the
    one server at `vllm_server_host`:`vllm_server_port`. TRL: `vllm_server_base_url` (one URL)."""
    host: Annotated[str, Alias("vllm_server_host")] = "127.0.0.1"
    """The server's host when `vllm_server_base_url` is None. TRL: `vllm_server_host`."""
    port: Annotated[int, Range("> 0, < 65536"), Alias("vllm_server_port")] = 8000
    """The server's port when `vllm_server_base_url` is None. TRL: `vllm_server_port`."""
    timeout: Annotated[PositiveFloat, Alias("vllm_server_timeout")] = 240.0
    """Seconds to wait for every server to answer at the start (a server still loading its model); then the
    run is refused naming those that did not. TRL: `vllm_server_timeout`."""
    request_timeout: Annotated[PositiveFloat, Alias("vllm_server_request_timeout")] = 600.0
    """Seconds any one call to a server may go without an answer (a rollout's request, a push's step) before
    the run ends with one error naming the server and the call. TRL: none."""
    group_port: Annotated[int, Range("> 0, < 65536"), Alias("vllm_group_port")] = 51216
    """The port of the NCCL group's rendezvous on the trainer's rank 0 (`weight_plane: nccl`): NCCL's root,
    which the servers' workers dial first, at the trainer's address as they see it
    (`vllm_server_trainer_host`). TRL: `vllm_group_port`."""
    trainer_host: Annotated[str | None, Alias("vllm_server_trainer_host")] = None
    """The trainer's rank-0 address as the servers reach it (`weight_plane: nccl`), an address of the
    trainer's machine (the rendezvous listens on it); None: the servers' own host when it is this machine
    (`127.0.0.1`), else this machine's host name. TRL: none."""
    weight_plane: Annotated[WeightPlane, Alias("vllm_server_weight_plane")] = "auto"
    """How the weights reach the servers after each update (`vllm_push`): "nccl" (vLLM's NCCL weight
    transfer from the trainer's rank 0; GPUs only), "disk" (safetensors in `vllm_server_weights_dir`, loaded
    by `reload_weights`: the servers must read that folder), "lora" (the adapter alone, loaded under a new
    name per push; a LoRA policy, servers started with `--enable-lora`). "auto": "lora" for a LoRA policy,
    else "nccl" when the trainer is on CUDA, else "disk". TRL: none (NCCL always)."""
    weights_dir: Annotated[str | None, Alias("vllm_server_weights_dir")] = None
    """Where the disk and LoRA planes write each push, a folder the servers read; None: shared memory
    (`/dev/shm`) where present, else the temporary folder: right for servers on the trainer's machine. TRL:
    none."""
    max_in_flight: Annotated[PositiveInt, Alias("vllm_server_max_in_flight")] = 64
    """Requests (one per prompt, its G completions) in flight at once over all servers; the rest queue in the
    trainer. TRL: none."""

    def __post_init__(self) -> None:
        check_fields(self)

    @property
    def urls(self) -> list[str]:
        """Every server's base URL."""
        if self.base_url is None:
            return [f"http://{self.host}:{self.port}"]
        return [self.base_url] if isinstance(self.base_url, str) else list(self.base_url)


def check_servers(
    options: VLLMServerOptions, config: PretrainedConfig, max_len: int, lora_rank: int | None
) -> list[ServedModel]:
    """Before any weights load: wait up to `options.timeout` for every server, then refuse, in one line each,
    one that serves another architecture or vocabulary than `config`'s, takes fewer than `max_len` tokens per
    request, or (a LoRA policy of rank `lora_rank`) serves no LoRA or a smaller rank. What each serves."""
    servers = [VLLMServer(url, options.request_timeout) for url in options.urls]
    wait_until_up(servers, options.timeout)
    architecture = (config.architectures or ["?"])[0]
    vocab = config.get_text_config(decoder=True).vocab_size
    served = []
    for server in servers:
        model = served_model(server)
        where = f"vLLM server {server.url} serves {model.name}"
        if model.architecture != architecture:
            raise ServerError(f"{where}, a {model.architecture}: the policy is a {architecture}")
        if model.vocab_size != vocab:
            raise ServerError(f"{where} with {model.vocab_size} tokens: the policy's vocabulary has {vocab}")
        if model.max_model_len < max_len:
            raise ServerError(
                f"{where} with max_model_len={model.max_model_len}: prompt + completion need {max_len} "
                "(restart it with --max-model-len)"
            )
        if lora_rank is not None and (model.max_lora_rank or 0) < lora_rank:
            got = (
                "without LoRA"
                if model.max_lora_rank is None
                else f"with --max-lora-rank {model.max_lora_rank}"
            )
            raise ServerError(
                f"{where} {got}: the policy's adapter has rank {lora_rank} (start it with `python cli.py "
                f"vllm-serve --lora-rank {lora_rank}`)"
            )
        tied = config.get_text_config(decoder=True).tie_word_embeddings
        if tied and model.device == "cpu" and model.worker_extension != WORKER_EXTENSION:
            raise ServerError(
                f"{where} on CPU without --worker-extension-cls {WORKER_EXTENSION}: the policy's LM "
                "head is tied and vLLM's CPU build keeps a packed copy of it that a push must repack (start "
                "the server with `python cli.py vllm-serve`)"
            )
        served.append(model)
    return served
