"""The rollout engines by name, and the options that choose one (`GRPOConfig.engine`)."""

from dataclasses import dataclass, field, fields
from typing import Annotated, Literal

from grpo_lightning.core.generation.vllm_engine import VLLMOptions, vllm_unavailable
from grpo_lightning.core.options import Alias, check_fields, option_error, warn_inert


@dataclass(frozen=True)
class EngineOptions:
    """Which engine decodes the rollouts, and each engine's own options (`GRPOConfig.engine`)."""

    backend: Annotated[Literal["auto", "eager", "static", "vllm"], Alias("generation_backend")] = "auto"
    """How rollouts are decoded (`grpo_lightning.training.backends`, one entry per engine). "eager":
    `generate` on the training policy with a dynamic KV cache
    (`grpo_lightning.core.generation.engines.EagerEngine`, the reference path). "static": `generate` with a
    static KV cache on an inference copy of the policy that computes as the loss's scorer does (linear
    weights in the compute dtype, LoRA adapters unmerged, under the trainer's autocast), refreshed in place
    once before each rollout after the weights changed, its decoding step compiled once with CUDA graphs on
    CUDA and run uncompiled on CPU (`grpo_lightning.core.generation.static_engine`); it costs the copy and
    one KV cache (both in the pre-flight's memory estimate) and a compile warm-up per batch shape. Both stop
    decoding finished rows once at most half of a batch of more than 8 rows is live. "vllm": a colocated
    vLLM engine on every rank, pushed the policy's weights before each rollout after they changed
    (`grpo_lightning.core.generation.vllm_engine`; options `vllm_*` below). "auto" (the default): "vllm"
    on CUDA where vLLM imports, else "static" on CUDA; "eager" elsewhere, since on CPU compiling decodes no
    faster and the uncompiled copy is within a few percent of eager (BENCHMARKS.md, "Decoding"). A model
    the static path cannot serve (sliding-window or linear-attention layers, a quantized base, DoRA) falls
    back to "eager" with one warning; a model with a sliding window (`sliding_window`, or `layer_types`:
    `sampling.not_full_attention`) gets one warning for the three options it turns off.
    """
    vllm: VLLMOptions = field(default_factory=VLLMOptions)
    """The vLLM engine's options (`core.generation.vllm_engine.VLLMOptions`)."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.backend in ("eager", "static"):
            for option in fields(self.vllm):
                warn_inert(self.vllm, option.name, "engine.backend: vllm (or auto)")


def check_engine_importable(options: EngineOptions) -> None:
    """Refuse `backend: vllm` where vLLM does not import, in one line saying what to install. Not when the
    options are built (a checkpoint of a vLLM run loads and exports on a machine without vLLM): when a run
    that samples sets up, before any weights load (`training.run_checks.FitChecks`)."""
    if options.backend == "vllm" and (problem := vllm_unavailable()) is not None:
        raise option_error(options, "backend", options.backend, problem)
