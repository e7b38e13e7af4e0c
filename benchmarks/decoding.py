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

`--natural`: rows end where the model ends them, as in training. The demo's rollouts (the built-in
arithmetic problems with the default system prompt, SmolLM2's chat template, `--generations` rows per
prompt, temperature 0.5, up to `--new_tokens` tokens, no minimum), decoded by `eager` and `static` with
finished rows dropped (`compact S`: once at most a share S of a batch of more than 8 rows is live, the
live rows go on alone; `--live_share`, by default the shipped half, takes several) and kept (`keep`:
every row decodes until the longest ends). Each timed call samples the next prompts, with the same seed
for every variant (the variants interleaved call by call); after the first compaction the draws differ,
so the figures are per completion token as well as per call. Before each call the engine is told that
the weights changed, as after an optimizer step: the static engine's time includes refreshing its copy.
`rows / step`: the mean batch of the decoding forwards.

    python benchmarks/decoding.py --model models/smollm2-135m-instruct --threads 2
    python benchmarks/decoding.py --model models/smollm2-135m-instruct --threads 1 --generations 4 --prompts 2
    python benchmarks/decoding.py --model models/smollm2-135m-instruct --threads 2 --natural --generations 8 \
        --calls 8 [--live_share 0.5,0.75]
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

from grpo_lightning.core.generation import sampling  # noqa: E402
from grpo_lightning.core.generation.engines import EagerEngine  # noqa: E402
from grpo_lightning.core.generation.prompts import PromptEncoder  # noqa: E402
from grpo_lightning.core.generation.sampling import SamplingSettings, stop_token_ids  # noqa: E402
from grpo_lightning.core.generation.static_engine import StaticEngine  # noqa: E402
from grpo_lightning.io.arithmetic_task import arithmetic_problems  # noqa: E402
from grpo_lightning.io.rows import DEFAULT_SYSTEM_PROMPT, chat_prompt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GSM8K_TRAIN = os.path.join(ROOT, "data/gsm8k/train.jsonl")
ENGINES = ("eager", "static", "compiled")
NATURAL = ("eager", "static")  # `--natural` compares dropping finished rows or not on the uncompiled engines


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
    parser.add_argument(
        "--natural",
        action="store_true",
        help="rows end at EOS: finished rows dropped or kept (eager, static)",
    )
    parser.add_argument(
        "--live_share",
        default=str(sampling.COMPACT_LIVE_SHARE),
        help=f"--natural: drop finished rows once at most this share is live, or several: 0.5,0.75 "
        f"({sampling.COMPACT_LIVE_SHARE})",
    )
    args = parser.parse_args(argv)
    args.engines = args.engines.split(",")
    unknown = sorted(set(args.engines) - set(ENGINES))
    if unknown:
        parser.error(f"--engines: unknown {unknown}; choose from {list(ENGINES)}")
    args.generations = [int(g) for g in args.generations.split(",")]
    args.live_share = [float(share) for share in args.live_share.split(",")]
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


def natural(args: argparse.Namespace) -> dict[tuple[str, str], dict[str, float]]:
    """Per engine and `compact S` / `keep`: totals over `--calls` timed calls of rows that end at EOS."""
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    G, count = args.generations[0], args.prompts
    problems = arithmetic_problems(count * (args.calls + 1), seed=0)
    encoder = PromptEncoder(tokenizer)
    batches = [
        encoder.encode(
            [chat_prompt(r["question"], DEFAULT_SYSTEM_PROMPT) for r in problems[i : i + count]], "cpu"
        )
        for i in range(0, len(problems), count)
    ]
    settings = SamplingSettings(
        max_new_tokens=args.new_tokens,
        eos_token_ids=tuple(stop_token_ids(model, tokenizer)),
        pad_token_id=tokenizer.pad_token_id,
        temperature=args.temperature,
        share_prompt=True,
    )
    variants = {}
    for name in args.engines:
        for rows in [*(f"compact {share}" for share in args.live_share), "keep"]:
            above = {"compact_above_rows": None} if rows == "keep" else {}
            variants[name, rows] = (
                EagerEngine(settings, **above) if name == "eager" else StaticEngine(settings, **above)
            )
    current: list[tuple[str, str]] = []
    row_steps: dict[tuple[str, str], int] = dict.fromkeys(variants, 0)

    def count_rows(module, args_, kwargs) -> None:  # one decoding forward: one new position per row
        ids = kwargs["input_ids"]
        if ids.size(1) == 1:
            row_steps[current[0]] += ids.size(0)

    totals = {
        key: dict.fromkeys(("wall_s", "cpu_s", "tokens", "steps", "row_steps"), 0.0) for key in variants
    }
    for call, (ids, mask) in enumerate(batches):
        for key, engine in variants.items():
            current[:] = [key]
            if key[1] != "keep":  # what-if: another share than the shipped one
                sampling.COMPACT_LIVE_SHARE = float(key[1].split()[1])
            torch.manual_seed(call)
            engine.weights_changed()  # as after each optimizer step: the static engine refreshes its copy
            start, cpu = time.perf_counter(), time.process_time()
            rollout = engine.generate(model, ids, mask, num_generations=G)
            seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
            if call == 0:  # the warm-up; the static engine's copy exists from here on
                decoder = model if key[0] == "eager" else engine.copy.model
                if key[1] == f"compact {args.live_share[0]}" or key[0] != "eager":
                    decoder.get_decoder().register_forward_pre_hook(count_rows, with_kwargs=True)
                row_steps[key] = 0
                continue
            t = totals[key]
            t["wall_s"] += seconds
            t["cpu_s"] += cpu
            t["tokens"] += int(rollout.completion_mask.sum())
            t["steps"] += rollout.completion_ids.size(1)
        print(f"call {call} done", file=sys.stderr, flush=True)
    for key, t in totals.items():
        t["row_steps"] = row_steps[key]
        t["calls"] = args.calls
        t["rows"] = count * G
    return totals


def natural_table(totals: dict[tuple[str, str], dict[str, float]]) -> str:
    lines = [
        "| engine | finished rows | rows | tokens / call | steps / call | rows / step | wall s / call | "
        "CPU s / call | wall ms / token | CPU ms / token |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (name, rows), t in totals.items():
        calls = t["calls"]
        lines.append(
            f"| {name} | {rows} | {t['rows']} | {t['tokens'] / calls:.0f} | {t['steps'] / calls:.1f} | "
            f"{t['row_steps'] / t['steps']:.1f} | {t['wall_s'] / calls:.2f} | {t['cpu_s'] / calls:.2f} | "
            f"{1000 * t['wall_s'] / t['tokens']:.1f} | {1000 * t['cpu_s'] / t['tokens']:.1f} |"
        )
    return "\n".join(lines)


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
    if args.natural:
        args.engines = [name for name in args.engines if name in NATURAL]
    kind = "up to" if args.natural else "exactly"
    print(
        f"{args.model}: {args.prompts} prompts x G in {args.generations}, {kind} {args.new_tokens} tokens, "
        f"{args.threads} threads, torch {torch.__version__}, load {os.getloadavg()[0]:.2f}"
    )
    print(natural_table(natural(args)) if args.natural else table(args, measure(args)))
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
