"""GPU checks on a random ~0.5B model (150k vocabulary): throughput of bf16 FSDP2 and LoRA steps, and the
numerics that only show on a GPU in bf16.

    bash scripts/gpu_check.sh                      # one GPU, all three parts
    bash scripts/gpu_check.sh --only rollouts      # eager vs static-cache rollouts alone
    bash scripts/gpu_check.sh --only numerics      # the numeric checks alone
    bash scripts/gpu_check.sh --cpu --tiny         # the same code paths on CPU in seconds (tests run this)

No network: the tokenizer is trained on generated arithmetic problems and the model has random weights,
so the figures are about throughput, memory and numerics, not learning.

The parts, each in a file of its own: gpu_check_throughput.py (bf16 FSDP2 and LoRA steps),
gpu_check_rollouts.py (the rollout engines side by side), gpu_check_numerics.py (PASS/FAIL checks);
gpu_check_shared.py holds the models' shapes, the clock and the checks' record.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from gpu_check_numerics import numerics
from gpu_check_rollouts import rollouts
from gpu_check_shared import FULL, TINY
from gpu_check_throughput import run

from grpo_lightning.io.arithmetic_task import arithmetic_problems
from grpo_lightning.offline.tiny import build_tokenizer


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
