"""Does SmolLM2-135M learn to use the calculator, and does it do better than the tool-free demo in the same
training time? `scripts/demo.py` on `configs/demo_arithmetic_calculator.yaml` (three worked tool exchanges
before each question, the shaping reward for a call) and on `configs/demo_arithmetic.yaml`, each from
`--seeds` seeds with the same CPU-second budget (no wall-clock limit, so other jobs on the machine change
the minutes, not the steps) and the same held-out rows.

Per run: the steps and training CPU seconds; the tool calls per sample and the accuracy of the sampled
completions by step (means over blocks of `--block` steps); the greedy held-out accuracy and share of
answers calling the tool, before and after training. Each arm is one `scripts/demo.py` process; its
summary and curves are read back from `--out/<arm>`.

    python benchmarks/tool_learning.py                                    # 3 seeds, 600 CPU s, 100 rows
    python benchmarks/tool_learning.py --seeds 1 --cpu_seconds 60 --val_size 8 --arms calculator
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARMS = {"calculator": "configs/demo_arithmetic_calculator.yaml", "tool-free": "configs/demo_arithmetic.yaml"}


def newest(folder: str, pattern: str) -> dict:
    """The newest `pattern` file of `folder` (scripts/demo.py writes `summary-1.json` beside an earlier
    `summary.json`), read."""
    with open(max(glob.glob(os.path.join(folder, pattern)), key=os.path.getmtime), encoding="utf-8") as f:
        return json.load(f)


def run_arm(arm: str, args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    """The per-seed summaries and curves of one arm's `scripts/demo.py` run."""
    folder = os.path.join(REPO, args.out, arm)
    command = [
        sys.executable,
        "scripts/demo.py",
        "--config",
        ARMS[arm],
        "--seeds",
        str(args.seeds),
        "--cpu_seconds",
        str(args.cpu_seconds),
        f"--data.val_size={args.val_size}",
        f"--trainer.default_root_dir={folder}",
        f"--trainer.logger.init_args.save_dir={folder}",
    ]
    subprocess.run(command, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    summary, curves = newest(folder, "summary*.json"), newest(folder, "curves*.json")
    return summary.get("runs", [summary]), curves["runs"]


def blocks(series: list[list[float]], size: int) -> str:
    """The values of `(step, value)` pairs averaged over blocks of `size` steps."""
    values = [value for _, value in series]
    means = [sum(values[i : i + size]) / len(values[i : i + size]) for i in range(0, len(values), size)]
    return ", ".join(f"{m:.2f}" for m in means) or "-"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 of each arm")
    parser.add_argument("--cpu_seconds", type=float, default=600.0, help="training budget of each run")
    parser.add_argument("--val_size", type=int, default=100, help="held-out rows, greedy, before and after")
    parser.add_argument("--block", type=int, default=5, help="steps per mean in the by-step columns")
    parser.add_argument("--out", default=os.path.join("runs", "tool_learning"))
    args = parser.parse_args()
    print(f"load {os.getloadavg()[0]:.2f} at the start", flush=True)
    columns = [
        "arm",
        "seed",
        "steps",
        "train CPU s",
        f"calls per sample, by {args.block} steps",
        f"sampled accuracy, by {args.block} steps",
        "held-out accuracy",
        "held-out calls",
    ]
    rows = []
    for arm in args.arms:
        summaries, curves = run_arm(arm, args)
        for s, curve in zip(summaries, curves, strict=True):
            rows.append(
                [
                    arm,
                    str(s["seed"]),
                    str(s["steps"]),
                    f"{s['train_cpu_seconds']:.0f}",
                    blocks(curve["train_calls"], args.block),
                    blocks(curve["train_accuracy"], args.block),
                    f"{s['accuracy_before']:.2f} -> {s['accuracy_after']:.2f}",
                    f"{s['tool_calls_before']:.2f} -> {s['tool_calls_after']:.2f}",
                ]
            )
        print(f"{arm} done, load {os.getloadavg()[0]:.2f}", flush=True)
    print("| " + " | ".join(columns) + " |\n" + "|---" * len(columns) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
