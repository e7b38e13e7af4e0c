"""Rollouts through a static KV cache and a compiled decoding step, on an inference copy of the policy that
computes what the loss scores.

Eager decoding of a small model is launch-bound: one decoding step of a 0.5B model runs some 50x above the
time its weights take to read, nearly all of it Python and kernel launches. transformers' `generate`
removes that overhead itself when the KV cache has a fixed shape (`StaticCache`): it compiles the model's
forward for the decoding steps (`torch.compile`, CUDA graphs under mode "reduce-overhead"; see
`GenerationMixin._valid_auto_compile_criteria` and `get_compiled_call`). `StaticEngine` arranges for that
to happen once per run and keep holding, and reports when it does not (`compile_watch.CompileWatch`):

- shapes never change between steps: prompts are left-padded to a multiple of `prompt_bucket`; with
  compilation, rows are padded to a power of two (the padding rows repeat the first prompt and are dropped
  from the rollout) and the cache is as long as the longest prompt to expect plus `max_new_tokens`. One
  key/value storage sized for the largest row bucket seen backs every bucket's cache (the smaller ones
  are views of its first rows), so memory holds one cache, not one per bucket.
- generation runs on an inference copy (`InferenceCopy`): a plain HF model of the policy's class whose
  tensors are overwritten in place, so a captured graph keeps reading the same storage and never
  recompiles. The copy is refreshed once before the first rollout after the weights changed (an optimizer
  step, a checkpoint load: `weights_changed`), never after each optimizer step; under FSDP2 its weights
  arrive one unit (a decoder layer) gathered at a time (the `weights` source the trainer passes), so no
  second full model is alive while it refreshes.
- sampling is the eager path's (`sampling.generate_completions`: the same processors, the checkpoint's
  generation config ignored, `min_new_tokens`, EOS handling), run with the static cache passed in; with
  `share_prompt` each prompt's prefill runs once (`sampling.prefill_groups`) and is copied into its
  G rows of the static cache. Every sampled rollout carries the log-prob of each token under the
  distribution it was drawn from (`Rollout.sampler_logprobs`), which the trainer compares with the loss's.
- uncompiled, finished rows stop costing as on the eager path: once half of a call's rows have ended, the
  live ones are copied to the storage's first rows and go on in the cache of their smaller bucket (a view
  of those rows, `_keep_rows`). Compiled, rows stay in their power-of-two bucket until the call ends: each
  smaller bucket would be one more graph to compile (and CUDA graphs to capture) inside a rollout, for a
  step that costs about as much on a GPU for 8 rows as for 64.

The copy samples from the policy the loss scores, by construction: it holds each weight as the scorer
computes with it and runs under the same autocast (`InferenceCopy`), so on the same tokens, in one pass,
its log-probs are the scorer's exactly, with full fine-tuning and with LoRA at every adapter size
(tests/test_static_lora.py; a copy with the adapters merged into bf16 weights kept 0.4-0.5 of the
scorer's log-prob change at B ~ 1e-4). A copy all in the compute dtype would differ where autocast keeps
float32: the embeddings, so the residual stream, and the norms. What still differs is decoding itself: one
token at a time over a KV cache rounds otherwise than one pass over the sequence in bf16 (and compiled
kernels fuse in their own order). Measured on CPU (benchmarks/sampler_gap.py, BENCHMARKS.md) that leaves
2-3e-2 nats per token under bf16-mixed, as for eager decoding under autocast, where an all-bf16 copy had
5e-2; every training step logs it (`rollout/logp_gap_*`).
No hand-written decoding loop: `generate` does the decoding. No Lightning here.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import CompileConfig, PreTrainedModel, StaticCache
from transformers.cache_utils import StaticLayer

from grpo_lightning.core.generation.compile_watch import CompileWatch
from grpo_lightning.core.generation.engines import (
    Backend,
    EngineMemory,
    EngineRequest,
    MemoryRequest,
    RolloutEngine,
    rollout_speed,
)
from grpo_lightning.core.generation.inference_copy import (
    CopyPrecision,
    InferenceCopy,
    WeightSource,
    copy_precision,
    hf_model,
    inference_copy_nbytes,
    own_weights,
    plain_copy,
)
from grpo_lightning.core.generation.model_abilities import cache_argument, not_full_attention
from grpo_lightning.core.generation.sampling import (
    COMPACT_ABOVE_ROWS,
    SamplingSettings,
    generate_completions,
    prefill_groups,
)
from grpo_lightning.core.types import Rollout


def static_unsupported(model: PreTrainedModel) -> str | None:
    """Why `model`'s rollouts cannot go through `StaticEngine`, or None when they can."""
    from peft import LoraConfig, PeftModel

    inner = hf_model(model)
    if inner.config.is_encoder_decoder or cache_argument(model) is None:
        return f"{type(inner).__name__} is not a decoder-only model with a KV cache"
    if getattr(inner, "hf_quantizer", None) is not None:
        return "its base is quantized: the inference copy holds plain weights"
    if (reason := not_full_attention(inner.config)) is not None:
        return reason
    if isinstance(model, PeftModel):
        if len(model.active_adapters) != 1:
            return f"it has {len(model.active_adapters)} active adapters; the inference copy serves one"
        adapter = model.peft_config[model.active_adapter]
        if not isinstance(adapter, LoraConfig):
            return f"its adapter is {type(adapter).__name__}; the inference copy serves LoRA"
        if adapter.use_dora:
            return "DoRA adapters are not served by the inference copy (LoRA only)"
    plain = plain_copy(model, torch.device("meta"), None)
    expected = {name: p.shape for name, p in plain.named_parameters()}
    found = {name: p.shape for name, p in hf_model(model).named_parameters()}
    if expected != found:
        odd = sorted(set(expected) ^ set(found))[:3] or [n for n in expected if expected[n] != found[n]][:3]
        return f"its parameters do not map onto a plain {type(plain).__name__} (e.g. {odd})"
    return None


