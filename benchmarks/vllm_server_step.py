"""Seconds per GRPO-shaped step with rollouts from a `vllm serve` process against the colocated vLLM engine,
on CPU, and the disk plane's seconds per push and per GB.

A step here is what a training step costs around its rollout: `--prompts` x `--generations` completions of
up to `--length` tokens sampled, the policy's log-probs of them (forward and backward of the mean log-prob),
an AdamW step, and the push of the new weights before the next rollout. Columns:

- `server`: one server (`cli.py vllm-serve`'s command) pinned to the last core (`taskset`), the trainer to
  the others; rollouts over HTTP, weights over the disk plane (`/dev/shm`).
- `colocated`: the colocated engine (`generation_backend: vllm`) in this process, on every core.

    LD_PRELOAD=.venv-vllm/lib/libiomp5.so .venv-vllm/bin/python benchmarks/vllm_server_step.py \\
        --model models/smollm2-135m-instruct --steps 3
    ... --columns server      # one column

It prints one line per step and a table of medians (seconds of wall-clock: the machine's load matters; run
it on a quiet machine and say its `uptime`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from grpo_lightning.core.generation.logprobs import completion_logprobs  # noqa: E402
from grpo_lightning.core.generation.sampling import SamplingSettings  # noqa: E402
from grpo_lightning.io.vllm_serve import serve_command, stop, wait_ready  # noqa: E402

SERVER_PORT = 18731


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", required=True, help="a local model folder (SmolLM2: cli.py prepare-smollm2)"
    )
    parser.add_argument("--columns", default="server,colocated")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per column, after one warm-up")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--server-flags", default="", help="more vllm serve flags, space-separated")
    return parser.parse_args()


def step(engine, model, optimizer, prompts, args) -> dict[str, float]:
    """One step: rollout, forward + backward, AdamW, the push (inside the next rollout's refresh)."""
    times = {}
    start = time.perf_counter()
    engine.refresh(model, torch.device("cpu"))
    times["push"] = time.perf_counter() - start
    start = time.perf_counter()
    rollout = engine.generate(model, prompts, torch.ones_like(prompts), num_generations=args.generations)
    times["rollout"] = time.perf_counter() - start
    start = time.perf_counter()
    logprobs, _ = completion_logprobs(
        model, rollout.input_ids, rollout.attention_mask, rollout.completion_ids.size(1)
    )
    (-(logprobs * rollout.completion_mask).sum() / rollout.completion_mask.sum()).backward()
    optimizer.step()
    optimizer.zero_grad()
    engine.weights_changed()
    times["update"] = time.perf_counter() - start
    times["step"] = sum(times.values())
    times["tokens"] = float(rollout.completion_mask.sum())
    return times


def run_column(column: str, args: argparse.Namespace, settings: SamplingSettings) -> list[dict[str, float]]:
    from grpo_lightning.core.generation.vllm_engine import VLLMEngine, VLLMOptions
    from grpo_lightning.core.generation.vllm_server import VLLMServerEngine
    from grpo_lightning.core.generation.vllm_server_options import VLLMServerOptions

    cores = sorted(os.sched_getaffinity(0))
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    prompts = torch.randint(10, 1000, (args.prompts, 32), generator=torch.Generator().manual_seed(0))
    max_len = 32 + args.length
    process = None
    if column == "server":
        extra = ["--dtype", "float32", "--enforce-eager", "--max-model-len", str(max_len + 64)]
        extra += args.server_flags.split()
        command, env = serve_command(args.model, port=SERVER_PORT, extra=extra)
        command = ["taskset", "-c", str(cores[-1]), *command] if len(cores) > 1 else command
        process = subprocess.Popen(command, env=env, start_new_session=True, stdout=subprocess.DEVNULL)
        if len(cores) > 1:
            os.sched_setaffinity(0, cores[:-1])
            torch.set_num_threads(len(cores) - 1)
        wait_ready(f"http://127.0.0.1:{SERVER_PORT}", process, 900)
        engine = VLLMServerEngine(
            settings, VLLMServerOptions(port=SERVER_PORT, weight_plane="disk"), max_len=max_len
        )
    else:
        engine = VLLMEngine(settings, VLLMOptions(enforce_eager=True), max_model_len=max_len + 64)
    try:
        results = []
        for i in range(args.steps + 1):
            times = step(engine, model, optimizer, prompts, args)
            metrics = engine.metrics()
            times["push_gb"] = metrics.get("push_bytes", 0.0) / 1e9
            print(f"{column} step {i}{' (warm-up)' if i == 0 else ''}: " + ", ".join(
                f"{k} {v:.2f}" for k, v in times.items()), flush=True)  # fmt: skip
            if i:
                results.append(times)
        return results
    finally:
        engine.close()
        if process is not None:
            stop(process)
            os.sched_setaffinity(0, cores)


def main() -> int:
    args = parse_args()
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(args.model)
    eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    settings = SamplingSettings(
        max_new_tokens=args.length, eos_token_ids=tuple(eos), pad_token_id=config.pad_token_id or 0
    )
    table = {}
    for column in args.columns.split(","):
        table[column] = run_column(column, args, settings)
    print("\n| column | step s | rollout s | update s | push s | push GB | push GB/s |")
    print("|---|---|---|---|---|---|---|")
    for column, rows in table.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        rate = med["push_gb"] / med["push"] if med["push"] > 0 and med["push_gb"] else float("nan")
        print(
            f"| {column} | {med['step']:.2f} | {med['rollout']:.2f} | {med['update']:.2f} "
            f"| {med['push']:.2f} | {med['push_gb']:.3f} | {rate:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
