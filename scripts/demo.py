"""The offline learning demo: held-out accuracy before, GRPO fine-tuning, held-out accuracy after.

    python scripts/demo.py --config configs/demo_arithmetic.yaml             # one run, the config's seed
    python scripts/demo.py --config configs/demo_arithmetic.yaml --seeds 3   # seeds 0, 1, 2 and the mean gain

Everything else comes from the YAML (the same file `cli.py fit` takes; further `--key=value` arguments
override it as they do there); the summary goes to `<default_root_dir>/summary.json` (`summary-1.json`, ...
where an earlier run's is: never over it), written after each seed so that a failing seed keeps the ones
before it. Accuracies are greedy
on the data module's held-out rows, with their binomial standard errors; the standard error of a gain is
paired over the problems (`grpo_lightning.demo.heldout`). The accuracy before training is measured
once: every seed starts from the same weights and greedy decoding does not depend on the seed. Training
time is given in wall-clock and in CPU seconds of this process (`CPUTimeBudget`, the config's training
budget): on a machine shared with other jobs the CPU seconds divided by the thread count stand in for the
wall-clock of a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# OpenMP workers that sleep instead of spinning while they wait: on a machine shared with other jobs, a
# spinning worker whose sibling was descheduled burns CPU doing nothing. Measured (BENCHMARKS.md, "Learning
# per CPU-minute"): the same generation took 17-57 CPU s with 2 spinning threads under load, 3.8-4.1 CPU s
# with passive ones, 4.2 CPU s with one thread. Read once, when torch loads OpenMP: before `import torch`.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from grpo_lightning.cli import build_cli  # noqa: E402
from grpo_lightning.demo.cpu_budget import CPUTimeBudget  # noqa: E402
from grpo_lightning.demo.curves import RewardHistory, write_curves  # noqa: E402
from grpo_lightning.demo.heldout import binomial_se, heldout_correct, paired_gain_se, seed_spread  # noqa: E402
from grpo_lightning.demo.outputs import run_script, unused_paths, write_json  # noqa: E402
from grpo_lightning.training.run_checks import check_fit  # noqa: E402

WRITER = "scripts/demo.py"  # the mark of its summaries


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    # No abbreviations: `--seed 3` is not `--seeds 3` (three runs); it goes on to the CLI, which names it.
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument(
        "--seeds",
        type=int,
        help="N runs, seeds 0..N-1, and their mean gain (default: one run, the config's seed)",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    parser.add_argument(
        "--cpu_seconds",
        type=float,
        help="train for this many CPU seconds of this process and drop the config's wall-clock limit: the "
        "same training on a machine shared with other jobs (default: the config's CPUTimeBudget)",
    )
    return parser.parse_known_args(argv)


def evaluate(module, data, device: torch.device) -> dict:
    """Per-problem greedy results on the held-out rows, and how long they took."""
    start, cpu_start = time.perf_counter(), time.process_time()
    hp = data.hparams
    results = heldout_correct(module.to(device), data.val_rows, hp.val_batch_size, hp.system_prompt)
    results["seconds"] = time.perf_counter() - start
    results["cpu_seconds"] = time.process_time() - cpu_start
    return results


def share(values: list) -> float:
    return sum(values) / len(values)


def budget_of(trainer) -> CPUTimeBudget:
    """The config's `CPUTimeBudget` callback, or a new one without a limit that only measures."""
    for callback in trainer.callbacks:
        if isinstance(callback, CPUTimeBudget):
            return callback
    trainer.callbacks.insert(0, CPUTimeBudget())
    return trainer.callbacks[0]


def cpu_multiplies_bf16() -> bool:
    """Whether this CPU has bf16 matrix instructions (x86 avx512_bf16 or AMX), on which bf16-mixed halved the
    demo's CPU seconds per step. Elsewhere bf16 matmuls are emulated; not measured, so the demo trains in the
    float32 it was also measured in."""
    checks = (
        getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    )
    return any(check is not None and check() for check in checks)