_LIMIT_OPTION = next(
    (
        o
        for o in ("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit")
        if hasattr(torch._dynamo.config, o)
    ),
    None,
)
_LIMIT_ERROR = (
    getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", None)
    or getattr(torch._dynamo.exc, "FailOnCacheLimitHit", None)
    or ()
)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _compile_config(device: torch.device) -> CompileConfig:
    # CUDA graphs on GPU ("reduce-overhead"); dynamic=False: one graph per cache shape, no symbolic sizes.
    config = CompileConfig(dynamic=False, mode="reduce-overhead" if device.type == "cuda" else "default")
    # transformers compiles on accelerators only unless told, and only through this private flag: no public
    # field of CompileConfig sets it.
    config._compile_all_devices = True
    return config


class _CastingLayer(StaticLayer):
    """A `StaticLayer` that stores keys and values in its own dtype. Under autocast the rotary embedding
    leaves the keys in float32 (the residual stream's dtype) while attention reads them cast to the autocast
    dtype: stored in it, they take half the memory and attention reads the same values."""

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        return super().update(
            key_states.to(self.keys.dtype), value_states.to(self.values.dtype), *args, **kwargs
        )


class SharedCaches:
    """Static KV caches for every row bucket over one key/value storage in `dtype`, sized for the largest
    bucket and the longest cache seen: a bucket's cache is a view of the storage's first rows (contiguous,
    as `StaticCache` allocates its own). A bucket or length beyond the storage reallocates it, larger, and
    every bucket's cache with it (their next call warms up again)."""

    def __init__(self, config, dtype: torch.dtype) -> None:
        self.config, self.dtype = config, dtype
        self.rows = self.length = 0  # the storage's
        self.storage: list[tuple[Tensor, Tensor]] = []  # per layer: keys, values [rows, heads, length, d]
        self.caches: dict[int, StaticCache] = {}  # rows -> its cache
        self.generation = 0  # storages allocated so far

    def get(self, rows: int, length: int, device: torch.device) -> tuple[StaticCache, int]:
        """A cache for `rows` rows of at least `length` positions, and its length."""
        if rows > self.rows or length > self.length:
            self.storage, self.caches = [], {}  # the old storage is freed before the new one is allocated
            self.rows, self.length = max(rows, self.rows), max(length, self.length)
            self.generation += 1
            largest = self._cache(self.rows, device)
            self.storage = [(layer.keys, layer.values) for layer in largest.layers]
            self.caches[self.rows] = largest
        if rows not in self.caches:
            self.caches[rows] = self._cache(rows, device, view=True)
        return self.caches[rows], self.length

    def _cache(self, rows: int, device: torch.device, view: bool = False) -> StaticCache:
        """A cache of `rows` rows, allocated, or a view of the storage's first rows."""
        cache = StaticCache(config=self.config, max_cache_len=self.length)
        cache.layers = [_CastingLayer(max_cache_len=self.length) for _ in cache.layers]
        kv_heads, head_dim = self._heads()
        # Zero-length states set the layer's shapes and dtype; `lazy_initialization` allocates the rest.
        empty = torch.empty((0 if view else rows, kv_heads, 0, head_dim), dtype=self.dtype, device=device)
        for i, layer in enumerate(cache.layers):
            layer.lazy_initialization(empty, empty)
            if view:
                keys, values = self.storage[i]
                layer.keys, layer.values = keys[:rows], values[:rows]
                torch._dynamo.mark_static_address(layer.keys)  # as StaticLayer marks its own tensors
                torch._dynamo.mark_static_address(layer.values)
        return cache

    def _heads(self) -> tuple[int, int]:
        config = self.config.get_text_config(decoder=True)
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return kv_heads, getattr(config, "head_dim", None) or config.hidden_size // heads

    def nbytes(self) -> int:
        """Bytes of the keys and values (the storage; the views add none)."""
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.storage)


