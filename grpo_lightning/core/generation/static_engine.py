"""Rollouts through a static KV cache and a compiled decoding step, on an inference copy of the policy.

Eager decoding of a small model is launch-bound: one decoding step of a 0.5B model runs some 50x above the
time its weights take to read, nearly all of it Python and kernel launches. transformers' `generate`
removes that overhead itself when the KV cache has a fixed shape (`StaticCache`): it compiles the model's
forward for the decoding steps (`torch.compile`, CUDA graphs under mode "reduce-overhead"; see
`GenerationMixin._valid_auto_compile_criteria` and `get_compiled_call`). `StaticEngine` arranges for that
to happen once per run and keep holding:

- shapes never change between steps: prompts are left-padded to a multiple of `prompt_bucket`, and the
  cache (rows x length) is allocated once and reused while it is large enough; with compilation, rows are
  padded to a power of two (the padding rows repeat the first prompt and are dropped from the rollout).
  `recompiles` counts graphs compiled on a cache shape that was already warm: 0 is the target.
- generation runs on an inference copy (`InferenceCopy`): a plain HF model of the policy's class, in the
  compute dtype (bf16 under `bf16-mixed`, whose master weights are float32), whose parameters are
  overwritten in place after every optimizer step (`weights_updated`), so a captured graph keeps reading
  the same storage and never recompiles. A LoRA policy's copy holds the merged weights, base + scaling *
  B @ A, computed into the copy (the trained base is never touched): LoRA rollouts then cost what
  full-model rollouts cost. Under FSDP2 the copy is filled from the gathered weights
  (`distributed.gathered_for_generation` around the calls).
- sampling is the eager path's (`sampling.generate_completions`: the same processors, the checkpoint's
  generation config ignored, `min_new_tokens`, EOS handling), run with the static cache passed in; with
  `share_prompt` each prompt's prefill runs once (`shared_prompt.prefill_groups`) and is copied into its
  G rows of the static cache.

No hand-written decoding loop: `generate` does the decoding. No Lightning here.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._dynamo.utils import counters
from torch.distributed.fsdp import FSDPModule
from transformers import CompileConfig, PreTrainedModel, StaticCache

from grpo_lightning.core.generation.engines import RolloutEngine, SamplingSettings
from grpo_lightning.core.generation.sampling import generate_completions
from grpo_lightning.core.generation.shared_prompt import cache_argument, prefill_groups
from grpo_lightning.core.types import Rollout


def hf_model(model: PreTrainedModel) -> PreTrainedModel:
    """The Hugging Face model inside a PEFT wrapper, or `model` itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _lora_layers(model: PreTrainedModel) -> dict[str, torch.nn.Module]:
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in hf_model(model).named_modules() if isinstance(m, LoraLayer)}


def plain_class(model: PreTrainedModel) -> type[PreTrainedModel]:
    """The policy's transformers class, without FSDP2's wrapper class (`FSDPLlamaForCausalLM`)."""
    return next(
        c
        for c in type(hf_model(model)).__mro__
        if issubclass(c, PreTrainedModel) and not issubclass(c, FSDPModule)
    )


def named_generation_weights(model: PreTrainedModel) -> Iterator[tuple[str, Tensor]]:
    """The weights that generation runs on, named as in the plain HF model: a LoRA layer's weight is
    base + sum over active adapters of PEFT's `get_delta_weight` (scaling * B @ A), in float32, one layer at
    a time. Under FSDP2, call it where the weights are gathered (the sharded ones are DTensors)."""
    lora = _lora_layers(model)
    for name, param in hf_model(model).named_parameters():
        if ".lora_" in name:
            continue
        layer = lora.get(name.rsplit(".base_layer.", 1)[0]) if ".base_layer." in name else None
        if layer is not None and name.endswith(".base_layer.weight") and not layer.disable_adapters:
            deltas = [layer.get_delta_weight(a) for a in layer.active_adapters if a in layer.lora_A]
            param = param.float() + sum(d.float() for d in deltas)
        yield name.replace(".base_layer.", "."), param


def compute_dtype(precision: str) -> torch.dtype | None:
    """The inference copy's dtype under Lightning's `precision`: bf16 or fp16 under their mixed or true
    precisions, else None (the policy's own)."""
    return {"bf16": torch.bfloat16, "16": torch.float16}.get(str(precision).split("-")[0])


def resolve_backend(requested: str, model: PreTrainedModel, device: torch.device) -> str:
    """`GRPOConfig.generation_backend` made concrete: "auto" is "static" on CUDA and "eager" elsewhere; a
    model the static path cannot serve gets "eager", with one warning that says why."""
    backend = requested if requested != "auto" else ("static" if device.type == "cuda" else "eager")
    reason = static_unsupported(model) if backend == "static" else None
    if reason is not None:
        warnings.warn(
            f"grpo.generation_backend={requested!r}: {reason}; rollouts use eager decoding", stacklevel=3
        )
        return "eager"
    return backend


