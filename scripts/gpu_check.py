"""GPU checks on a random ~0.5B model (150k vocabulary): throughput of bf16 FSDP2 and LoRA steps, and the
numerics that only show on a GPU in bf16.

    bash scripts/gpu_check.sh                      # one GPU, all three parts
    bash scripts/gpu_check.sh --only rollouts      # eager vs static-cache rollouts alone
    bash scripts/gpu_check.sh --only numerics      # the numeric checks alone
    bash scripts/gpu_check.sh --cpu --tiny         # the same code paths on CPU in seconds (tests run this)

No network: the tokenizer is trained on generated arithmetic problems and the model has random weights,
so the figures are about throughput, memory and numerics, not learning.

Throughput: per run, the mean over the steps after the first (warm-up) of the step-time split (generate /
reference log-probs / the rest, which is the policy's forward-backward and the optimizer step), completion
tokens per second, and peak memory.

Rollouts: the rollout engines side by side on one workload (issue 20's: 8 prompts x 8 completions, 150
prompt tokens, exactly 256 new tokens, bf16, random weights of Qwen2.5-0.5B and -1.5B shapes, and the 0.5B
shape with LoRA r=16): "eager" (`generate` with a dynamic cache on the model itself, the module's eager
path) and "compiled" (`static_rollout.StaticEngine`: static cache, compiled decoding step, CUDA graphs;
"static" is the same uncompiled; both with the copy as the trainer builds it under `bf16-mixed`). Per row:
warm-up seconds (the first call, compilation included), completion tokens per second over the next calls
(each after an in-place weight refresh, as after an optimizer step), milliseconds per decoding step (wall,
and the process's CPU time), what compiling did (`compile_watch.FastPathReport`: graphs and CUDA graphs
recorded in the warm-up; then recompiles, CUDA graphs re-recorded or skipped, graph breaks, eager
fallbacks, each a FAIL if not 0, as is a compiled row that compiled nothing) and peak memory.

Numerics (each prints PASS or FAIL with its numbers; any FAIL exits with status 1):
- on-policy, sampled by the eager path and by the static engine: float32 weights under bf16 autocast (the
  static engine samples from its copy, bf16 linear weights under the same autocast), a checkpoint
  generation config as Qwen2.5-Instruct's (repetition penalty 1.1, top-k 20, top-p 0.8, temperature 0.7)
  plus every other token suppressed; the log-prob each engine reports for each sampled token
  (`Rollout.sampler_logprobs`) equals `completion_logprobs`' (the sampler/scorer gap, on ~16k tokens), and
  the share of suppressed tokens sampled equals the raw policy's probability of them;
- LoRA updates kept: B at 1e-4, 1e-3, 1e-2 on 2 layers of Qwen2.5-0.5B's width, the static copy reproduces
  >= 0.99 of the scorer's log-prob change at each;
- weights move: 2 GRPO steps at the shipped one-GPU config's lr 1e-6 with 10 warm-up steps, under its
  precision (bf16-mixed, float32 weights) and, for contrast, under bf16-true; the model's vocabulary is the
  tokenizer's (with the 150k one, sampled ids past the tokenizer's 1,024 decode to nothing, the length
  reward is 0 everywhere and no weight moves, whatever the precision);
- head gradients: `completion_logprobs`' written LM-head backward under bf16 autocast, with the chunk's
  logits kept and recomputed, against autograd through the same autocast ops (relative error under 5e-3;
  before the backward ran under autocast, recomputed logits gave 1.3e-2 on the tiny CPU model).
"""

from __future__ import annotations

import argparse
import functools
import gc
import math
import resource
import sys
import time
from dataclasses import dataclass

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.generation import sampling
from grpo_lightning.core.generation.engines import EagerEngine, SamplingSettings
from grpo_lightning.core.generation.static_engine import StaticEngine, copy_precision
from grpo_lightning.core.rewards.verifiable import completion_text
from grpo_lightning.io.arithmetic_task import arithmetic_problems
from grpo_lightning.io.distributed import close_process_group
from grpo_lightning.io.models import LoraOptions, ModelOptions, apply_lora
from grpo_lightning.io.rows import DEFAULT_SYSTEM_PROMPT, chat_prompt
from grpo_lightning.offline.tiny import build_model, build_tokenizer
from grpo_lightning.training.data import GSM8KDataModule
from grpo_lightning.training.module import GRPOModule

