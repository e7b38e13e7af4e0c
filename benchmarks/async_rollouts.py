"""Samples per second of GRPO training with asynchronous rollouts (`async_rollouts.max_staleness`) against
one `vllm serve` process, on CPU: the demo's arithmetic task and options (SmolLM2-135M-Instruct, groups of 8,
64 new tokens, temperature 0.5, dapo, clip-higher 0.28, lr 1e-5), float32.

The server (`cli.py vllm-serve`'s command) is pinned to the last core (`taskset`), the trainer to the
others, so that sampling and training can overlap; weights go over the disk plane (`/dev/shm`). For each
`max_staleness` of `--staleness` and each seed of `--seeds`, one `fit` of `--steps` updates (the same
number of samples trained at every staleness) on a fresh copy of the policy; samples per second count the
completions trained on after the first `--warmup` updates, over the wall time they took. With `--val-size`
> 0, the held-out accuracy after the run (`val/accuracy` of the built-in arithmetic problems, greedy), for
the learning comparison, and once before the first run's training (greedy: the same for every seed).

    LD_PRELOAD=.venv-vllm/lib/libiomp5.so .venv-vllm/bin/python benchmarks/async_rollouts.py \\
        --model models/smollm2-135m-instruct --steps 20 --staleness 0,1,2
    ... --staleness 1 --correction none       # the uncorrected run at staleness 1
    ... --seeds 0,1,2 --val-size 100           # held-out accuracy over 3 seeds

It prints one line per run and a table (wall-clock: the machine's load matters; run it on a quiet machine
and give its `uptime`). The ceiling of the speed-up on this split is 2x (sampling and training each on one
core, taking as long).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import lightning as L  # noqa: E402
import torch  # noqa: E402

from grpo_lightning.core.config import GRPOConfig  # noqa: E402
from grpo_lightning.core.rewards.verifiable import accuracy_reward, format_reward  # noqa: E402
from grpo_lightning.io.vllm_serve import serve_command, stop, wait_ready  # noqa: E402
from grpo_lightning.training.data import GSM8KDataModule  # noqa: E402
from grpo_lightning.training.module import GRPOModule  # noqa: E402

SERVER_PORT = 18741


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", required=True, help="a local model folder (SmolLM2: cli.py prepare-smollm2)"
    )
    parser.add_argument("--staleness", default="0,1,2", help="max_staleness values, comma-separated")
    parser.add_argument("--correction", default="importance_sampling", help="off_policy_correction")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--steps", type=int, default=20, help="updates per run, at every staleness")
    parser.add_argument("--warmup", type=int, default=2, help="updates left out of the timing")
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=2, help="prompts per step")
    parser.add_argument("--val-size", type=int, default=0, help="held-out problems scored after each run")
    parser.add_argument("--server-flags", default="", help="more vllm serve flags, space-separated")
    return parser.parse_args()


class Throughput(L.Callback):
    """When each update ended and how many completions it trained on."""

    def __init__(self) -> None:
        self.updates: list[tuple[float, int]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        record = pl_module.last_rollout
        if record is not None:  # no update while the pipeline fills
            self.updates.append((time.perf_counter(), len(record.completions)))


def validate(module: GRPOModule, data: GSM8KDataModule) -> float:
    """The held-out accuracy of the module's current weights (greedy)."""
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)
    return float(trainer.validate(module, data, verbose=False)[0].get("val/accuracy", float("nan")))


def run(args: argparse.Namespace, staleness: int, seed: int, before: bool) -> dict[str, float]:
    L.seed_everything(seed, verbose=False)
    grpo = GRPOConfig(
        num_generations=args.generations,
        max_completion_length=args.length,
        temperature=0.5,
        learning_rate=1e-5,
        loss_type="dapo",
        epsilon_high=0.28,
        beta=0.0,
        preflight=False,
        log_completions_every=0,
        generation_backend="vllm_server",
        vllm_server_port=SERVER_PORT,
        vllm_server_weight_plane="disk",
        max_staleness=staleness,
        off_policy_correction=args.correction,
    )
    module = GRPOModule(args.model, reward_funcs=[accuracy_reward, format_reward], grpo=grpo)
    data = GSM8KDataModule(
        source="arithmetic",
        batch_size=args.batch_size,
        val_size=max(args.val_size, 1),
        arithmetic_size=(args.steps + 4) * args.batch_size + max(args.val_size, 1),
    )
    untrained = validate(module, data) if before and args.val_size > 0 else None
    throughput = Throughput()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=args.steps,  # updates: the first max_staleness batches fill the pipeline and make none
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[throughput],
    )
    trainer.fit(module, data)
    timed = throughput.updates[args.warmup :]
    seconds = timed[-1][0] - throughput.updates[args.warmup - 1][0] if len(timed) > 1 else float("nan")
    result = {
        "samples_per_second": sum(n for _, n in timed) / seconds,
        "hidden": float(trainer.callback_metrics.get("train/async/generation_hidden_frac", float("nan"))),
        "reward": float(trainer.callback_metrics.get("train/reward", float("nan"))),
    }
    if untrained is not None:
        result["val_accuracy_before"] = untrained
    if args.val_size > 0:
        result["val_accuracy"] = validate(module, data)
    module.rollouts.close()
    return result


def main() -> int:
    args = parse_args()
    cores = sorted(os.sched_getaffinity(0))
    extra = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "1024", *args.server_flags.split()]
    command, env = serve_command(args.model, port=SERVER_PORT, extra=extra)
    if len(cores) > 1:
        command = ["taskset", "-c", str(cores[-1]), *command]
    process = subprocess.Popen(command, env=env, start_new_session=True, stdout=subprocess.DEVNULL)
    try:
        if len(cores) > 1:
            os.sched_setaffinity(0, cores[:-1])
            torch.set_num_threads(len(cores) - 1)
        wait_ready(f"http://127.0.0.1:{SERVER_PORT}", process, 900)
        table: dict[int, list[dict[str, float]]] = {}
        for staleness in (int(k) for k in args.staleness.split(",")):
            for seed in (int(s) for s in args.seeds.split(",")):
                result = run(args, staleness, seed, before=not table)
                print(f"max_staleness {staleness} seed {seed}: {result}", flush=True)
                table.setdefault(staleness, []).append(result)
    finally:
        stop(process)
    print(f"\n| max_staleness | samples/s | vs 0 | hidden share | val accuracy ({args.correction}) |")
    print("|---|---|---|---|---|")
    base = statistics.median(r["samples_per_second"] for r in table.get(0, [{"samples_per_second": 0}]))
    for staleness, rows in table.items():
        rate = statistics.median(r["samples_per_second"] for r in rows)
        accuracy = [r["val_accuracy"] for r in rows if "val_accuracy" in r]
        acc = f"{statistics.mean(accuracy):.3f} over {len(accuracy)}" if accuracy else "-"
        speedup = f"{rate / base:.2f}x" if base else "-"
        hidden = f"{statistics.median(r['hidden'] for r in rows):.2f}" if staleness else "-"
        print(f"| {staleness} | {rate:.2f} | {speedup} | {hidden} | {acc} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