def static_unsupported(model: PreTrainedModel) -> str | None:
    """Why `model`'s rollouts cannot go through `StaticEngine`, or None when they can."""
    inner = hf_model(model)
    config = inner.config.get_text_config(decoder=True)
    if inner.config.is_encoder_decoder or cache_argument(model) is None:
        return f"{type(inner).__name__} is not a decoder-only model with a KV cache"
    if getattr(inner, "hf_quantizer", None) is not None:
        return "its base is quantized: the inference copy holds plain weights"
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"}:
        return f"its attention layers are not all full attention ({sorted(layer_types)})"
    if any(any(layer.use_dora.values()) for layer in _lora_layers(model).values()):
        return "DoRA adapters do not merge as base + scaling * B @ A"
    with torch.device("meta"):
        plain = plain_class(model)._from_config(copy.deepcopy(inner.config))
    expected = {name for name, _ in plain.named_parameters()}
    found = {name for name, _ in named_generation_weights(model)}
    if expected != found:
        odd = sorted(expected ^ found)[:3]
        return f"its parameters do not map onto a plain {type(plain).__name__} (e.g. {odd})"
    return None


class InferenceCopy:
    """A plain HF model of the policy's class and config in `dtype`, for generation only; `refresh` writes
    the policy's current (merged) weights into the same tensors."""

    def __init__(self, model: PreTrainedModel, dtype: torch.dtype, device: torch.device) -> None:
        inner = hf_model(model)
        with torch.device(device):
            self.model = plain_class(model)._from_config(
                copy.deepcopy(inner.config),
                dtype=dtype,
                attn_implementation=inner.config._attn_implementation,
            )
        self.model.eval().requires_grad_(False)
        self.parameters = dict(self.model.named_parameters())
        self.refresh(model)

    @torch.no_grad()
    def refresh(self, model: PreTrainedModel) -> None:
        """Copy the policy's weights in, cast, in place: the storage, and graphs captured over it, stay."""
        for name, value in named_generation_weights(model):
            self.parameters[name].copy_(value)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _compile_config(device: torch.device) -> CompileConfig:
    # CUDA graphs on GPU ("reduce-overhead"); dynamic=False: one graph per cache shape, no symbolic sizes.
    config = CompileConfig(dynamic=False, mode="reduce-overhead" if device.type == "cuda" else "default")
    config._compile_all_devices = True  # transformers compiles on accelerators only unless told
    return config