# Qwen2.5-0.5B's vocabulary and width; Llama blocks with an MLP of 2x the width: 465M parameters.
FULL = {"vocab": 151936, "hidden_size": 896, "num_layers": 24, "num_heads": 14}
TINY = {"vocab": 1024, "hidden_size": 64, "num_layers": 2, "num_heads": 4}
# Random-weight models for the rollout comparison: the shapes of Qwen2.5-0.5B's and -1.5B's config.json,
# SmolLM2-135M's (for CPU figures), and a tiny one.
ROLLOUT_SHAPES = {
    "qwen2.5-0.5b": (
        Qwen2ForCausalLM,
        Qwen2Config,
        {
            "hidden_size": 896,
            "intermediate_size": 4864,
            "num_hidden_layers": 24,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
        },
    ),
    "qwen2.5-1.5b": (
        Qwen2ForCausalLM,
        Qwen2Config,
        {
            "hidden_size": 1536,
            "intermediate_size": 8960,
            "num_hidden_layers": 28,
            "num_attention_heads": 12,
            "num_key_value_heads": 2,
        },
    ),
    "smollm2-135m": (
        LlamaForCausalLM,
        LlamaConfig,
        {
            "vocab_size": 49152,
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_hidden_layers": 30,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
        },
    ),
    "tiny": (
        Qwen2ForCausalLM,
        Qwen2Config,
        {
            "vocab_size": 1024,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        },
    ),
}
# Qwen2.5-Instruct's generation_config.json: what `generate` would apply unless told otherwise.
QWEN_GENERATION_CONFIG = {
    "do_sample": True,
    "repetition_penalty": 1.1,
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
}


@dataclass
class StepTimes:
    generate: float = 0.0
    reference: float = 0.0
    step: float = 0.0
    tokens: int = 0


class TimedGRPOModule(GRPOModule):
    """GRPOModule that records, per training step, where the time goes."""

    def on_fit_start(self) -> None:
        super().on_fit_start()
        self.times: list[StepTimes] = []
        self.rollouts.sample = self._timed(self.rollouts.sample, "generate")
        self.update.frozen_logprobs = self._timed(self.update.frozen_logprobs, "reference")

    def _now(self) -> float:
        return now(self.device.type)

    def training_step(self, batch, batch_idx):
        self.times.append(StepTimes())
        start = self._now()
        loss = super().training_step(batch, batch_idx)
        self.times[-1].step = self._now() - start
        return loss

    def _timed(self, fn, field: str):
        """`fn`, its time in a training step added to that step's `field` (and the sampled tokens)."""

        def timed(*args, **kwargs):
            start = self._now()
            out = fn(*args, **kwargs)
            if self.trainer.training and self.times:
                times = self.times[-1]
                setattr(times, field, getattr(times, field) + self._now() - start)
                if field == "generate":
                    times.tokens += int(out[0].completion_mask.sum())
            return out

        return timed


def now(device: str) -> float:
    """The clock, once the device has finished what was queued."""
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def peak_memory_gib(device: str) -> float:
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # the process's peak RSS (KiB on Linux)


