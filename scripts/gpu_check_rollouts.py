"""The GPU check's rollouts: the rollout engines side by side on one workload (8 prompts x 8 completions, 150
prompt tokens, exactly 256 new tokens, bf16, random weights of Qwen2.5-0.5B and -1.5B shapes, and the 0.5B
shape with LoRA r=16): "eager" (`generate` with a dynamic cache on the model itself, the module's eager
path) and "compiled" (`static_engine.StaticEngine`: static cache, compiled decoding step, CUDA graphs;
"static" is the same uncompiled; both with the copy as the trainer builds it under `bf16-mixed`). Per row:
warm-up seconds (the first call, compilation included), completion tokens per second over the next calls
(each after an in-place weight refresh, as after an optimizer step), milliseconds per decoding step (wall,
and the process's CPU time), what compiling did (`compile_watch.FastPathReport`: graphs and CUDA graphs
recorded in the warm-up; then recompiles, CUDA graphs re-recorded or skipped, graph breaks, eager
fallbacks, each a FAIL if not 0, as is a compiled row that compiled nothing) and peak memory.
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
from gpu_check_shared import ROLLOUT_SHAPES, Check, now, peak_memory_gib

from grpo_lightning.core.generation.engines import EagerEngine
from grpo_lightning.core.generation.inference_copy import copy_precision
from grpo_lightning.core.generation.sampling import SamplingSettings
from grpo_lightning.core.generation.static_engine import StaticEngine
from grpo_lightning.io.models import LoraOptions, apply_lora


def rollout_model(shape: str, dtype: torch.dtype, device: str, lora: bool) -> torch.nn.Module:
    model_class, config_class, sizes = ROLLOUT_SHAPES[shape]
    config = config_class(**{"vocab_size": 151936, "tie_word_embeddings": True, **sizes})
    torch.manual_seed(0)
    with torch.device(device):
        model = model_class._from_config(config, dtype=dtype)
    return apply_lora(model, LoraOptions(r=16)) if lora else model  # float32 adapters over the base


def time_rollouts(shape: str, backend: str, lora: bool, args: argparse.Namespace) -> dict:
    """Warm-up seconds, then tokens/s over `args.rollout_calls` calls of one engine on one workload."""
    device = "cpu" if args.cpu else "cuda"
    torch._dynamo.reset()  # the previous row's graphs and CUDA graph pools: each row warms up alone
    gc.collect()  # the previous row's models and caches
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    dtype = getattr(torch, args.rollout_dtype)
    model = rollout_model(shape, dtype, device, lora)
    vocab = model.config.vocab_size
    new = args.new_tokens
    settings = SamplingSettings(
        max_new_tokens=new,
        min_new_tokens=new,  # exactly `new` tokens per completion: EOS is never drawn
        eos_token_ids=(1,),
        pad_token_id=0,
        share_prompt=True,
    )
    if backend == "eager":
        engine = EagerEngine(settings)
    else:  # as the trainer builds it: under bf16-mixed, bf16 linear weights (LoRA's too) and autocast
        precision = copy_precision("bf16-mixed" if dtype == torch.bfloat16 else None)
        engine = StaticEngine(settings, precision=precision, compile=backend == "compiled")
    generator = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(3, vocab, (args.rollout_prompts, args.prompt_tokens), generator=generator)
    prompt_ids = prompt_ids.to(device)  # [N, P]
    mask = torch.ones_like(prompt_ids)

    def call() -> tuple[float, float, int]:
        start, cpu_start = now(device), time.process_time()
        rollout = engine.generate(model, prompt_ids, mask, num_generations=args.rollout_generations)
        return now(device) - start, time.process_time() - cpu_start, int(rollout.completion_mask.sum())

    warmup, _, _ = call()
    seconds, cpu_seconds, tokens = 0.0, 0.0, 0
    for _ in range(args.rollout_calls):
        engine.weights_changed()  # as after an optimizer step: refreshed in place, no recompilation
        elapsed, cpu, count = call()
        seconds, cpu_seconds, tokens = seconds + elapsed, cpu_seconds + cpu, tokens + count
    fast_path = engine.watch.report if isinstance(engine, StaticEngine) else None
    return {
        "rollout": shape + ("+lora" if lora else ""),
        "backend": backend,
        "warmup_s": warmup,
        "tokens_per_s": tokens / seconds,
        "ms_per_step": 1000 * seconds / (args.rollout_calls * new),
        "cpu_ms_per_step": 1000 * cpu_seconds / (args.rollout_calls * new),  # on a busy CPU, the steadier
        "tokens": tokens // args.rollout_calls,
        "recompiles": getattr(engine, "recompiles", 0),
        # What compiling did (`compile_watch.FastPathReport`): graphs and CUDA graphs of the warm-up, then
        # what must stay 0 after it: CUDA graphs re-recorded, skipped, graph breaks, eager fallbacks.
        "graphs": fast_path.graphs_compiled if fast_path else 0,
        "cudagraphs": fast_path.cudagraph_recordings if fast_path else 0,
        "rerecords": fast_path.cudagraph_rerecords if fast_path else 0,
        "cg_skips": fast_path.cudagraph_skips if fast_path else 0,
        "breaks": fast_path.graph_breaks if fast_path else 0,
        "fallbacks": fast_path.eager_fallbacks if fast_path else 0,
        "engine_tok_s": engine.metrics()["tokens_per_second"],  # the engine's own figure, last call
        "peak_GiB": peak_memory_gib(device),
    }


def rollouts(args: argparse.Namespace) -> tuple[list[dict], list[Check]]:
    """Each shape (and the first one with LoRA) through each backend; the speed-up over eager per row."""
    rows = []
    for i, shape in enumerate(args.rollout_shapes.split(",")):
        for lora in (False, True) if i == 0 else (False,):
            group = [
                time_rollouts(shape, backend, lora, args) for backend in args.rollout_backends.split(",")
            ]
            eager = next((row["tokens_per_s"] for row in group if row["backend"] == "eager"), None)
            for row in group:
                row["vs_eager"] = row["tokens_per_s"] / eager if eager else float("nan")
            rows += group
    checks = [fast_path_check(row) for row in rows if row["backend"] != "eager"]
    return rows, checks


def fast_path_check(row: dict) -> Check:
    """FAIL on anything that undoes the compiled fast path after its warm-up, and on a compiled row that
    compiled nothing (it decoded eagerly without saying so)."""
    degraded = {k: row[k] for k in ("recompiles", "rerecords", "cg_skips", "breaks", "fallbacks") if row[k]}
    compiled = row["backend"] != "compiled" or row["graphs"] > 0
    numbers = ", ".join(f"{k} {v}" for k, v in degraded.items()) or "none after warm-up"
    numbers += f"; warm-up compiled {row['graphs']} graph(s), recorded {row['cudagraphs']} CUDA graph(s)"
    return Check(f"fast path holds, {row['rollout']} {row['backend']}", not degraded and compiled, numbers)
