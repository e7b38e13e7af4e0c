"""The rollout engines by name (`BACKENDS`: each engine's `Backend` entry, declared in the engine's own file),
the options that choose one and hold each engine's own (`EngineOptions`, `GRPOConfig.engine`), and the
choice made concrete (`resolve_backend`: what "auto" picks, and eager decoding for a model an engine cannot
serve). The trainer builds through `build_engine` and the pre-flight asks the entries for their memory,
with no engine named anywhere else. No Lightning here.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, fields
from typing import Annotated, Literal

import torch
from transformers import PreTrainedModel

from grpo_lightning.core.generation.engines import EAGER_BACKEND, EngineRequest, PolicyOutline, RolloutEngine
from grpo_lightning.core.generation.static_engine import STATIC_BACKEND
from grpo_lightning.core.generation.vllm_engine import VLLM_BACKEND, VLLMOptions
from grpo_lightning.core.generation.vllm_server import VLLM_SERVER_BACKEND
from grpo_lightning.core.generation.vllm_server_options import VLLMServerOptions
from grpo_lightning.core.options import Alias, Choices, check_fields, option_error, warn_inert

BACKENDS = Choices(
    "backend",
    {
        "eager": EAGER_BACKEND,
        "static": STATIC_BACKEND,
        "vllm": VLLM_BACKEND,
        "vllm_server": VLLM_SERVER_BACKEND,
    },
)
AUTO = "auto"  # the engine picked for the device (`requested_backend`)
# What "auto" takes on a device type: the first of these that imports; on any other device, and when none
# does, eager decoding (on CPU compiling decodes no faster: BENCHMARKS.md, "Decoding").
AUTO_PICKS = {"cuda": ("vllm", "static")}
GenerationBackend = Literal[(AUTO, *BACKENDS)]
VLLM_MODES = {"colocate": "vllm", "server": "vllm_server"}  # TRL's `vllm_mode`: the engine each names


@dataclass(frozen=True)
class EngineOptions:
    """Which engine decodes the rollouts, and the options of each engine that has its own, in a field of the
    engine's name (`GRPOConfig.engine`)."""

    backend: Annotated[GenerationBackend, Alias("generation_backend")] = AUTO
    """How rollouts are decoded (`BACKENDS`, one entry per engine). "eager": `generate` on the training policy
    with a dynamic KV cache (`grpo_lightning.core.generation.engines.EagerEngine`, the reference path).
    "static": `generate` with a static KV cache on an inference copy of the policy that computes as the loss's
    scorer does (linear weights in the compute dtype, LoRA adapters unmerged, under the trainer's autocast),
    refreshed in place once before each rollout after the weights changed, its decoding step compiled once
    with CUDA graphs on CUDA and run uncompiled on CPU (`grpo_lightning.core.generation.static_engine`); it
    costs the copy and one KV cache (both in the pre-flight's memory estimate) and a compile warm-up per batch
    shape. Both stop decoding finished rows once at most half of a batch of more than 8 rows is live. "vllm":
    a colocated vLLM engine on every rank, pushed the policy's weights before each rollout after they changed
    (`grpo_lightning.core.generation.vllm_engine`; its options in `engine.vllm`). "vllm_server": running `vllm
    serve` processes (`python cli.py vllm-serve`), pushed the policy's weights after each update
    (`grpo_lightning.core.generation.vllm_server`; its options in `engine.vllm_server`). "auto" (the default):
    "vllm" on CUDA where vLLM imports, else "static" on CUDA; "eager" elsewhere, since on CPU compiling
    decodes no faster and the uncompiled copy is within a few percent of eager (BENCHMARKS.md, "Decoding"). A
    model the static path cannot serve (sliding-window or linear-attention layers, a quantized base, DoRA)
    falls back to "eager" with one warning; a model with a sliding window (`sliding_window`, or `layer_types`:
    `model_abilities.not_full_attention`) gets one warning for the three options it turns off.
    """
    vllm_mode: Annotated[Literal["colocate", "server"] | None, Alias("vllm_mode")] = None
    """TRL's choice between its two vLLM engines: "colocate" is `backend: vllm`, "server" `backend:
    vllm_server`; None: `backend` alone decides. Given with a `backend` other than "auto" or the one it names,
    the run is refused."""
    vllm: VLLMOptions = field(default_factory=VLLMOptions)
    """The vLLM engine's options (`core.generation.vllm_engine.VLLMOptions`)."""
    vllm_server: VLLMServerOptions = field(default_factory=VLLMServerOptions)
    """The server engine's options (`core.generation.vllm_server_options.VLLMServerOptions`)."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.vllm_mode is not None:
            named = VLLM_MODES[self.vllm_mode]
            if self.backend not in (AUTO, named):
                raise option_error(
                    self, "vllm_mode", self.vllm_mode, f"it is backend {named!r}, not {self.backend!r}"
                )
            object.__setattr__(self, "backend", named)
        for engine in fields(self):
            own = getattr(self, engine.name)
            if engine.name not in ("backend", "vllm_mode") and self.backend not in (AUTO, engine.name):
                for option in fields(own):
                    warn_inert(own, option.name, f"engine.backend: {engine.name} (or {AUTO})")

    def of(self, backend: str) -> object | None:
        """The options of engine `backend`, None for an engine without its own."""
        return getattr(self, backend, None)


def check_engine_importable(options: EngineOptions) -> None:
    """Refuse an engine asked for by name that does not import here (`Backend.unavailable`), in one line
    saying what to install. Not when the options are built (a checkpoint of a vLLM run loads and exports on
    a machine without vLLM): when a run that samples sets up, before any weights load
    (`training.run_checks.FitChecks`)."""
    if options.backend != AUTO and (problem := BACKENDS[options.backend].unavailable()) is not None:
        raise option_error(options, "backend", options.backend, problem)


def check_engine(options: EngineOptions, outline: PolicyOutline, device: torch.device) -> object | None:
    """The checks before any weights load of the engine that `options` ask for on `device` (`Backend.check`:
    the server engine's servers, which must serve the policy), raising in one line on what they refuse; what
    they found, for the engine's build (`EngineRequest.checked`), None for an engine without checks."""
    backend = requested_backend(options.backend, device)
    check = BACKENDS[backend].check
    return None if check is None else check(outline, options.of(backend))


def requested_backend(requested: str, device: torch.device) -> str:
    """`engine.backend` as asked for on `device`: "auto" is the first of `AUTO_PICKS` for the device's type
    that imports, else "eager"."""
    if requested != AUTO:
        return requested
    available = (name for name in AUTO_PICKS.get(device.type, ()) if BACKENDS[name].unavailable() is None)
    return next(available, "eager")


def resolve_backend(requested: str, model: PreTrainedModel, device: torch.device) -> str:
    """`engine.backend` made concrete (`requested_backend`); a model the chosen engine cannot serve gets
    "eager", with one warning that says why. An engine asked for that does not import here raises, saying
    what is missing."""
    backend = requested_backend(requested, device)
    if (problem := BACKENDS[backend].unavailable()) is not None:
        raise RuntimeError(f"grpo.engine.backend={backend!r}: {problem}")
    reason = BACKENDS[backend].unsupported(model)
    if reason is not None:
        warnings.warn(
            f"grpo.engine.backend={requested!r}: {reason}; rollouts use eager decoding", stacklevel=3
        )
        return "eager"
    return backend


def build_engine(request: EngineRequest, options: EngineOptions, requested: str) -> tuple[str, RolloutEngine]:
    """The engine of the backend `requested` (`resolve_backend`) for the request's policy, given its own
    `options`, and the backend's name (its `BACKENDS` entry holds its memory estimate)."""
    backend = resolve_backend(requested, request.policy, request.device)
    return backend, BACKENDS[backend].build(request, options.of(backend))