class StaticEngine(RolloutEngine):
    """Rollouts of `num_generations` completions per prompt through `generate` with a static KV cache, on an
    inference copy of the policy refreshed in place before the first rollout after its weights changed
    (see the module docstring).

    `settings`: what every sampled token obeys, as for `EagerEngine` (a call may pass its own).
    `precision`: how the scorer computes, which the copy repeats (`CopyPrecision`; default: the policy as
    it is, no autocast). `compile`: compile the decoding step (`torch.compile` through transformers'
    `CompileConfig`, CUDA graphs on GPU); off, the static cache is used eagerly. `prompt_bucket`: prompts
    are left-padded to a multiple of it, so that prompt lengths within a bucket share one cache length.
    `max_prompt_tokens`: the longest prompt to expect; compiling, the cache is that long (plus
    `max_new_tokens`) from the first call, so that no longer prompt changes its shape (the decoding step's
    shapes are the cache's: a shorter prompt in it needs no new graph). `weights`: where the copy's weights
    come from (`WeightSource`; default the policy's own tensors, unsharded). `compact_above_rows`: uncompiled,
    a call of more rows than this stops decoding its finished rows once half have ended
    (`sampling.generate_completions`); None (and compiling) decodes every row until the longest ends.
    """

    def __init__(
        self,
        settings: SamplingSettings,
        *,
        precision: CopyPrecision = CopyPrecision(),
        compile: bool = False,
        prompt_bucket: int = 64,
        max_prompt_tokens: int | None = None,
        weights: WeightSource = own_weights,
        compact_above_rows: int | None = COMPACT_ABOVE_ROWS,
    ) -> None:
        self.settings = settings
        self.compact_above_rows = compact_above_rows
        self.precision = precision
        self.compile = compile
        self.prompt_bucket = prompt_bucket
        self.max_prompt_tokens = max_prompt_tokens
        self.weights = weights
        self.copy: InferenceCopy | None = None
        self.caches: SharedCaches | None = None
        self.stale = True  # the policy's weights changed since the copy last took them
        self.watch = CompileWatch()
        self.compile_failed: str | None = None  # why decoding stopped compiling for good
        self._compile_config: CompileConfig | None = (
            None  # one object: transformers compiles again for another
        )
        self.last_speed: dict[str, float] = {}

    @property
    def reads_live_weights(self) -> bool:
        """Never: the copy takes the weights from `weights` (which gathers a sharded policy itself)."""
        return False

    @property
    def recompiles(self) -> int:
        return self.watch.report.recompiles

    @property
    def warmup_compiles(self) -> int:
        report = self.watch.report
        return report.graphs_compiled - report.recompiles

    @property
    def refreshes(self) -> int:
        return self.copy.refreshes if self.copy is not None else 0

    def weights_changed(self) -> None:
        """The policy's weights changed: the copy takes them before the next rollout."""
        self.stale = True

    def refresh(self, model: PreTrainedModel, device: torch.device) -> None:
        """Build the copy on `device`, or write the policy's weights into it if they changed since (a
        collective under FSDP2: every rank calls it at the same point)."""
        if self.copy is not None and not self.stale:
            return
        # Outside inference mode (validation's): tensors made there could not be written in place later.
        with torch.inference_mode(False), torch.no_grad():
            if self.copy is None:
                self.copy = InferenceCopy(model, self.precision, torch.device(device))
            self.copy.refresh(self.weights(model))
            if self.caches is None:  # the embedding's dtype is the weights' once they are in
                self.caches = SharedCaches(self.copy.model.config, self.kv_dtype())
        self.stale = False

    def metrics(self) -> dict[str, float]:
        """The last call's speed and what compiling did so far (`compile_watch.FastPathReport`)."""
        counts = {name: float(value) for name, value in vars(self.watch.report).items()}
        return {**self.last_speed, **counts, "copy_refreshes": float(self.refreshes)}

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
        # Outside inference mode (validation's): the copy and the caches, created in the first call wherever
        # it is, are updated in place by later calls. The copy's own autocast, whatever the caller's: the
        # scorer's numerics, and one autocast state for every call means one set of compile guards.
        device = prompt_ids.device.type
        autocast = self.precision.autocast_dtype
        with (
            torch.inference_mode(False),
            torch.autocast(device, dtype=autocast or torch.bfloat16, enabled=autocast is not None),
        ):
            start = time.perf_counter()
            rollout, steps = self._generate(
                prompt_ids.clone(), prompt_mask.clone(), num_generations, do_sample, settings or self.settings
            )
            self.last_speed = rollout_speed(rollout, steps, time.perf_counter() - start)
        return rollout

    def _generate(
        self, prompt_ids: Tensor, prompt_mask: Tensor, G: int, do_sample: bool, settings: SamplingSettings
    ) -> tuple[Rollout, int]:
        twin = self.copy.model
        N, P = prompt_ids.shape
        rows = N * G
        width = _round_up(P, self.prompt_bucket)
        ids = F.pad(prompt_ids, (width - P, 0), value=settings.pad_token_id)  # [N, W]
        mask = F.pad(prompt_mask, (width - P, 0), value=0)  # [N, W]
        compiling = self.compile and self.compile_failed is None
        cache_rows, length = self.cache_shape(rows, width, settings.max_new_tokens)
        cache, length = self.caches.get(cache_rows, length, ids.device)
        prompt_of_row = torch.arange(cache_rows, device=ids.device) // G  # [R] padding rows repeat prompt 0
        prompt_of_row[rows:] = 0
        cache.reset()
        if settings.share_prompt and width > 1:
            self._prefill(twin, ids, mask, prompt_of_row, cache)
        if compiling and self._compile_config is None:
            self._compile_config = _compile_config(ids.device)
        call = {
            "settings": settings,
            "num_generations": 1,  # the rows are repeated already
            "do_sample": do_sample,
            "prompt_cache": {cache_argument(twin): cache},
            "compact_above_rows": None if self.compile else self.compact_above_rows,
            "keep_cache_rows": self._keep_rows,
        }
        output = self._decode(twin, ids[prompt_of_row], mask[prompt_of_row], call, compiling, cache)
        completion_mask = output.completion_mask[:rows]  # [N*G, T] padding rows may have run longer
        T = int(completion_mask.sum(dim=1).max())
        sampled = output.sampler_logprobs
        rollout = Rollout(
            prompt_ids.repeat_interleave(G, dim=0),  # [N*G, P] without the bucket's padding
            prompt_mask.repeat_interleave(G, dim=0),
            output.completion_ids[:rows, :T],
            completion_mask[:, :T],
            output.truncated[:rows],
            None if sampled is None else sampled[:rows, :T],
        )
        return rollout, output.completion_ids.size(1)

    def _decode(self, twin, ids, mask, call: dict, compiling: bool, cache: StaticCache) -> Rollout:
        """`generate_completions` on the copy, compiled where asked, its compiling watched: a call that
        would exceed dynamo's recompile limit decodes uncompiled instead, and so do all later ones."""
        if not compiling:
            if self.compile:
                self.watch.fell_back(self.compile_failed)
            return generate_completions(twin, ids, mask, compile_config=None, **call)
        refusal = _compile_refused(twin, cache, self._compile_config)
        if refusal is not None:
            self.compile_failed = refusal
            return self._decode(twin, ids, mask, call, False, cache)
        shape = (cache.layers[0].keys.shape, self.caches.generation)
        # Past the limit, dynamo would run the step uncompiled for good with one log line: fail instead.
        fail_at_limit = {_LIMIT_OPTION: True} if _LIMIT_OPTION else {}
        try:
            with torch._dynamo.config.patch(**fail_at_limit), self.watch.call(shape):
                return generate_completions(twin, ids, mask, compile_config=self._compile_config, **call)
        except _LIMIT_ERROR:
            limit = torch._dynamo.config.recompile_limit
            self.compile_failed = f"dynamo's recompile limit ({limit}) was hit; decoding stays uncompiled"
            cache.reset()
            return self._decode(twin, ids, mask, call, False, cache)

    def _keep_rows(self, cache: StaticCache, rows: Tensor) -> StaticCache:
        """The cache of the live `rows` `[b']` of `cache`: their keys and values moved to the storage's first
        rows, which the cache of `b'` rows views. No allocation: the storage shrinks in place."""
        smaller, _ = self.caches.get(rows.size(0), self.caches.length, rows.device)
        filled = int(cache.layers[0].cumulative_length)  # positions written so far, the same in every layer
        for source, target in zip(cache.layers, smaller.layers, strict=True):
            # The index gathers a copy first: rows moving down onto rows they overlap are read before written.
            target.keys[:, :, :filled] = source.keys[rows, :, :filled]
            target.values[:, :, :filled] = source.values[rows, :, :filled]
            target.cumulative_length.copy_(source.cumulative_length)
        return smaller

    def cache_shape(self, rows: int, prompt_width: int, max_new_tokens: int) -> tuple[int, int]:
        """The static cache's rows and length for `rows` sequences of `prompt_width` (bucketed) prompt tokens:
        rows a power of two and the length that of `max_prompt_tokens` when compiling (one graph for every
        prompt length), else as needed."""
        if self.compile:
            rows = 1 << (rows - 1).bit_length()
            prompt_width = max(prompt_width, _round_up(self.max_prompt_tokens or 0, self.prompt_bucket))
        return rows, prompt_width + max_new_tokens

    def kv_dtype(self) -> torch.dtype:
        """The KV cache's dtype: the one attention computes in (autocast's, or the linear layers')."""
        precision = self.precision
        return (
            precision.autocast_dtype
            or precision.linear_dtype
            or self.copy.model.get_input_embeddings().weight.dtype
        )

    def cache_nbytes(self) -> int:
        return self.caches.nbytes() if self.caches is not None else 0

    @staticmethod
    def _prefill(twin: PreTrainedModel, ids: Tensor, mask: Tensor, prompt_of_row: Tensor, cache: StaticCache):
        """Each prompt's keys and values but its last token's, computed once per prompt and copied into the
        static cache's rows of that prompt; `generate` then runs the last prompt token itself."""
        prefill = prefill_groups(twin, ids, mask, 1)[cache_argument(twin)]  # [N, heads, W-1, d] per layer
        cached = ids.size(1) - 1
        for static, computed in zip(cache.layers, prefill.layers, strict=True):
            keys, values = computed.keys[prompt_of_row], computed.values[prompt_of_row]  # [R, heads, W-1, d]
            static.keys[:, :, :cached].copy_(keys)
            static.values[:, :, :cached].copy_(values)
            static.cumulative_length.fill_(cached)


