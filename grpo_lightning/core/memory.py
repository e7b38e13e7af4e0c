"""Memory per GPU of a GRPO run, estimated before it starts: what the pre-flight prints.

Counted, per GPU, for the strategy at hand (one device, DDP, FSDP2 with or without CPU offload; LoRA or
full fine-tuning):

- weights: the policy as stored (float32 master weights under `bf16-mixed`); FSDP2 holds 1/world of them;
- gradients: one per trainable weight, in its dtype, sharded like the weights;
- optimizer: AdamW's two moments per trainable weight in its dtype, and one float32 step count per
  trainable tensor (torch keeps it as a tensor);
- reference: a second copy of the weights when `beta > 0` without LoRA (LoRA's reference is the same base
  with the adapters off), sharded like the policy;
- rollouts with the eager engine: under FSDP2 the whole policy gathered once per rollout, in the compute
  dtype (`distributed.gathered_for_generation`: "generate gather");
- rollouts with the static engine: its inference copy, unsharded on every rank, in the dtypes it computes
  in (`inference_copy.inference_copy_nbytes`: linear weights in the compute dtype, embeddings and norms as
  the policy holds them); under FSDP2 the largest unit gathered while the copy refreshes ("refresh
  gather": a decoder layer, or the root's embeddings and head), never a second full model;
- KV cache: 2 (keys, values) x layers x KV heads x head size x compute-dtype bytes, per token of each
  rollout sequence (prompts x G, each prompt + completion tokens long); for the static engine, its one
  cache, sized for the largest row bucket (a power of two when compiled) and the longest cache
  (`StaticEngine.cache_shape`), which serves every smaller bucket.

With `cpu_offload` the weights, gradients, optimizer state and reference live in CPU memory instead
(listed apart). Not counted: activations (they depend on `micro_batch_size` and gradient checkpointing),
autocast's low-precision weight copies, FSDP2's one or two layers gathered during forward and backward, the
CUDA context and the allocator's slack. GB here are 10^9 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ADAMW_MOMENTS = 2  # exp_avg, exp_avg_sq
STEP_COUNT_BYTES = 4  # AdamW's per-tensor `step`, a float32 tensor


@dataclass(frozen=True)
class ModelFootprint:
    """What the estimate needs of the policy: its weights and the shape of its KV cache.

    Args:
        weight_bytes: bytes of every weight as stored (trainable or not).
        parameters: number of weights.
        trainable_bytes: bytes of the trainable weights (all of them, or LoRA's adapters).
        trainable_tensors: number of trainable weight tensors (AdamW keeps a step count for each).
        layers / kv_heads / head_dim: the decoder's, for the KV cache.
        largest_unit_parameters: weights of the largest FSDP2 unit (a decoder layer, or the root's own:
            embeddings, final norm, LM head), gathered alone while the static engine's copy refreshes.
    """

    weight_bytes: int
    parameters: int
    trainable_bytes: int
    trainable_tensors: int
    layers: int
    kv_heads: int
    head_dim: int
    largest_unit_parameters: int = 0


@dataclass
class MemoryEstimate:
    """Bytes per GPU (`gpu`) and per process in CPU memory (`cpu`), by what holds them."""

    gpu: dict[str, int] = field(default_factory=dict)
    cpu: dict[str, int] = field(default_factory=dict)

    @property
    def gpu_total(self) -> int:
        return sum(self.gpu.values())

    def text(self) -> str:
        """One line: each GPU term in GB, their total, and what sits in CPU memory."""
        terms = ", ".join(f"{name} {gb(value)}" for name, value in self.gpu.items())
        line = f"{terms} = {gb(self.gpu_total)} per GPU + activations"
        if self.cpu:
            line += f"; in CPU memory per process: {gb(sum(self.cpu.values()))}"
        return line


def gb(value: int) -> str:
    return f"{value / 1e9:.1f} GB"


def estimate_memory(
    model: ModelFootprint,
    *,
    world: int = 1,
    sharded: bool = False,
    cpu_offload: bool = False,
    reference: bool = False,
    compute_bytes: int = 2,
    sequences: int = 1,
    tokens: int = 1,
    inference_copy_bytes: int | None = None,
    kv_pool_bytes: int | None = None,
) -> MemoryEstimate:
    """Memory per GPU of a run: `world` processes, FSDP2 when `sharded` (else one device or DDP, each
    holding everything), `reference` a separate frozen copy, `sequences` rollout rows of `tokens` tokens
    per process (the static engine's: its cache's rows and length), compute in `compute_bytes` per value
    (2 under bf16 or fp16 compute). `inference_copy_bytes`: the weights a rollout engine holds of its own
    (the static engine's copy, vLLM's); None: eager rollouts on the policy itself. `kv_pool_bytes`: an
    engine's KV pool of a size of its own (vLLM's); None: a cache of `sequences` x `tokens`."""
    share = world if sharded else 1
    states = {
        "weights": model.weight_bytes // share,
        "gradients": model.trainable_bytes // share,
        "optimizer": ADAMW_MOMENTS * model.trainable_bytes // share
        + STEP_COUNT_BYTES * model.trainable_tensors,
    }
    if reference:
        states["reference"] = model.weight_bytes // share
    estimate = MemoryEstimate()
    if cpu_offload:
        estimate.cpu = states
    else:
        estimate.gpu = dict(states)
    if inference_copy_bytes is not None:
        estimate.gpu["inference copy"] = inference_copy_bytes
        if sharded:
            estimate.gpu["refresh gather"] = model.largest_unit_parameters * compute_bytes
    elif sharded:
        estimate.gpu["generate gather"] = model.parameters * compute_bytes
    per_token = 2 * model.layers * model.kv_heads * model.head_dim * compute_bytes
    estimate.gpu["KV cache"] = per_token * sequences * tokens if kv_pool_bytes is None else kv_pool_bytes
    return estimate


def footprint(model) -> ModelFootprint:
    """The `ModelFootprint` of a (PEFT-wrapped, possibly FSDP2-sharded) Hugging Face causal LM: a sharded
    weight counts whole (a DTensor's `numel` is the global one)."""
    weights = list(model.parameters())
    trainable = [w for w in weights if w.requires_grad]
    config = model.config
    heads = config.num_attention_heads
    layers = getattr(model.get_decoder(), "layers", None) or []
    per_layer = [sum(w.numel() for w in layer.parameters()) for layer in layers]
    root = sum(w.numel() for w in weights) - sum(per_layer)  # the root unit's own: embeddings, norm, head
    return ModelFootprint(
        weight_bytes=sum(w.numel() * w.element_size() for w in weights),
        parameters=sum(w.numel() for w in weights),
        trainable_bytes=sum(w.numel() * w.element_size() for w in trainable),
        trainable_tensors=len(trainable),
        layers=config.num_hidden_layers,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        largest_unit_parameters=max([root, *per_layer]),
    )


def compute_bytes(precision: str, model) -> int:
    """Bytes per value of activations and the KV cache: 2 under a 16-bit Lightning precision flag, else
    the narrowest weight dtype (a bfloat16 base under LoRA computes in bfloat16)."""
    if "16" in str(precision):
        return 2
    return min(w.element_size() for w in model.parameters())
