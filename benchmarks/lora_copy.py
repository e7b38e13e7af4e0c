"""LoRA in the static engine's inference copy: adapters kept unmerged (what ships) against merged into the
copy's weights, on the CPU: decoding speed, and how much of a small adapter update each keeps.

A random model of Qwen2.5-0.5B's width (hidden 896, MLP 4864, 14 heads, 2 KV heads; `--layers` of its 24,
vocabulary `--vocab`, tied), LoRA r=16 alpha 32 on every linear layer, the shipped LoRA config's numerics
under `--dtype bfloat16` (a bf16 base, float32 adapters, the copy as under `bf16-mixed`: bf16 weights under
bf16 autocast) or all float32 under `--dtype float32`. Three engines decode the same prompts:

- `unmerged`: `StaticEngine` on the PEFT policy, the copy holding the adapters as PEFT layers, each LoRA
  linear layer computing base(x) + scaling * B(A(x)): two more small matmuls per layer;
- `merged`: `StaticEngine` on the policy merged with PEFT's `merge_and_unload`, base + scaling * B @ A in
  the base's dtype: one matmul per layer, as a copy with merged adapters decodes;
- `eager`: `generate` on the PEFT policy itself (dynamic cache), for reference.

Speed: `--prompts` x `--generations` rows, `--prompt_tokens` prompt tokens, exactly `--new_tokens` new
tokens per row; per engine one warm-up call, then the median over `--calls` calls of tokens per second
and wall and CPU milliseconds per decoding step, engines interleaved call by call (so that a change in
the machine's load hits all three alike). Fidelity: LoRA's B at scales 1e-4, 1e-3, 1e-2, and the share
of the scorer's log-prob change from B = 0 (the PEFT policy under the same autocast, as the loss scores
it, on fixed tokens) that each copy's log-probs reproduce, <change_copy, change_scorer> / |change_scorer|^2.

    python benchmarks/lora_copy.py                      # bf16, 4 layers, 4 x 4 rows, 32 new tokens
    python benchmarks/lora_copy.py --dtype float32
    python benchmarks/lora_copy.py --layers 24 --calls 5 --threads 2
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torch  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from grpo_lightning.core.generation.engines import EagerEngine, SamplingSettings  # noqa: E402
from grpo_lightning.core.generation.inference_copy import copy_precision  # noqa: E402
from grpo_lightning.core.generation.logprobs import completion_logprobs
from grpo_lightning.core.generation.static_engine import StaticEngine  # noqa: E402
from grpo_lightning.io.models import LoraOptions, apply_lora  # noqa: E402

QWEN_0_5B = {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
}
SCALES = (1e-4, 1e-3, 1e-2)


def policy_of(args: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=args.vocab, num_hidden_layers=args.layers, tie_word_embeddings=True, **QWEN_0_5B
    )
    base = Qwen2ForCausalLM(config).to(getattr(torch, args.dtype))
    return apply_lora(base, LoraOptions(r=16, alpha=32)).eval()  # PEFT keeps the adapters in float32


def set_adapters(policy: torch.nn.Module, scale: float) -> None:
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, weight in policy.named_parameters():
            if "lora_B" in name:
                weight.copy_(torch.randn(weight.shape, generator=g) * scale)


def speeds(args: argparse.Namespace, policy, precision) -> dict[str, dict[str, float]]:
    """Median tokens/s, wall and CPU ms per decoding step of each engine, interleaved call by call."""
    set_adapters(policy, 1e-3)
    merged = copy.deepcopy(policy).merge_and_unload()
    settings = SamplingSettings(
        max_new_tokens=args.new_tokens,
        min_new_tokens=args.new_tokens,
        eos_token_ids=(1,),
        pad_token_id=0,
        share_prompt=True,
    )
    engines = {
        "unmerged": (StaticEngine(settings, precision=precision), policy),
        "merged": (StaticEngine(settings, precision=precision), merged),
        "eager": (EagerEngine(settings), policy),
    }
    ids = torch.randint(
        3, args.vocab, (args.prompts, args.prompt_tokens), generator=torch.Generator().manual_seed(2)
    )
    autocast = precision.autocast_dtype
    samples = {name: [] for name in engines}
    for call in range(args.calls + 1):  # the first is a warm-up (the copy is built, caches allocated)
        for name, (engine, model) in engines.items():
            start, cpu = time.perf_counter(), time.process_time()
            with torch.autocast(
                "cpu", dtype=torch.bfloat16, enabled=name == "eager" and autocast is not None
            ):
                rollout = engine.generate(model, ids, torch.ones_like(ids), num_generations=args.generations)
            seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
            steps = rollout.completion_ids.size(1)
            if call > 0:
                samples[name].append(
                    (int(rollout.completion_mask.sum()) / seconds, 1000 * seconds / steps, 1000 * cpu / steps)
                )
    return {
        name: {
            "tokens_per_s": statistics.median(s[0] for s in rows),
            "ms_per_step": statistics.median(s[1] for s in rows),
            "cpu_ms_per_step": statistics.median(s[2] for s in rows),
        }
        for name, rows in samples.items()
    }


def fidelity(args: argparse.Namespace, policy, precision) -> dict[str, list[float]]:
    """Per scale, the share of the scorer's log-prob change from B = 0 that each copy reproduces."""
    ids = torch.randint(3, args.vocab, (8, 96), generator=torch.Generator().manual_seed(3))  # [B, P+T]
    autocast = precision.autocast_dtype is not None

    def scored(model) -> torch.Tensor:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return completion_logprobs(model, ids, torch.ones_like(ids), 48)[0].flatten()  # [8*48]

    settings = SamplingSettings(max_new_tokens=1, eos_token_ids=(1,), pad_token_id=0)
    unmerged, merged = (
        StaticEngine(settings, precision=precision),
        StaticEngine(settings, precision=precision),
    )

    def copies() -> dict[str, torch.Tensor]:
        unmerged.weights_changed()
        unmerged.refresh(policy, torch.device("cpu"))
        merged.copy = None  # a merged model is a new policy: its copy is built anew
        merged.refresh(copy.deepcopy(policy).merge_and_unload(), torch.device("cpu"))
        return {
            "scorer": scored(policy),
            "unmerged": scored(unmerged.copy.model),
            "merged": scored(merged.copy.model),
        }

    set_adapters(policy, 0.0)
    base = copies()
    shares = {"unmerged": [], "merged": []}
    for scale in SCALES:
        set_adapters(policy, scale)
        now = copies()
        change = now["scorer"] - base["scorer"]
        for name in shares:
            shares[name].append(float((now[name] - base[name]) @ change / (change @ change)))
    return shares


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--prompt_tokens", type=int, default=64)
    parser.add_argument("--new_tokens", type=int, default=32)
    parser.add_argument("--calls", type=int, default=3, help="timed calls per engine, after one warm-up")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads; default torch's")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    precision = copy_precision("bf16-mixed" if args.dtype == "bfloat16" else None)
    policy = policy_of(args)
    shares = fidelity(args, policy, precision)
    timed = speeds(args, policy, precision)
    print(
        f"LoRA r=16 on Qwen2.5-0.5B's width, {args.layers} layers, vocabulary {args.vocab}, {args.dtype}; "
        f"{args.prompts} x {args.generations} rows, {args.prompt_tokens} prompt + {args.new_tokens} new "
        "tokens; "
        f"medians of {args.calls} calls; {torch.get_num_threads()} threads; load {os.getloadavg()[0]:.1f}"
    )
    print("| engine | tokens/s | ms / step | CPU ms / step | change kept at B ~ 1e-4 / 1e-3 / 1e-2 |")
    print("| --- | --- | --- | --- | --- |")
    for name, row in timed.items():
        kept = " / ".join(f"{s:.3f}" for s in shares[name]) if name in shares else "(the policy itself)"
        print(
            f"| {name} | {row['tokens_per_s']:.1f} | {row['ms_per_step']:.1f} | {row['cpu_ms_per_step']:.1f} "
            f"| {kept} |"
        )


if __name__ == "__main__":
    main()