def run(name: str, args: argparse.Namespace, shape: dict, tokenizer, lora: bool) -> dict:
    gpu = not args.cpu
    gc.collect()  # the previous run's models, so that its memory does not count in this run's peak
    if gpu:
        torch.cuda.empty_cache()
    torch.manual_seed(0)
    model = build_model(shape["vocab"], shape["hidden_size"], shape["num_layers"], shape["num_heads"])
    model.config.eos_token_id = model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = model.generation_config.pad_token_id = tokenizer.pad_token_id
    if lora:
        model.to(torch.bfloat16)  # the frozen base; PEFT creates the adapters in float32
    params = sum(p.numel() for p in model.parameters())
    grpo = GRPOConfig(
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        beta=0.04,
        learning_rate=1e-6,
        micro_batch_size=args.micro_batch_size,
        preflight=False,
    )
    module = TimedGRPOModule(
        model,
        tokenizer=tokenizer,
        grpo=grpo,
        lora=LoraOptions(r=16) if lora else None,
        model_options=ModelOptions(gradient_checkpointing=True),
    )
    if lora:  # as configs/lora_1.5b_24gb.yaml: a frozen bf16 base, float32 adapters, bf16-mixed compute
        strategy, precision = "auto", "bf16-mixed"
    else:  # FSDP2, world size 1: float32 shards, bf16 all-gathers and compute, a sharded reference
        strategy = ModelParallelStrategy(
            data_parallel_size=1, tensor_parallel_size=1, process_group_backend=None if gpu else "gloo"
        )
        precision = "bf16-mixed"
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    trainer = L.Trainer(
        accelerator="gpu" if gpu else "cpu",
        devices=1,
        strategy=strategy,
        precision=precision,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    data = GSM8KDataModule(source="arithmetic", batch_size=args.batch_size, val_size=8, arithmetic_size=200)
    trainer.fit(module, data)
    measured = module.times[1:] or module.times  # the first step warms up kernels and allocators
    n = len(measured)
    mean = {key: sum(getattr(t, key) for t in measured) / n for key in ("generate", "reference", "step")}
    tokens = sum(t.tokens for t in measured) / n
    engine = module.rollouts.engine
    close_process_group()  # the next run starts its own (or none)
    return {
        "run": name,
        "params_M": params / 1e6,
        "generate_s": mean["generate"],
        "reference_s": mean["reference"],
        "fwd_bwd_opt_s": mean["step"] - mean["generate"] - mean["reference"],
        "step_s": mean["step"],
        "tokens_per_s": tokens / mean["step"],
        "gen_tokens_per_s": tokens / mean["generate"],
        "peak_GiB": peak_memory_gib("cuda" if gpu else "cpu"),
        "static": int(isinstance(engine, StaticEngine)),  # 1: the static-cache engine generated
        "recompiles": getattr(engine, "recompiles", 0),
    }


# ----------------------------------------------------------------------------------------- rollouts
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


# ----------------------------------------------------------------------------------------- numerics
@dataclass
class Check:
    name: str
    passed: bool
    numbers: str


def tiny_policy(shape: dict, tokenizer, device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model(shape["vocab"], shape["hidden_size"], shape["num_layers"], shape["num_heads"])
    model.config.eos_token_id = model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.to(device)


def check_on_policy(
    shape: dict, tokenizer, device: str, completions: int, length: int, static: bool
) -> Check:
    """`static`: sampled by `StaticEngine` (its copy as under `bf16-mixed`, compiled on GPU), else by the
    eager path under autocast; scored by `completion_logprobs` of the float32 weights under autocast either
    way, against the log-prob the engine reports for each token (`Rollout.sampler_logprobs`)."""
    model = tiny_policy(shape, tokenizer, device).eval()
    special = set(tokenizer.all_special_ids)
    suppressed = [i for i in range(0, shape["vocab"], 2) if i not in special]
    model.generation_config.update(**QWEN_GENERATION_CONFIG, suppress_tokens=suppressed)
    texts = [
        tokenizer.apply_chat_template(
            chat_prompt(row["question"], DEFAULT_SYSTEM_PROMPT), tokenize=False, add_generation_prompt=True
        )
        for row in arithmetic_problems(4, seed=1)
    ]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    torch.manual_seed(0)
    with torch.autocast(device, dtype=torch.bfloat16):
        settings = {"max_new_tokens": length, "pad_token_id": tokenizer.pad_token_id}
        if static:
            engine = StaticEngine(
                SamplingSettings(**settings, eos_token_ids=(tokenizer.eos_token_id,), share_prompt=True),
                precision=copy_precision("bf16-mixed"),
                compile=device == "cuda",
            )
            generate = engine.generate
        else:
            eager = SamplingSettings(**settings, eos_token_ids=(tokenizer.eos_token_id,))
            generate = functools.partial(sampling.generate_completions, settings=eager)
        rollout = generate(
            model, enc["input_ids"], enc["attention_mask"], num_generations=completions // len(texts)
        )
        T = rollout.completion_ids.size(1)
        with torch.no_grad():
            scored, _ = sampling.completion_logprobs(model, rollout.input_ids, rollout.attention_mask, T)
            logits = model(input_ids=rollout.input_ids, attention_mask=rollout.attention_mask).logits
    mask = rollout.completion_mask.bool()  # [B, T]
    diff = (rollout.sampler_logprobs - scored)[mask].abs()
    probs = logits[:, -T - 1 : -1].float().softmax(-1)  # [B, T, V] the raw policy at each sampled position
    expected = probs[..., suppressed].sum(-1)[mask].mean().item()  # its mass on the suppressed tokens
    is_suppressed = torch.isin(rollout.completion_ids, torch.tensor(suppressed, device=device))
    observed = is_suppressed[mask].float().mean().item()
    n = int(mask.sum())
    tolerance = 5 * math.sqrt(expected * (1 - expected) / n) + 0.01  # tokens of a row are not independent
    passed = diff.max().item() < 0.1 and diff.mean().item() < 0.01 and abs(observed - expected) < tolerance
    numbers = (
        f"{n} tokens: |sampled - scored log-prob| max {diff.max().item():.2e} mean {diff.mean().item():.2e}, "
        f"share above 0.1 {(diff > 0.1).float().mean().item():.4f}; suppressed tokens sampled "
        f"{observed:.3f}, the raw policy's mass on them {expected:.3f} (+-{tolerance:.3f})"
    )
    path = "static copy as under bf16-mixed" if static else "eager, autocast"
    return Check(f"on-policy sampling (Qwen-like generation config), {path}", passed, numbers)


def check_lora_small_updates(device: str, tiny: bool) -> Check:
    """LoRA B at scale 1e-4, 1e-3, 1e-2 on 2 layers of Qwen2.5-0.5B's width (a bf16 base, float32 adapters,
    bf16 autocast): the static engine's copy reproduces >= 0.99 of the scorer's log-prob change from the
    base at each scale (a copy with the adapters merged into bf16 weights kept 0.4-0.5 of it at 1e-4 on
    CPU)."""
    config = Qwen2Config(
        vocab_size=4096,
        tie_word_embeddings=True,
        **{**ROLLOUT_SHAPES["qwen2.5-0.5b"][2], "num_hidden_layers": 2},
    )
    torch.manual_seed(0)
    with torch.device(device):
        policy = apply_lora(Qwen2ForCausalLM(config).to(torch.bfloat16), LoraOptions(r=16))
    rows, length = (4, 48) if tiny else (16, 128)
    ids = torch.randint(3, 4096, (rows, length), device=device)  # [B, P+T]
    engine = StaticEngine(
        SamplingSettings(max_new_tokens=8, eos_token_ids=(1,), pad_token_id=0),
        precision=copy_precision("bf16-mixed"),
    )

    def scored(model) -> torch.Tensor:
        with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16):
            return sampling.completion_logprobs(model, ids, torch.ones_like(ids), length // 2)[0].flatten()

    shares = []
    for scale in (0.0, 1e-4, 1e-3, 1e-2):
        with torch.no_grad():
            for name, weight in policy.named_parameters():
                if "lora_B" in name:
                    weight.copy_(torch.randn_like(weight) * scale)
        engine.weights_changed()
        engine.refresh(policy, torch.device(device))
        if scale == 0.0:
            base_policy, base_copy = scored(policy), scored(engine.copy.model)
            continue
        change, reproduced = scored(policy) - base_policy, scored(engine.copy.model) - base_copy
        shares.append(float(reproduced @ change / (change @ change)))
    numbers = ", ".join(f"{s:.4f} at {scale:g}" for s, scale in zip(shares, (1e-4, 1e-3, 1e-2), strict=True))
    return Check(
        "LoRA updates kept in the static copy", min(shares) >= 0.99, f"share of the change: {numbers}"
    )


def check_weights_move(shape: dict, tokenizer, device: str) -> list[Check]:
    """The shipped one-GPU config's lr and warm-up, 2 steps: the share of trainable weights (the input
    embedding aside, whose rows of unseen tokens get no gradient) that changed."""
    checks = []
    for precision, dtype, expect_moving in (
        ("bf16-mixed", torch.float32, True),
        ("bf16-true", torch.bfloat16, False),
    ):
        # The tokenizer's vocabulary: ids it does not know would decode to nothing (see the docstring).
        model = tiny_policy({**shape, "vocab": len(tokenizer)}, tokenizer, "cpu").to(dtype)
        module = GRPOModule(
            model,
            tokenizer=tokenizer,
            reward_funcs=[lambda completions, **kw: [len(completion_text(c)) / 10 for c in completions]],
            grpo=GRPOConfig(
                num_generations=4,
                max_completion_length=16,
                learning_rate=1e-6,
                warmup_steps=10,
                epsilon_high=0.28,
                log_completions_every=0,
                preflight=False,
                generation_backend="eager",  # the optimizer's precision is checked here, not the rollouts
            ),
        )
        before = {n: p.detach().clone() for n, p in model.named_parameters() if "embed_tokens" not in n}
        trainer = L.Trainer(
            accelerator="cpu" if device == "cpu" else "gpu",
            devices=1,
            precision=precision,
            max_steps=2,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            num_sanity_val_steps=0,
        )
        data = GSM8KDataModule(source="arithmetic", batch_size=2, val_size=8, arithmetic_size=200)
        trainer.fit(module, data)
        after = dict(module.policy.named_parameters())
        moved = sum(int((after[n].detach().to(w.device, w.dtype) != w).sum()) for n, w in before.items())
        share = moved / sum(w.numel() for w in before.values())
        passed = share > 0.9 if expect_moving else True  # bf16-true is the contrast, reported only
        label = "shipped" if expect_moving else "contrast"
        checks.append(
            Check(f"weights move, {precision} ({label})", passed, f"{share:.1%} of the weights changed")
        )
    return checks


def check_head_gradients(shape: dict, device: str) -> list[Check]:
    """The LM head's written backward under bf16 autocast against autograd through the same ops."""
    torch.manual_seed(0)
    V, H, rows = shape["vocab"], shape["hidden_size"], 256
    head = torch.nn.Linear(H, V, bias=False, device=device)
    torch.nn.init.normal_(head.weight, std=4 / math.sqrt(H))  # logits of a few units, as a trained model's
    hidden = torch.randn(1, rows + 1, H, device=device)
    targets = torch.randint(0, V, (1, rows), device=device)
    ids = torch.cat([torch.zeros(1, 1, dtype=torch.long, device=device), targets], 1)  # [1, rows + 1]
    weights = torch.randn(1, rows, device=device)

    class HeadOnly(torch.nn.Module):
        config = LlamaConfig(vocab_size=V, hidden_size=H, num_attention_heads=1)  # no logit transform

        def __init__(self, h):
            super().__init__()
            self.h = h

        def get_decoder(self):
            return lambda **kwargs: type("O", (), {"last_hidden_state": self.h})()

        def get_output_embeddings(self):
            return head

    h_ref = hidden.clone().requires_grad_()
    with torch.autocast(device, dtype=torch.bfloat16):
        logits = (h_ref[:, :-1] @ head.weight.T).float()  # [1, rows, V]
    ref = logits.log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)
    (ref * weights).sum().backward()
    expected = h_ref.grad, head.weight.grad.clone()
    checks = []
    for path, elements in (("kept", rows * V), ("recomputed", rows * V // 4)):
        head.weight.grad = None
        h = hidden.clone().requires_grad_()
        with torch.autocast(device, dtype=torch.bfloat16):
            lp, _ = sampling.completion_logprobs(
                HeadOnly(h), ids, torch.ones_like(ids), rows, max_logits_elements=elements
            )
        (lp * weights).sum().backward()
        errors = [
            ((g - e).norm() / e.norm()).item()
            for g, e in zip((h.grad, head.weight.grad), expected, strict=True)
        ]
        checks.append(
            Check(
                f"head gradient under bf16 autocast, {path} logits",
                max(errors) < 5e-3,
                f"relative error: hidden {errors[0]:.2e}, weight {errors[1]:.2e}",
            )
        )
    return checks


def numerics(args: argparse.Namespace, shape: dict, tokenizer) -> list[Check]:
    device = "cpu" if args.cpu else "cuda"
    completions, length = (8, 8) if args.tiny else (64, 256)  # on a GPU, ~16k sampled tokens
    checks = [
        check_on_policy(shape, tokenizer, device, completions, length, static) for static in (False, True)
    ]
    checks.append(check_lora_small_updates(device, args.tiny))
    checks += check_weights_move(shape, tokenizer, device)
    checks += check_head_gradients(shape, device)
    return checks


def table(rows: list[dict]) -> str:
    headers = list(rows[0])
    cells = [[f"{v:.3f}" if isinstance(v, float) else str(v) for v in row.values()] for row in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="run on CPU (gloo process group)")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model and short rollouts")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch_size", type=int, default=8, help="prompts per step")
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--max_completion_length", type=int, default=256)
    parser.add_argument("--micro_batch_size", type=int, default=16)
    parser.add_argument(
        "--only", choices=["throughput", "rollouts", "numerics"], help="one part; default all"
    )
    parser.add_argument("--rollout_shapes", help="comma-separated ROLLOUT_SHAPES; default the two Qwen2.5")
    parser.add_argument("--rollout_backends", help="comma-separated eager, static, compiled")
    parser.add_argument("--rollout_dtype", help="bfloat16 (GPU default) or float32 (CPU default)")
    parser.add_argument("--rollout_prompts", type=int, default=8)
    parser.add_argument("--rollout_generations", type=int, default=8)
    parser.add_argument("--prompt_tokens", type=int, default=150)
    parser.add_argument("--new_tokens", type=int, default=256)
    parser.add_argument("--rollout_calls", type=int, default=3, help="timed calls after the warm-up call")
    args = parser.parse_args()
    args.rollout_shapes = args.rollout_shapes or ("tiny" if args.tiny else "qwen2.5-0.5b,qwen2.5-1.5b")
    args.rollout_backends = args.rollout_backends or ("eager,static" if args.cpu else "eager,compiled")
    args.rollout_dtype = args.rollout_dtype or ("float32" if args.cpu else "bfloat16")
    if args.tiny:
        args.steps, args.batch_size, args.num_generations = min(args.steps, 2), 2, 2
        args.max_completion_length, args.micro_batch_size = 8, 4
        args.rollout_prompts, args.rollout_generations, args.prompt_tokens = 2, 2, 12
        args.new_tokens, args.rollout_calls = 8, 2
    if not args.cpu and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: pass --cpu (and --tiny for a quick run)")
    shape = TINY if args.tiny else FULL
    texts = [row["question"] + "\n" + row["answer"] for row in arithmetic_problems(2000)]
    tokenizer = build_tokenizer(texts, vocab_size=min(shape["vocab"], 1024))
    start = time.perf_counter()
    device = "cpu" if args.cpu else torch.cuda.get_device_name()
    print(f"\nGRPO GPU check: {device}, torch {torch.__version__}")
    if args.only in (None, "throughput"):
        rows = [
            run("fsdp2-bf16", args, shape, tokenizer, lora=False),
            run("lora-bf16", args, shape, tokenizer, lora=True),
        ]
        print(
            f"\nthroughput: {args.steps} steps of {args.batch_size} prompts x {args.num_generations} "
            f"completions x {args.max_completion_length} tokens (means over steps 2..)"
        )
        print(table(rows))
    checks = []
    if args.only in (None, "rollouts"):
        rows, checks = rollouts(args)
        print(
            f"\nrollouts: {args.rollout_prompts} prompts x {args.rollout_generations} completions, "
            f"{args.prompt_tokens} prompt tokens, exactly {args.new_tokens} new tokens, "
            f"{args.rollout_dtype}, means over {args.rollout_calls} calls after the warm-up call"
        )
        print(table(rows))
    failed = False
    if args.only in (None, "numerics"):
        checks += numerics(args, shape, tokenizer)
    if checks:
        print("\nchecks:")
        for check in checks:
            print(f"  {'PASS' if check.passed else 'FAIL'}  {check.name}: {check.numbers}")
        failed = not all(check.passed for check in checks)
    print(f"total {time.perf_counter() - start:.0f} s")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
