"""Does a small model learn to use the calculator? `configs/gsm8k_calculator_smollm2.yaml` trained for
`--max_steps` steps from each of `--seeds`, with its shaping reward for a well-formed call
(`tool_call_reward`, weight 0.1, as verl's GSM8K tool example adds) and without it (weight 0), each
ending in one greedy validation through the same multi-turn loop.

Per run and step: the calls per sample (`train/tools/call_frequency`) and the mean reward; per run, the
held-out accuracy of the final validation and its tool results per sample (from its transcripts). Each run
is `cli.py fit` in a subprocess, its metrics read back from a CSV logger under `--out`.

    python benchmarks/tool_learning.py                       # 3 seeds x with/without shaping, 3 steps each
    python benchmarks/tool_learning.py --seeds 0 --max_steps 10 --shaping on
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join("configs", "gsm8k_calculator_smollm2.yaml")
WEIGHTS = {"on": "[1.0, 0.2, 0.1]", "off": "[1.0, 0.2, 0.0]"}  # accuracy, format, the call's shaping


def fit(seed: int, shaping: str, args: argparse.Namespace) -> tuple[list[dict], float]:
    """The metrics rows of one run, and its wall-clock seconds."""
    folder = os.path.join(args.out, f"shaping_{shaping}_seed_{seed}")
    command = [
        sys.executable,
        "cli.py",
        "fit",
        "--config",
        CONFIG,
        f"--seed_everything={seed}",
        f"--trainer.max_steps={args.max_steps}",
        f"--trainer.val_check_interval={args.max_steps}",
        f"--trainer.default_root_dir={folder}",
        "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
        f"--trainer.logger.save_dir={folder}",
        "--trainer.logger.name=csv",
        f"--model.reward_weights={WEIGHTS[shaping]}",
        f"--results.path={folder}/val_results.jsonl",
        "--results.overwrite=true",
        f"--data.val_size={args.val_size}",
        "--model.grpo.preflight=false",
    ]
    started = time.perf_counter()
    subprocess.run(command, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - started
    versions = glob.glob(os.path.join(REPO, folder, "csv", "version_*", "metrics.csv"))  # one per run here
    metrics = max(versions, key=lambda path: int(path.split("version_")[-1].split(os.sep)[0]))
    with open(metrics, encoding="utf-8") as f:
        return list(csv.DictReader(f)), seconds


def validation_calls(folder: str) -> float:
    """Tool results per validation sample, from the transcripts of the results file."""
    with open(os.path.join(folder, "val_results.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    return sum(m["role"] == "tool" for r in rows for m in r.get("transcript") or []) / max(len(rows), 1)


def column(rows: list[dict], name: str) -> list[float]:
    return [float(row[name]) for row in rows if row.get(name)]


def joined(values: list[float], digits: int) -> str:
    return ", ".join(f"{v:.{digits}f}" for v in values) or "-"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--shaping", nargs="+", default=["on", "off"], choices=WEIGHTS)
    parser.add_argument("--max_steps", type=int, default=3)
    parser.add_argument("--val_size", type=int, default=8, help="held-out rows of the final validation")
    parser.add_argument("--out", default=os.path.join("runs", "tool_learning"))
    args = parser.parse_args()
    print(f"load {os.getloadavg()[0]:.2f} at the start")
    columns = ["shaping", "seed", "calls per sample, by step", "reward, by step", "val accuracy", "val calls"]
    print("| " + " | ".join([*columns, "minutes"]) + " |\n" + "|---" * 7 + "|")
    for shaping in args.shaping:
        for seed in args.seeds:
            rows, seconds = fit(seed, shaping, args)
            calls = column(rows, "train/tools/call_frequency")
            rewards = column(rows, "train/reward")
            accuracy = column(rows, "val/accuracy") or column(rows, "val/accuracy_reward")
            val_calls = [validation_calls(os.path.join(REPO, args.out, f"shaping_{shaping}_seed_{seed}"))]
            cells = [shaping, str(seed), *(joined(v, 3) for v in (calls, rewards, accuracy, val_calls))]
            print("| " + " | ".join([*cells, f"{seconds / 60:.1f}"]) + " |", flush=True)
    print(f"load {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
