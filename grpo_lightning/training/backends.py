"""The rollout engines by name (`GRPOConfig.generation_backend`): one `Backend` per engine in `BACKENDS`, each
with how it is built from the run's options, which models it cannot serve, and what it holds in memory
for the pre-flight's estimate; `resolve_backend` makes "auto" concrete. The trainer's side
(`training.rollouts`) builds through it and the pre-flight asks it, with no engine named anywhere else.
No Lightning here.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.generation.engines import EagerEngine, RolloutEngine
from grpo_lightning.core.generation.inference_copy import WeightSource, copy_precision, inference_copy_nbytes
from grpo_lightning.core.generation.sampling import SamplingSettings
from grpo_lightning.core.generation.static_engine import StaticEngine, static_unsupported
from grpo_lightning.core.generation.vllm_engine import (
    CPU_KV_CACHE_GB,
    VLLMEngine,
    VLLMSettings,
    vllm_unavailable,
    vllm_unsupported,
    vllm_weights_nbytes,
)


@dataclass(frozen=True)
class EngineRequest:
    """What building an engine takes.

    Args:
        cfg: the run's options (the engine's section among them).
        settings: what every sampled token obeys.
        policy: the policy, loaded (with LoRA, sharded).
        device: where its prompts go.
        precision: the trainer's precision flag (None without a trainer: the policy as it is).
        weights: the policy's full weights for an engine with a copy of its own (unit by unit under FSDP2).
    """

    cfg: GRPOConfig
    settings: SamplingSettings
    policy: PreTrainedModel
    device: torch.device
    precision: str | None
    weights: WeightSource


@dataclass(frozen=True)
class EngineMemory:
    """What a rollout of `sequences` rows of `tokens` tokens costs an engine: its KV cache's shape, the copy
    of the weights it holds (None: it reads the policy's) and its KV pool when of a fixed size of its own
    (None: `sequences` x `tokens`)."""

    sequences: int
    tokens: int
    copy_bytes: int | None = None
    kv_pool_bytes: int | None = None


@dataclass(frozen=True)
class MemoryRequest:
    """The rollout the pre-flight estimates: `sequences` rows of `prompt_tokens` prompt and `new_tokens`
    completion tokens, the policy `sharded` (FSDP2), under Lightning's `precision`."""

    sequences: int
    prompt_tokens: int
    new_tokens: int
    sharded: bool
    precision: str


@dataclass(frozen=True)
class Backend:
    """One engine: `build` it, why it cannot serve a model (`unsupported`: None when it can; the run then
    falls back to eager decoding with a warning) and its `memory` for a rollout."""

    build: Callable[[EngineRequest], RolloutEngine]
    unsupported: Callable[[PreTrainedModel], str | None]
    memory: Callable[[RolloutEngine, PreTrainedModel, MemoryRequest], EngineMemory]


def _eager(request: EngineRequest) -> EagerEngine:
    return EagerEngine(request.settings)


def _eager_memory(engine: RolloutEngine, policy: PreTrainedModel, rollout: MemoryRequest) -> EngineMemory:
    return EngineMemory(rollout.sequences, rollout.prompt_tokens + rollout.new_tokens)


def _static(request: EngineRequest) -> StaticEngine:
    return StaticEngine(
        request.settings,
        precision=copy_precision(request.precision),  # the copy computes as the scorer does
        compile=request.device.type == "cuda",
        max_prompt_tokens=request.cfg.max_prompt_length,
        weights=request.weights,
    )


def _static_memory(engine: StaticEngine, policy: PreTrainedModel, rollout: MemoryRequest) -> EngineMemory:
    width = -(-rollout.prompt_tokens // engine.prompt_bucket) * engine.prompt_bucket
    sequences, tokens = engine.cache_shape(rollout.sequences, width, rollout.new_tokens)
    sharded_mixed = rollout.sharded and str(rollout.precision).endswith("-mixed")  # gathered in that dtype
    gathered = engine.precision.linear_dtype if sharded_mixed else None
    return EngineMemory(sequences, tokens, inference_copy_nbytes(policy, engine.precision, gathered))


def compute_dtype(precision: str | None) -> torch.dtype | None:
    """The dtype Lightning's `precision` flag computes in (16-bit flags), None for full precision."""
    return copy_precision(precision).linear_dtype


def _vllm(request: EngineRequest) -> VLLMEngine:
    cfg = request.cfg
    length = cfg.engine.vllm.max_model_len
    if length is None:
        positions = request.policy.config.max_position_embeddings
        length = (
            cfg.sampling.max_prompt_length + cfg.sampling.max_completion_length
            if cfg.sampling.max_prompt_length
            else positions
        )
    options = VLLMSettings(
        max_model_len=length,
        kv_cache_gb=cfg.engine.vllm.kv_cache_gb,
        gpu_memory_utilization=cfg.engine.vllm.gpu_memory_utilization,
        sleep=cfg.engine.vllm.sleep,
        enforce_eager=cfg.engine.vllm.enforce_eager,
        seed=int(torch.randint(2**31 - 1, ())),  # from the trainer's seeded stream: a seed per run
    )
    return VLLMEngine(
        request.settings, options, dtype=compute_dtype(request.precision), weights=request.weights
    )


def _vllm_memory(engine: VLLMEngine, policy: PreTrainedModel, rollout: MemoryRequest) -> EngineMemory:
    weights = vllm_weights_nbytes(policy, engine.dtype)
    kv_gb = engine.options.kv_cache_gb
    on_gpu = torch.cuda.is_available()
    if kv_gb is None and on_gpu:  # vLLM takes its share of the GPU, its weights included
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        pool = int(engine.options.gpu_memory_utilization * total) - weights
    else:
        pool = int((kv_gb if kv_gb is not None else CPU_KV_CACHE_GB) * 1e9)
    tokens = rollout.prompt_tokens + rollout.new_tokens
    return EngineMemory(rollout.sequences, tokens, weights, pool)


BACKENDS: dict[str, Backend] = {
    "eager": Backend(_eager, lambda model: None, _eager_memory),
    "static": Backend(_static, static_unsupported, _static_memory),
    "vllm": Backend(_vllm, vllm_unsupported, _vllm_memory),
}


def requested_backend(requested: str, device: torch.device) -> str:
    """`GRPOConfig.generation_backend` as asked for on `device`: "auto" is "vllm" on CUDA where vLLM imports,
    else "static" on CUDA, and "eager" elsewhere."""
    if requested != "auto":
        return requested
    if device.type != "cuda":
        return "eager"
    return "vllm" if vllm_unavailable() is None else "static"


def resolve_backend(requested: str, model: PreTrainedModel, device: torch.device) -> str:
    """`GRPOConfig.generation_backend` made concrete (`requested_backend`); a model the chosen engine cannot
    serve gets "eager", with one warning that says why. "vllm" asked for where vLLM does not import raises,
    saying what is missing."""
    backend = requested_backend(requested, device)
    if backend == "vllm" and (problem := vllm_unavailable()) is not None:
        raise RuntimeError(f"grpo.engine.backend='vllm': {problem}")
    reason = BACKENDS[backend].unsupported(model)
    if reason is not None:
        warnings.warn(
            f"grpo.engine.backend={requested!r}: {reason}; rollouts use eager decoding", stacklevel=3
        )
        return "eager"
    return backend


def build_engine(request: EngineRequest, requested: str) -> tuple[str, RolloutEngine]:
    """The engine of the backend `requested` (`resolve_backend`) for the request's policy, and the backend's
    name (its `BACKENDS` entry holds its memory estimate)."""
    backend = resolve_backend(requested, request.policy, request.device)
    return backend, BACKENDS[backend].build(request)
