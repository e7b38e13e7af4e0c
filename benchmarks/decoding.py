"""Rollout decoding on this machine: which engine `generation_backend: auto` should pick for its kind of
device, and what a decoding step costs as rows finish.

Three engines decode the same chat prompts (the first GSM8K training questions with our system prompt, the
model's own chat template) with the same sampling settings:

- `eager`: `generate` on the policy with a dynamic KV cache (`EagerEngine`);
- `static`: `StaticEngine`, the inference copy with one static KV cache, uncompiled;
- `compiled`: `StaticEngine(compile=True)`: its decoding step through `torch.compile` (inductor; CUDA graphs
  on GPU), one graph per cache shape.

Every row decodes exactly `--new_tokens` tokens (EOS suppressed), so that each call makes the same number
of decoding steps. Per engine and per row count (`--generations` per prompt x `--prompts`): the first call
alone (the copy built, caches allocated, the step compiled: the warm-up a run pays once), then the median
over `--calls` calls of wall and CPU milliseconds per decoding step, the engines interleaved call by call
(so that a change in the machine's load hits all alike). `warm-up + N calls` adds the first call to N
timed ones: the engine that wins over a run of N rollouts.

The row sweep answers whether finished rows cost anything: a decoding step that costs about the same for
2 rows as for 16 reads its weights once per step whatever the batch (memory-bound), and dropping finished
rows from the batch would save little of it.

    python benchmarks/decoding.py --model models/smollm2-135m-instruct --threads 2
    python benchmarks/decoding.py --model models/smollm2-135m-instruct --threads 1 --generations 4 --prompts 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from grpo_lightning.core.generation.engines import EagerEngine, PromptEncoder  # noqa: E402
from grpo_lightning.core.generation.sampling import SamplingSettings, stop_token_ids  # noqa: E402
from grpo_lightning.core.generation.static_engine import StaticEngine  # noqa: E402
from grpo_lightning.io.rows import DEFAULT_SYSTEM_PROMPT  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GSM8K_TRAIN = os.path.join(ROOT, "data/gsm8k/train.jsonl")
ENGINES = ("eager", "static", "compiled")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a causal LM folder (from_pretrained)")
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"some of {','.join(ENGINES)}")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per call (default 2)")
    parser.add_argument("--generations", default="1,2,4,8", help="G values, rows = prompts x G (1,2,4,8)")
    parser.add_argument("--new_tokens", type=int, default=64, help="tokens decoded per row (64)")
    parser.add_argument("--calls", type=int, default=3, help="timed calls per engine and G after the first")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (2)")
    parser.add_argument("--temperature", type=float, default=0.5)
    args = parser.parse_args(argv)
    args.engines = args.engines.split(",")
    unknown = sorted(set(args.engines) - set(ENGINES))
    if unknown:
        parser.error(f"--engines: unknown {unknown}; choose from {list(ENGINES)}")
    args.generations = [int(g) for g in args.generations.split(",")]
    return args


def chat_prompts(count: int) -> list[list[dict[str, str]]]:
    with open(GSM8K_TRAIN, encoding="utf-8") as f:
        rows = [json.loads(next(f)) for _ in range(count)]
    system = {"role": "system", "content": DEFAULT_SYSTEM_PROMPT}
    return [[system, {"role": "user", "content": row["question"]}] for row in rows]


def build(name: str, settings: SamplingSettings):
    if name == "eager":
        return EagerEngine(settings)
    return StaticEngine(settings, compile=name == "compiled")


def measure(args: argparse.Namespace) -> dict[tuple[str, int], dict[str, float]]:
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    ids, mask = PromptEncoder(tokenizer).encode(chat_prompts(args.prompts), "cpu")
    settings = SamplingSettings(
        max_new_tokens=args.new_tokens,
        min_new_tokens=args.new_tokens,
        eos_token_ids=tuple(stop_token_ids(model, tokenizer)),
        pad_token_id=tokenizer.pad_token_id,
        temperature=args.temperature,
        share_prompt=True,
    )
    engines = {name: build(name, settings) for name in args.engines}
    results = {}
    for G in args.generations:
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
        first: dict[str, float] = {}
        for call in range(args.calls + 1):
            for name, engine in engines.items():
                start, cpu = time.perf_counter(), time.process_time()
                rollout = engine.generate(model, ids, mask, num_generations=G)
                seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
                steps = rollout.completion_ids.size(1)
                if call == 0:
                    first[name] = seconds
                else:
                    samples[name].append((1000 * seconds / steps, 1000 * cpu / steps))
        for name, rows in samples.items():
            ms = statistics.median(s[0] for s in rows)
            results[name, G] = {
                "rows": args.prompts * G,
                "first_call_s": first[name],
                "ms_per_step": ms,
                "cpu_ms_per_step": statistics.median(s[1] for s in rows),
                "call_s": ms * args.new_tokens / 1000,
            }
        print(f"G={G} done", file=sys.stderr, flush=True)
    return results


def table(args: argparse.Namespace, results: dict[tuple[str, int], dict[str, float]]) -> str:
    lines = [
        "| engine | rows | first call s | wall ms / step | CPU ms / step | warm-up + 10 calls, s |",
        "|---|---|---|---|---|---|",
    ]
    for (name, _), r in sorted(results.items(), key=lambda item: (item[0][1], ENGINES.index(item[0][0]))):
        ten = r["first_call_s"] + 10 * r["call_s"]
        lines.append(
            f"| {name} | {r['rows']} | {r['first_call_s']:.2f} | {r['ms_per_step']:.1f} | "
            f"{r['cpu_ms_per_step']:.1f} | {ten:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print(
        f"{args.model}: {args.prompts} prompts x G in {args.generations}, {args.new_tokens} tokens, "
        f"{args.threads} threads, torch {torch.__version__}, load {os.getloadavg()[0]:.2f}"
    )
    print(table(args, measure(args)))
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