def run(cli_args: list[str], before: dict | None, cpu_seconds: float | None) -> tuple[dict, dict, str, dict]:
    """One fine-tuning run (`cpu_seconds`: its budget, else the config's): its summary, the before-training
    results (measured if `before` is None), the run's root folder and its curves (`write_curves`)."""
    cli = build_cli(cli_args, run=False)
    on_cpu = cli.trainer.strategy.root_device.type == "cpu"
    if on_cpu and str(cli.trainer.precision).startswith("bf16") and not cpu_multiplies_bf16():
        # The time budget would buy fewer, slower steps than float32's: train as the float32 runs measured.
        print(
            f"no bf16 matrix instructions on this CPU: trainer.precision=32-true, not {cli.trainer.precision}"
        )
        cli = build_cli([*cli_args, "--trainer.precision=32-true"], run=False)
    trainer, module, data = cli.trainer, cli.model, cli.datamodule
    # Before and after training the same rollout engine decodes, in the trainer's precision (under bf16-mixed
    # the static path's bf16 copy): without it the evaluation before would run in float32.
    module.rollouts.place(trainer.strategy.root_device, trainer.precision)
    budget = budget_of(trainer)
    if cpu_seconds is not None:
        budget.max_cpu_seconds, budget.max_wall_seconds = cpu_seconds, None
    data.setup("fit")
    check_fit(trainer, module, data)  # what fit checks first, before the evaluation's minutes
    if not data.val_rows:  # every number the demo reports is an accuracy on them
        raise ValueError(
            f"--data.val_size {data.hparams.val_size}: the demo measures held-out accuracy before and after "
            "training on the held-out rows, and there are none; give --data.val_size 1 or more, or train "
            "without measuring with cli.py fit"
        )
    if before is None:
        module.configure_model()
        before = evaluate(module, data, trainer.strategy.root_device)
    history = RewardHistory()
    trainer.callbacks.append(history)
    trainer.fit(module, data)
    after = evaluate(module, data, trainer.strategy.root_device)
    summary = {
        "seed": cli.config.get("seed_everything"),
        "heldout_problems": len(after["strict"]),
        "accuracy_before": share(before["strict"]),
        "accuracy_before_se": binomial_se(before["strict"]),
        "accuracy_after": share(after["strict"]),
        "accuracy_after_se": binomial_se(after["strict"]),
        "gain": share(after["strict"]) - share(before["strict"]),
        "gain_se": paired_gain_se(before["strict"], after["strict"]),
        "lenient_accuracy_before": share(before["lenient"]),
        "lenient_accuracy_after": share(after["lenient"]),
        "format_before": share(before["formatted"]),
        "format_after": share(after["formatted"]),
        "tool_calls_before": share(before["called"]),  # answers that called a tool (0 without tools)
        "tool_calls_after": share(after["called"]),
        "completion_length_before": share(before["lengths"]),
        "completion_length_after": share(after["lengths"]),
        "precision": str(trainer.precision),
        "steps": trainer.global_step,
        "train_seconds": round(budget.wall_seconds, 1),
        "train_cpu_seconds": round(budget.cpu_seconds, 1),
        "cpu_budget_seconds": budget.max_cpu_seconds,
        "wall_budget_seconds": budget.max_wall_seconds,
        "threads": torch.get_num_threads(),
        "eval_seconds": round(before["seconds"] + after["seconds"], 1),
    }
    accuracy = [
        (0, summary["accuracy_before"], summary["accuracy_before_se"]),
        (trainer.global_step, summary["accuracy_after"], summary["accuracy_after_se"]),
    ]
    curve = {
        "seed": summary["seed"],
        "reward": history.reward,
        "accuracy": accuracy,
        "train_accuracy": history.accuracy,
        "train_calls": history.calls,
    }
    return summary, before, trainer.default_root_dir, curve


def describe(s: dict) -> str:
    return (
        f"seed {s['seed']}: strict accuracy {s['accuracy_before']:.1%} ± {s['accuracy_before_se']:.1%} -> "
        f"{s['accuracy_after']:.1%} ± {s['accuracy_after_se']:.1%}, gain {100 * s['gain']:+.1f} ± "
        f"{100 * s['gain_se']:.1f} points (paired SE, {s['heldout_problems']} held-out problems); "
        f"{s['steps']} steps in {s['train_cpu_seconds']:.0f} CPU s ({s['threads']} threads, "
        f"{s['precision']}) / "
        f"{s['train_seconds']:.0f} s wall of training"
    )


def main(argv: list[str]) -> None:
    args, cli_args = parse_args(argv)
    for flag in ("seeds", "threads", "cpu_seconds"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise ValueError(f"--{flag} {getattr(args, flag)}: must be >= 1")
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    seeds = [None] if args.seeds is None else list(range(args.seeds))
    runs, curves, before, paths = [], [], None, None
    for seed in seeds:
        seed_args = [] if seed is None else [f"--seed_everything={seed}"]
        summary, before, root, curve = run(cli_args + seed_args, before, args.cpu_seconds)
        runs.append(summary)
        curves.append(curve)
        print(describe(summary), flush=True)
        # Never over an earlier run's files: summary-1.json and curves-1.png beside summary.json, ...
        paths = paths or unused_paths(root, ["summary.json", "curves.png", "curves.json"])
        result = summarize(runs, start)
        write_json(paths[0], result, WRITER)  # after each seed: a later one that fails keeps these
    if len(runs) > 1:
        gains = result["mean_gain_points"]
        print(
            f"mean strict gain over seeds {', '.join(str(s['seed']) for s in runs)}: "
            f"{gains['mean']:+.1f} points "
            f"(sd {gains['std']:.1f} over seeds, SE of the mean {gains['se']:.1f}; "
            f"{gains['min']:+.1f}..{gains['max']:+.1f})"
        )
    print(json.dumps(result, indent=2))
    print(f"summary written to {paths[0]}; TensorBoard: tensorboard --logdir {root}")
    picture = write_curves(paths[1], curves)
    if picture is None:
        curves_json = paths[2]
        print(f"curves written to {curves_json}; to draw them: pip install -e '.[plot]' and run again")
    else:
        print(f"reward and held-out accuracy over steps: {os.path.abspath(picture)}")


def summarize(runs: list[dict], start: float) -> dict:
    """One run's summary, or every seed's with their mean gain; the time since `start`."""
    result = runs[0] if len(runs) == 1 else {"runs": runs}
    if len(runs) > 1:
        gains = seed_spread([100 * s["gain"] for s in runs])
        result["mean_gain_points"] = gains
        result["mean_train_cpu_seconds"] = share([s["train_cpu_seconds"] for s in runs])
    return {**result, "whole_seconds": round(time.perf_counter() - start, 1)}


if __name__ == "__main__":
    run_script(main, sys.argv[1:])