def _compile_refused(twin: PreTrainedModel, cache: StaticCache, config: CompileConfig) -> str | None:
    """Why transformers would decode uncompiled with this cache (`_valid_auto_compile_criteria`), or None."""
    criteria = getattr(twin, "_valid_auto_compile_criteria", None)
    if criteria is None:
        return None
    from transformers import GenerationConfig

    generation = GenerationConfig(compile_config=config, disable_compile=False)
    if criteria({cache_argument(twin): cache}, generation):
        return None
    return "transformers does not compile this model's decoding step (`_valid_auto_compile_criteria`)"


# -------------------------------------------------------------------------------------- registry entry
def _static(request: EngineRequest, options: None) -> StaticEngine:
    return StaticEngine(
        request.settings,
        precision=copy_precision(request.precision),  # the copy computes as the scorer does
        compile=request.device.type == "cuda",
        max_prompt_tokens=request.sampling.max_prompt_length,
        weights=request.weights,
    )


def _static_memory(engine: StaticEngine, policy: PreTrainedModel, rollout: MemoryRequest) -> EngineMemory:
    width = -(-rollout.prompt_tokens // engine.prompt_bucket) * engine.prompt_bucket
    sequences, tokens = engine.cache_shape(rollout.sequences, width, rollout.new_tokens)
    sharded_mixed = rollout.sharded and str(rollout.precision).endswith("-mixed")  # gathered in that dtype
    gathered = engine.precision.linear_dtype if sharded_mixed else None
    return EngineMemory(sequences, tokens, inference_copy_nbytes(policy, engine.precision, gathered))


STATIC_BACKEND = Backend(_static, static_unsupported, _static_memory, needs_full_attention=True)