class StaticEngine(RolloutEngine):
    """Rollouts of `num_generations` completions per prompt through `generate` with a static KV cache, on an
    inference copy of the policy refreshed in place after every optimizer step (see the module docstring).

    `settings`: what every sampled token obeys, as for `EagerEngine`; `share_prompt` prefills each prompt
    once. `dtype`: the inference copy's (None: the policy's parameters'). `compile`: compile the decoding
    step (`torch.compile` through transformers' `CompileConfig`, CUDA graphs on GPU); off, the static cache
    is used eagerly. `prompt_bucket`: prompts are left-padded to a multiple of it, so that prompt lengths
    within a bucket share one cache length. `max_prompt_tokens`: the longest prompt to expect; compiling,
    the cache is that long (plus `max_new_tokens`) from the first call, so that no longer prompt changes
    its shape (the decoding step's shapes are the cache's: a shorter prompt in it needs no new graph).
    """

    def __init__(
        self,
        settings: SamplingSettings,
        *,
        dtype: torch.dtype | None = None,
        compile: bool = False,
        prompt_bucket: int = 64,
        max_prompt_tokens: int | None = None,
    ) -> None:
        self.settings = settings
        self.sampling = {  # generate_completions' keywords
            "max_new_tokens": settings.max_new_tokens,
            "min_new_tokens": settings.min_new_tokens,
            "eos_token_ids": list(settings.eos_token_ids),
            "pad_token_id": settings.pad_token_id,
            "temperature": settings.temperature,
            "top_p": settings.top_p,
            "top_k": settings.top_k,
        }
        self.share_prompt = settings.share_prompt
        self.dtype = dtype
        self.compile = compile
        self.prompt_bucket = prompt_bucket
        self.max_prompt_tokens = max_prompt_tokens
        self.copy: InferenceCopy | None = None
        self._compile_config: CompileConfig | None = (
            None  # one object: transformers compiles again for another
        )
        self._caches: dict[int, tuple[StaticCache, int]] = {}  # rows -> that batch size's cache, its length
        self._warm: set[tuple[int, int]] = set()  # (rows, length) shapes generated with at least once
        self.warmup_compiles = 0  # graphs compiled on the first call of each cache shape
        self.recompiles = 0  # graphs compiled on a shape that was already warm: should stay 0

    @property
    def reads_live_weights(self) -> bool:
        """Only until the first `generate` has built the copy from them."""
        return self.copy is None

    def weights_updated(self, model: PreTrainedModel) -> None:
        """The optimizer changed `model`'s weights: write them into the copy (gathered, if sharded)."""
        if self.copy is not None:
            self.copy.refresh(model)

    @torch.no_grad()
    def generate(
        self,
        model: PreTrainedModel,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        *,
        num_generations: int,
        do_sample: bool = True,
    ) -> Rollout:
        """`num_generations` completions per prompt of `prompt_ids` `[N, P]` (left-padded): N*G rows."""
        # Outside inference mode (validation's): the copy and the caches, created in the first call wherever
        # it is, are updated in place by later calls. Autocast off: the copy already has its compute dtype,
        # and one autocast state for every call means one set of compile guards.
        with torch.inference_mode(False), torch.autocast(prompt_ids.device.type, enabled=False):
            return self._generate(model, prompt_ids.clone(), prompt_mask.clone(), num_generations, do_sample)

    def _generate(
        self, model: PreTrainedModel, prompt_ids: Tensor, prompt_mask: Tensor, G: int, do_sample: bool
    ) -> Rollout:
        if self.copy is None:
            dtype = self.dtype or next(model.parameters()).dtype
            self.copy = InferenceCopy(model, dtype, prompt_ids.device)
        twin = self.copy.model
        N, P = prompt_ids.shape
        rows = N * G
        width = _round_up(P, self.prompt_bucket)
        pad = self.sampling["pad_token_id"]
        ids = F.pad(prompt_ids, (width - P, 0), value=pad)  # [N, W]
        mask = F.pad(prompt_mask, (width - P, 0), value=0)  # [N, W]
        longest = max(
            width, _round_up(self.max_prompt_tokens or 0, self.prompt_bucket) if self.compile else 0
        )
        cache, cache_rows, length = self._cache(twin, rows, longest + self.sampling["max_new_tokens"])
        prompt_of_row = torch.arange(cache_rows, device=ids.device) // G  # [R] padding rows repeat prompt 0
        prompt_of_row[rows:] = 0
        cache.reset()
        if self.share_prompt and width > 1:
            self._prefill(twin, ids, mask, prompt_of_row, cache)
        if self.compile and self._compile_config is None:
            self._compile_config = _compile_config(ids.device)
        graphs = counters["stats"]["unique_graphs"]
        output = generate_completions(
            twin,
            ids[prompt_of_row],
            mask[prompt_of_row],
            num_generations=1,  # the rows are repeated already
            do_sample=do_sample,
            prompt_cache={cache_argument(twin): cache},
            compile_config=self._compile_config,
            **self.sampling,
        )
        compiled = counters["stats"]["unique_graphs"] - graphs
        shape = (cache_rows, length)
        if shape in self._warm:
            self.recompiles += compiled
        else:
            self._warm.add(shape)
            self.warmup_compiles += compiled
        completion_mask = output.completion_mask[:rows]  # [N*G, T] padding rows may have run longer
        T = int(completion_mask.sum(dim=1).max())
        return Rollout(
            prompt_ids.repeat_interleave(G, dim=0),  # [N*G, P] without the bucket's padding
            prompt_mask.repeat_interleave(G, dim=0),
            output.completion_ids[:rows, :T],
            completion_mask[:, :T],
            output.truncated[:rows],
        )

    def _cache(self, twin: PreTrainedModel, rows: int, length: int) -> tuple[StaticCache, int, int]:
        """A static cache of at least `length` positions for `rows` rows (a power of two when compiling),
        reused while it is long enough, so that the compiled decoding step keeps its shapes; with its rows and
        its length."""
        rows = 1 << (rows - 1).bit_length() if self.compile else rows
        if rows not in self._caches or self._caches[rows][1] < length:
            self._caches[rows] = StaticCache(config=twin.config, max_cache_len=length), length
        cache, length = self._caches[rows]
        return cache, rows, length

    @staticmethod
    def _prefill(twin: PreTrainedModel, ids: Tensor, mask: Tensor, prompt_of_row: Tensor, cache: StaticCache):
        """Each prompt's keys and values but its last token's, computed once per prompt and copied into the
        static cache's rows of that prompt; `generate` then runs the last prompt token itself."""
        prefill = prefill_groups(twin, ids, mask, 1)[cache_argument(twin)]  # [N, heads, W-1, d] per layer
        cached = ids.size(1) - 1
        for static, computed in zip(cache.layers, prefill.layers, strict=True):
            keys, values = computed.keys[prompt_of_row], computed.values[prompt_of_row]  # [R, heads, W-1, d]
            if not static.is_initialized:
                static.lazy_initialization(keys, values)
            static.keys[:, :, :cached].copy_(keys)
            static.values[:, :, :cached].copy_(values)
            static.cumulative_length.fill_(cached)
