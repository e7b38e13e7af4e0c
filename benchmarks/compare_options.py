"""Dynamic sampling and token-level step credit, measured on the learning demo against the plain run.

Runs of one config, each from the same seed and the same initial weights:

- `baseline`: the config as it is (outcome rewards only);
- `dynamic_sampling`: plus `grpo.dynamic_sampling` (DAPO: groups whose completions are all right or all
  wrong are dropped and more prompts sampled until the update is full);
- `dynamic_sampling_total`: the same, but judging groups on the total reward (accuracy + format) instead of
  the accuracy alone (`grpo.dynamic_sampling_metric: null`);
- `step_credit`: plus the `step_reward` function and `grpo.step_credit` (the tokens of wrong arithmetic
  steps get a negative advantage).

Each run reports the held-out accuracy (greedy, the data module's held-out rows, strict `#### N` and
lenient) before and after, and every `--eval_every` optimizer steps in between, with the training
wall-clock (evaluations excluded) and the generation rounds so far; then one markdown table compares them,
including how many optimizer steps and seconds each run needed to reach the baseline's final accuracy.

    python benchmarks/compare_options.py --config configs/demo_arithmetic.yaml --device cuda
    python benchmarks/compare_options.py --config configs/demo_arithmetic.yaml --max_steps 10 \\
        --set data.val_size=32 --variants baseline dynamic_sampling
    python benchmarks/compare_options.py --report runs/compare_options/seed*.json  # seeds in one table

The objects are built straight from the YAML (no LightningCLI, so no jsonargparse needed), and the repo
root goes on `sys.path`: the script runs from a plain checkout where the package is not installed. Run it
from the repo root, where the config's relative paths (`models/...`) point. `--set key.sub=value` overrides
any config entry (the value is read as YAML). The trainer's logger, callbacks, `max_time` and checkpointing
and GRPO's pre-flight report are left out: every run gets the same number of optimizer steps and writes
nothing but `--out`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import lightning as L  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402

from grpo_lightning.core.config import GRPOConfig  # noqa: E402
from grpo_lightning.core.metrics import GSM8KAccuracy  # noqa: E402
from grpo_lightning.io.models import LoraOptions, ModelOptions  # noqa: E402
from grpo_lightning.training.data import GSM8KDataModule, collate_rows  # noqa: E402
from grpo_lightning.training.module import GRPOModule  # noqa: E402

STEP_REWARD = "grpo_lightning.core.steps.step_reward"
VARIANTS = ("baseline", "dynamic_sampling", "dynamic_sampling_total", "step_credit")
UPDATE_KEYS = (  # logged as train/<key>
    "reward",
    "rewards/accuracy_reward",
    "rewards/format_reward",
    "rewards/step_reward",
    "completion_length",
)
TRAINER_LEFT_OUT = ("logger", "callbacks", "max_time", "enable_checkpointing", "default_root_dir")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--config", default=os.path.join(REPO, "configs", "demo_arithmetic.yaml"))
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config entry, e.g. model.grpo.temperature=1.0 (repeatable)",
    )
    parser.add_argument("--max_steps", type=int, help="optimizer steps per run (default: the config's)")
    parser.add_argument("--device", help="Lightning accelerator: cpu, cuda, ... (default: the config's)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--step_credit", type=float, default=0.5, help="grpo.step_credit of that run")
    parser.add_argument("--eval_every", type=int, default=10, help="optimizer steps between evaluations")
    parser.add_argument("--out", default=os.path.join("runs", "compare_options", "results.json"))
    parser.add_argument(
        "--report",
        nargs="+",
        metavar="RESULTS_JSON",
        help="run nothing: one table of the runs in these --out files (several seeds), with means",
    )
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------------------ config
def load_config(path: str, overrides: list[str]) -> dict:
    with open(path, encoding="utf-8") as f:
        config = yaml.safe_load(f)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE")
        *parents, leaf = key.split(".")
        node = config
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = yaml.safe_load(value)
    return config


def variant_overrides(variant: str, config: dict, step_credit: float) -> list[str]:
    if variant == "dynamic_sampling":
        return ["model.grpo.dynamic_sampling=true"]
    if variant == "dynamic_sampling_total":
        return ["model.grpo.dynamic_sampling=true", "model.grpo.dynamic_sampling_metric=null"]
    if variant == "step_credit":
        funcs = [f for f in config["model"].get("reward_funcs", []) if f != STEP_REWARD] + [STEP_REWARD]
        return [f"model.reward_funcs=[{', '.join(funcs)}]", f"model.grpo.step_credit={step_credit}"]
    return []


def instantiate(spec: str | dict):
    """A dotted name (`pkg.mod.obj`), or `{class_path, init_args}` as LightningCLI configs write them."""
    path, kwargs = (spec, None) if isinstance(spec, str) else (spec["class_path"], spec.get("init_args", {}))
    module, _, name = path.rpartition(".")
    obj = getattr(importlib.import_module(module), name)
    return obj if kwargs is None else obj(**kwargs)


def build(
    config: dict, args: argparse.Namespace, callbacks: list[L.Callback], max_steps: int | None = None
) -> tuple[L.Trainer, GRPOModule]:
    L.seed_everything(config.get("seed_everything", 0), workers=True)
    model = dict(config["model"])
    lora = model.pop("lora", None)
    reward_funcs = model.pop("reward_funcs", None)
    module = GRPOModule(
        grpo=GRPOConfig(**{**model.pop("grpo", {}), "preflight": False}),  # a report, not training time
        model_options=ModelOptions(**model.pop("model_options", {})),
        lora=LoraOptions(**lora) if lora else None,
        reward_funcs=None if reward_funcs is None else [instantiate(f) for f in reward_funcs],
        **model,
    )
    trainer_args = {k: v for k, v in config.get("trainer", {}).items() if k not in TRAINER_LEFT_OUT}
    trainer_args.update(limit_val_batches=0, enable_progress_bar=False)  # evaluations are the callback's
    if args.device is not None:
        trainer_args["accelerator"] = args.device
    if (max_steps := max_steps or args.max_steps) is not None:
        trainer_args["max_steps"] = max_steps
    root = os.path.dirname(os.path.abspath(args.out))  # where an interrupted run leaves its checkpoint
    trainer = L.Trainer(
        **trainer_args, logger=False, enable_checkpointing=False, callbacks=callbacks, default_root_dir=root
    )
    return trainer, module


# ------------------------------------------------------------------------------------------ measuring
@torch.no_grad()
def heldout_accuracy(module: GRPOModule, data: GSM8KDataModule) -> dict[str, float]:
    """Greedy accuracy on the held-out rows, as `GRPOModule.validation_step` computes it."""
    rows, size = data.val_rows, data.hparams.val_batch_size
    metric = GSM8KAccuracy(k=1)
    for start in range(0, len(rows), size):
        batch = collate_rows(rows[start : start + size], data.hparams.system_prompt)
        _, completions = module.sample(batch["prompt"], 1, do_sample=False)
        metric.update(completions, batch["answer"])
    results = metric.compute()
    return {"strict": float(results["accuracy_strict"]), "lenient": float(results["accuracy"])}


class Progress(L.Callback):
    """Generation rounds, training seconds without the evaluations, the share of groups without signal,
    the held-out accuracy every `eval_every` optimizer steps, and the rewards and length each update saw."""

    def __init__(self, data: GSM8KDataModule, eval_every: int) -> None:
        self.data, self.eval_every = data, eval_every
        self.rounds, self.curve, self.no_signal = 0, [], []  # no_signal: (share, rounds) per update
        self.updates: list[dict] = []
        self.eval_seconds = 0.0
        self.start: float | None = None

    def seconds(self) -> float:
        return time.perf_counter() - self.start - self.eval_seconds

    def on_train_batch_start(self, trainer: L.Trainer, module: GRPOModule, batch, batch_idx) -> None:
        if self.start is None:  # from the first batch: the reward audit and the pre-flight are not training
            self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, module: GRPOModule, outputs, batch, batch_idx) -> None:
        self.rounds += 1
        if module.last_rollout is None:  # dynamic sampling is still collecting groups
            return
        metrics = trainer.callback_metrics
        # What each update trained on (under dynamic sampling: the informative groups only).
        trained = {k: round(float(metrics[f"train/{k}"]), 4) for k in UPDATE_KEYS if f"train/{k}" in metrics}
        self.updates.append({"step": trainer.global_step, **trained})
        if "train/dynamic_sampling/frac_dropped" in metrics:
            rounds = 1 + float(metrics["train/dynamic_sampling/extra_rounds"])
            self.no_signal.append((float(metrics["train/dynamic_sampling/frac_dropped"]), rounds))
        else:
            self.no_signal.append((float(metrics["train/frac_reward_zero_std"]), 1.0))
        step = trainer.global_step
        if step % self.eval_every == 0 and step < trainer.max_steps:
            self.evaluate(module, step)

    def on_train_end(self, trainer: L.Trainer, module: GRPOModule) -> None:
        self.train_seconds = self.seconds()
        self.evaluate(module, trainer.global_step)

    def evaluate(self, module: GRPOModule, step: int) -> None:
        start = time.perf_counter()
        accuracy = heldout_accuracy(module, self.data)
        self.eval_seconds += time.perf_counter() - start
        point = {"step": step, "rounds": self.rounds, "seconds": round(self.seconds(), 1), **accuracy}
        self.curve.append(point)
        print(f"  step {step}: {self.curve[-1]}", file=sys.stderr, flush=True)


def run_variant(variant: str, config: dict, args: argparse.Namespace, before: dict | None) -> dict:
    config = load_config(args.config, args.set + variant_overrides(variant, config, args.step_credit))
    data = GSM8KDataModule(**config.get("data", {}))
    data.setup("fit")
    progress = Progress(data, args.eval_every)
    trainer, module = build(config, args, [progress])
    if before is None:  # the same weights and greedy decoding: one measurement serves every run
        module.configure_model()
        before = heldout_accuracy(module.to(trainer.strategy.root_device), data)
    progress.curve.append({"step": 0, "rounds": 0, "seconds": 0.0, **before})
    print(f"{variant}: before {before}", file=sys.stderr, flush=True)
    trainer.fit(module, data)
    shares, weights = zip(*progress.no_signal, strict=True)
    return {
        "variant": variant,
        "heldout_problems": len(data.val_rows),
        "before": before,
        "after": {k: progress.curve[-1][k] for k in ("strict", "lenient")},
        "steps": trainer.global_step,
        "rounds": progress.rounds,
        "train_seconds": round(progress.train_seconds, 1),
        "frac_no_signal": sum(s * w for s, w in zip(shares, weights, strict=True)) / sum(weights),
        "curve": progress.curve,
        "updates": progress.updates,
    }


# ------------------------------------------------------------------------------------------ report
def first_reaching(curve: list[dict], target: float) -> str:
    for point in curve:
        if point["strict"] >= target:
            return f"{point['step']} ({point['seconds']:.0f} s)"
    return "not reached"


def report(results: list[dict]) -> str:
    target = results[0]["after"]["strict"]  # the first run's final accuracy, the baseline's by default
    lines = [
        f"| run | strict acc. before → after | lenient before → after | optimizer steps | generation rounds "
        f"| groups w/o signal | train s | s / step | steps (s) to strict ≥ {target:.3f} |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        b, a = r["before"], r["after"]
        lines.append(
            f"| {r['variant']} | {b['strict']:.3f} → {a['strict']:.3f} "
            f"| {b['lenient']:.3f} → {a['lenient']:.3f} "
            f"| {r['steps']} | {r['rounds']} | {r['frac_no_signal']:.0%} | {r['train_seconds']:.0f} "
            f"| {r['train_seconds'] / max(1, r['steps']):.1f} | {first_reaching(r['curve'], target)} |"
        )
    return "\n".join(lines)


def seeds_report(paths: list[str]) -> str:
    """The runs of several `--out` files, one row per variant and seed, then each variant's mean."""
    runs = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
        seed = load_config(saved["config"], saved["overrides"]).get("seed_everything", 0)
        runs += [(r["variant"], seed, r) for r in saved["results"]]
    steps = sorted({p["step"] for _, _, r in runs for p in r["curve"]})
    lines = [
        f"| run | seed | strict acc. at step {' / '.join(map(str, steps))} | lenient after "
        "| generation rounds | groups w/o signal | train s | s / step |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def row(name: str, seed: str, curve: dict, figures: list[float]) -> str:
        strict = " / ".join(f"{curve[s]:.3f}" if s in curve else "-" for s in steps)
        lenient, rounds, no_signal, seconds, per_step = figures
        return (
            f"| {name} | {seed} | {strict} | {lenient:.3f} | {rounds:.0f} | {no_signal:.0%} | {seconds:.0f} "
            f"| {per_step:.1f} |"
        )

    for variant in dict.fromkeys(v for v, _, _ in runs):  # in the order first seen
        curves, figures = [], []
        for seed, r in sorted(((seed, r) for v, seed, r in runs if v == variant), key=lambda item: item[0]):
            curves.append({p["step"]: p["strict"] for p in r["curve"]})
            figures.append(
                [r["after"]["lenient"], r["rounds"], r["frac_no_signal"], r["train_seconds"]]
                + [r["train_seconds"] / r["steps"]]
            )
            lines.append(row(variant, str(seed), curves[-1], figures[-1]))
        if len(figures) > 1:
            shared = [s for s in steps if all(s in curve for curve in curves)]
            mean_curve = {s: sum(curve[s] for curve in curves) / len(curves) for s in shared}
            means = [sum(column) / len(figures) for column in zip(*figures, strict=True)]
            lines.append(row(f"**{variant}**", "mean", mean_curve, means))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.report:
        print(seeds_report(args.report))
        return
    config = load_config(args.config, args.set)
    # One untimed step first, or the first run alone would pay the process's one-time costs (kernels,
    # allocator, autograd threads): on CPU they came to several times a tiny model's step.
    trainer, module = build(config, args, [], max_steps=1)
    trainer.fit(module, GSM8KDataModule(**config.get("data", {})))
    results, before = [], None
    for variant in args.variants:
        results.append(run_variant(variant, config, args, before))
        before = results[-1]["before"]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(
            {
                "config": args.config,
                "overrides": args.set,
                "max_steps": args.max_steps,
                "device": args.device,
                "torch": torch.__version__,
                "results": results,
            },
            f,
            indent=2,
        )
    print(
        f"{args.config} {' '.join(args.set)}; max_steps {args.max_steps or 'as configured'}; seed "
        f"{config.get('seed_everything', 0)}; {results[0]['heldout_problems']} held-out problems, greedy"
    )
    print(report(results))
    print(f"curves and figures: {args.out}")


if __name__ == "__main__":
    main()
