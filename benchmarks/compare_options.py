"""Options of the learning demo (dynamic sampling, step credit, any `--set` ablation) against the plain run.

Runs of one config, each from the same seed and the same initial weights:

- `baseline`: the config as it is (outcome rewards only);
- `dynamic_sampling`: plus `grpo.dynamic_sampling` (DAPO: groups whose completions are all right or all
  wrong are dropped and more prompts sampled until the update is full);
- `dynamic_sampling_total`: the same, but judging groups on the total reward (accuracy + format) instead of
  the accuracy alone (`grpo.dynamic_sampling_metric: null`);
- `step_credit`: plus the `step_reward` function and `grpo.step_credit` (the tokens of wrong arithmetic
  steps get a negative advantage).

Each run reports the held-out accuracy (greedy, the data module's held-out rows, strict `#### N` and
lenient) before and after, and every `--eval_every` optimizer steps in between, with the gain's paired
standard error over the problems; its training time without the evaluations in wall-clock and in CPU seconds
of the process (on a machine shared with other jobs, CPU seconds / threads stand in for a quiet machine's
wall-clock); the generation rounds, the share of groups without signal, the share of completions cut at
`max_completion_length` and the share of the step spent generating. One markdown table compares them,
including how many optimizer steps (and CPU seconds) each run needed to reach the first run's final accuracy.

    python benchmarks/compare_options.py --config configs/demo_arithmetic.yaml --device cuda
    python benchmarks/compare_options.py --config configs/demo_arithmetic.yaml --max_steps 10 \\
        --set data.val_size=32 --variants baseline dynamic_sampling
    python benchmarks/compare_options.py --max_steps 15 --variants baseline --label "lr 3e-5" \\
        --set model.grpo.learning_rate=3e-5 --threads 1 --before runs/compare_options/base.json
    python benchmarks/compare_options.py --report runs/compare_options/*.json  # runs and seeds, with means

Ablations of any option: `--set` overrides with a `--label` naming the run in the tables. `--before` takes
the accuracy before training from an earlier `--out` file (the same weights and held-out set: greedy
decoding gives the same answers; a file of another model, data, decoding length, precision or device is
refused), so parallel runs with one thread each (`--threads 1`) do not each pay for it. `--cpu_budget` and
`--wall_budget` (default: the config's `CPUTimeBudget`) stop a run before its training CPU seconds, or its
training wall-clock, would exceed them.

The objects are built straight from the YAML (no LightningCLI, so no jsonargparse needed), and the repo
root goes on `sys.path`: the script runs from a plain checkout where the package is not installed. Run it
from the repo root, where the config's relative paths (`models/...`) point. `--set key.sub=value` overrides
any config entry (the value is read as YAML). The trainer's logger, callbacks, `max_time` and checkpointing
and GRPO's pre-flight report are left out: every run gets the same number of optimizer steps (or the same CPU
budget) and writes nothing but `--out`.

Every flag and each run's options are checked before the first step: every key of the config and of
`--set` must name an option of its section (a Trainer option the script leaves out is refused from `--set`),
and a flag that no chosen run reads (`--step_credit` without the `step_credit` run) is refused. `--out`
never replaces a file silently: an earlier results file of this script only with `--overwrite`, any other
file never. It is written after each run, so a later run that fails leaves the finished ones. `--report`
refuses a file given twice, and two files holding the same run and seed (one run would count as two seeds).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib
import inspect
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
# Sleeping OpenMP workers, or CPU seconds on a shared machine count spinning: see scripts/demo.py.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import lightning as L  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402

from grpo_lightning.core.config import FLAT_NAMES, GRPOConfig  # noqa: E402
from grpo_lightning.demo.cpu_budget import CPUTimeBudget  # noqa: E402
from grpo_lightning.demo.heldout import heldout_correct, paired_gain_se, seed_spread  # noqa: E402
from grpo_lightning.demo.outputs import claim_output, run_script, write_json  # noqa: E402
from grpo_lightning.io.models import LoraOptions, ModelOptions  # noqa: E402
from grpo_lightning.training.data import GSM8KDataModule  # noqa: E402
from grpo_lightning.training.module import GRPOModule  # noqa: E402

STEP_REWARD = "grpo_lightning.core.rewards.steps.step_reward"
DEFAULT_STEP_CREDIT = 0.5  # the step_credit run's grpo.step_credit
VARIANTS = ("baseline", "dynamic_sampling", "dynamic_sampling_total", "step_credit")
UPDATE_KEYS = (  # logged as train/<key>
    "reward",
    "rewards/accuracy_reward",
    "rewards/format_reward",
    "rewards/step_reward",
    "completion_length",
    "frac_truncated",
    "frac_reward_zero_std",
    "generate_seconds",
    "step_seconds",
)
TRAINER_LEFT_OUT = ("logger", "callbacks", "max_time", "enable_checkpointing", "default_root_dir")
CLI_LEFT_OUT = (
    "results",
)  # `cli.py validate`'s results file: the runs here validate through their own evaluation
WRITER = "benchmarks/compare_options.py"  # the mark of its results files
# Data options that leave the held-out problems and their prompts alone: an accuracy measured before
# training holds whatever they are.
DATA_OPTIONS_NOT_HELD_OUT = ("batch_size", "train_size", "val_batch_size", "num_workers")


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
    parser.add_argument(
        "--step_credit", type=float, help=f"grpo.step_credit of that run (default {DEFAULT_STEP_CREDIT})"
    )
    parser.add_argument("--eval_every", type=int, default=10, help="optimizer steps between evaluations")
    parser.add_argument(
        "--cpu_budget",
        type=float,
        help="training CPU seconds per run, at most (default: the config's CPUTimeBudget)",
    )
    parser.add_argument(
        "--wall_budget",
        type=float,
        help="training wall-clock seconds per run, at most (default: the config's CPUTimeBudget)",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--label", help="name the runs in the tables (e.g. what the --set overrides change)")
    parser.add_argument(
        "--before",
        metavar="RESULTS_JSON",
        help="take the accuracy before training from this --out file (same model and held-out set)",
    )
    parser.add_argument("--out", default=os.path.join("runs", "compare_options", "results.json"))
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier results file of this script at --out (never any other file)",
    )
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
        entry = FLAT_NAMES.get(leaf) if parents == ["model", "grpo"] else None
        if entry is not None and not entry.switch:  # a flat name goes to its section, as cli.py files it
            *sections, leaf = entry.path
            parents = [*parents, *sections]
        node = config
        for depth, name in enumerate(parents, start=1):
            node = node.setdefault(name, {})
            if not isinstance(node, dict):
                section = ".".join(parents[:depth])
                raise ValueError(f"--set {item!r}: {section} is {node!r}, not a section of options")
        node[leaf] = yaml.safe_load(value)
    return config


def option_names() -> dict[tuple[str, ...], tuple[str, set[str]]]:
    """The options each section of a config takes here: what takes them, and their names."""

    def arguments(cls: type) -> set[str]:
        return set(inspect.signature(cls).parameters) - {"self", "args", "kwargs"}

    return {
        (): ("this script's config", {"seed_everything", "model", "data", "trainer", *CLI_LEFT_OUT}),
        ("model",): ("GRPOModule", arguments(GRPOModule)),
        ("model", "grpo"): ("GRPOConfig", {f.name for f in dataclasses.fields(GRPOConfig)} | set(FLAT_NAMES)),
        ("model", "model_options"): ("ModelOptions", {f.name for f in dataclasses.fields(ModelOptions)}),
        ("model", "lora"): ("LoraOptions", {f.name for f in dataclasses.fields(LoraOptions)}),
        ("data",): ("GSM8KDataModule", arguments(GSM8KDataModule)),
        ("trainer",): ("lightning.Trainer", arguments(L.Trainer)),
    }


def check_keys(config: dict, overrides: list[str]) -> None:
    """Every key of the config and of the `--set` overrides names an option that its section takes; a
    Trainer option this script leaves out (`TRAINER_LEFT_OUT`) is refused from `--set`, where it would be
    silently dropped."""
    sections = option_names()
    for item in overrides:
        key = item.partition("=")[0]
        if key.split(".")[0] in CLI_LEFT_OUT:
            raise ValueError(
                f"--set {item!r}: {key.split('.')[0]} is cli.py's; this script writes only --out"
            )
        if key.startswith("trainer.") and key.removeprefix("trainer.") in TRAINER_LEFT_OUT:
            raise ValueError(
                f"--set {item!r}: this script leaves {key} out of every run (with the rest of "
                f"{', '.join(TRAINER_LEFT_OUT)}): its runs log nothing and write only --out"
            )

    def walk(node: dict, where: tuple[str, ...]) -> None:
        owner, names = sections[where]
        for name, value in node.items():
            path = ".".join((*where, name))
            if name not in names:
                close = difflib.get_close_matches(name, sorted(names), n=1)
                hint = f" (did you mean {'.'.join((*where, close[0]))!r}?)" if close else ""
                raise ValueError(f"config key {path!r}: {owner} has no option {name!r}{hint}")
            if (*where, name) in sections and value is not None:  # `lora: null`, an empty `grpo:`
                if not isinstance(value, dict):
                    raise ValueError(f"config key {path!r} is {value!r}: it must be a section of options")
                walk(value, (*where, name))

    walk(config, ())


def variant_overrides(variant: str, config: dict, step_credit: float | None) -> list[str]:
    if variant == "dynamic_sampling":
        return ["model.grpo.dynamic_sampling=true"]
    if variant == "dynamic_sampling_total":
        return ["model.grpo.dynamic_sampling=true", "model.grpo.dynamic_sampling_metric=null"]
    if variant == "step_credit":
        step_credit = DEFAULT_STEP_CREDIT if step_credit is None else step_credit
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
    grpo = GRPOConfig(**model.pop("grpo", {}))
    grpo.preflight = False  # a report, not training time
    module = GRPOModule(
        grpo=grpo,
        model_options=ModelOptions(**model.pop("model_options", {})),
        lora=LoraOptions(**lora) if lora else None,
        reward_funcs=None if reward_funcs is None else [instantiate(f) for f in reward_funcs],
        **model,
    )
    trainer_args = trainer_options(config, args, max_steps)
    root = os.path.dirname(os.path.abspath(args.out))  # where an interrupted run leaves its checkpoint
    trainer = L.Trainer(
        **trainer_args, logger=False, enable_checkpointing=False, callbacks=callbacks, default_root_dir=root
    )
    # The evaluation before training decodes in the trainer's precision, as the one after.
    module.rollouts.place(trainer.strategy.root_device, trainer.precision)
    return trainer, module


def trainer_options(config: dict, args: argparse.Namespace, max_steps: int | None = None) -> dict:
    """The Trainer's options of a run: the config's, less `TRAINER_LEFT_OUT`, with `--device` and
    `--max_steps` (or `max_steps`) over them."""
    trainer_args = {k: v for k, v in config.get("trainer", {}).items() if k not in TRAINER_LEFT_OUT}
    trainer_args.update(limit_val_batches=0, enable_progress_bar=False)  # evaluations are the callback's
    if args.device is not None:
        trainer_args["accelerator"] = args.device
    if (max_steps := max_steps or args.max_steps) is not None:
        trainer_args["max_steps"] = max_steps
    return trainer_args


# ------------------------------------------------------------------------------------------ measuring
def heldout_accuracy(module: GRPOModule, data: GSM8KDataModule) -> dict:
    """Greedy accuracy on the held-out rows, as `GRPOModule.validation_step` computes it, and which
    problems the strict reading got right (`correct`, for the paired standard error of a gain)."""
    hp = data.hparams
    results = heldout_correct(module, data.val_rows, hp.val_batch_size, hp.system_prompt)
    n = len(results["strict"])
    return {
        "strict": sum(results["strict"]) / n,
        "lenient": sum(results["lenient"]) / n,
        "correct": [int(c) for c in results["strict"]],
    }


def configured_budget(config: dict, args: argparse.Namespace) -> CPUTimeBudget:
    """The config's `CPUTimeBudget` (none: no limit), with `--cpu_budget` and `--wall_budget` over it."""
    limits = {}
    for spec in config.get("trainer", {}).get("callbacks") or []:
        if isinstance(spec, dict) and spec.get("class_path", "").endswith("CPUTimeBudget"):
            limits = dict(spec.get("init_args", {}))
    for key, value in (("max_cpu_seconds", args.cpu_budget), ("max_wall_seconds", args.wall_budget)):
        if value is not None:
            limits[key] = value
    return CPUTimeBudget(**limits)


class Progress(L.Callback):
    """Generation rounds, training wall-clock and CPU seconds without the evaluations (from `budget`, which
    must run before this callback), the share of groups without signal, the held-out accuracy every
    `eval_every` optimizer steps, and the rewards, lengths and timings each update saw."""

    def __init__(self, data: GSM8KDataModule, eval_every: int, budget: CPUTimeBudget) -> None:
        self.data, self.eval_every, self.budget = data, eval_every, budget
        self.rounds, self.curve, self.no_signal = 0, [], []  # no_signal: (share, rounds) per update
        self.updates: list[dict] = []
        self.eval_seconds = self.eval_cpu_seconds = 0.0
        self.correct: list[int] = []  # per held-out problem, strict, at the last evaluation

    def on_train_batch_end(self, trainer: L.Trainer, module: GRPOModule, outputs, batch, batch_idx) -> None:
        self.rounds += 1
        if module.last_rollout is None:  # dynamic sampling is still collecting groups
            return
        metrics = trainer.callback_metrics
        # What each update trained on (under dynamic sampling: the informative groups only).
        trained = {k: round(float(metrics[f"train/{k}"]), 4) for k in UPDATE_KEYS if f"train/{k}" in metrics}
        self.updates.append({"step": trainer.global_step, "cpu_seconds": round(self.budget.cpu_seconds, 1)})
        self.updates[-1].update(trained)
        if "train/dynamic_sampling/frac_dropped" in metrics:
            rounds = 1 + float(metrics["train/dynamic_sampling/extra_rounds"])
            self.no_signal.append((float(metrics["train/dynamic_sampling/frac_dropped"]), rounds))
        else:
            self.no_signal.append((float(metrics["train/frac_reward_zero_std"]), 1.0))
        step, last = trainer.global_step, self.curve[-1]["step"]
        # `num_iterations` > 1 moves the step by more than one per batch: evaluate on crossing a multiple.
        if (
            step // self.eval_every > last // self.eval_every
            and step < trainer.max_steps
            and not trainer.should_stop
        ):
            self.evaluate(module, step)

    def on_train_end(self, trainer: L.Trainer, module: GRPOModule) -> None:
        self.evaluate(module, trainer.global_step)

    def evaluate(self, module: GRPOModule, step: int) -> None:
        start, cpu_start = time.perf_counter(), time.process_time()
        accuracy = heldout_accuracy(module, self.data)
        self.correct = accuracy.pop("correct")
        self.eval_seconds += time.perf_counter() - start
        self.eval_cpu_seconds += time.process_time() - cpu_start
        point = {
            "step": step,
            "rounds": self.rounds,
            "seconds": round(self.budget.wall_seconds, 1),
            "cpu_seconds": round(self.budget.cpu_seconds, 1),
            **accuracy,
        }
        self.curve.append(point)
        print(f"  step {step}: {self.curve[-1]}", file=sys.stderr, flush=True)


def read_results(path: str, flag: str) -> dict:
    """A results file this script wrote (its `--out`), or one `ValueError` saying what `path` is instead."""
    if not os.path.isfile(path):
        raise ValueError(f"{flag} {path}: no such file")
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError):
        saved = None
    if not isinstance(saved, dict) or not isinstance(saved.get("results"), list) or "config" not in saved:
        raise ValueError(f"{flag} {path}: not a results file of this script (an --out file)")
    if not saved["results"]:
        raise ValueError(f"{flag} {path}: holds no finished run")
    return saved


def heldout_setup(config: dict, device: str | None) -> dict:
    """What the accuracy before training depends on: the model, the held-out problems and their prompts,
    the decoding length, the precision and the device."""
    model, trainer = config.get("model") or {}, config.get("trainer") or {}
    grpo = GRPOConfig(**(model.get("grpo") or {}))  # flat names or sections, read by their flat names
    data = {k: v for k, v in (config.get("data") or {}).items() if k not in DATA_OPTIONS_NOT_HELD_OUT}
    return {
        "model.policy": model.get("policy"),
        "model.tokenizer": model.get("tokenizer"),
        "model.model_options": model.get("model_options"),
        **{f"data.{key}": value for key, value in sorted(data.items())},
        "model.grpo.max_completion_length": grpo.max_completion_length,
        "model.grpo.max_prompt_length": grpo.max_prompt_length,
        "trainer.precision": trainer.get("precision"),
        "device": device or trainer.get("accelerator"),
    }


def saved_setup(saved: dict) -> dict:
    """The held-out setup of a results file: recorded, or (an older file) read from its config."""
    if "heldout_setup" in saved:
        return saved["heldout_setup"]
    return heldout_setup(load_config(saved["config"], saved["overrides"]), saved.get("device"))


def load_before(path: str, setup: dict) -> dict:
    """The accuracy before training of the first run in `path`, refused unless measured on this `setup`."""
    saved = read_results(path, "--before")
    theirs = saved_setup(saved)
    differ = [
        f"{key}: its {theirs.get(key)!r}, this run {value!r}"
        for key, value in setup.items()
        if theirs.get(key) != value
    ]
    if differ:
        raise ValueError(
            f"--before {path} was measured on another setup ({'; '.join(differ)}): its accuracy before "
            "training is not this run's; drop --before to measure it"
        )
    return saved["results"][0]["before"]


def run_variant(variant: str, config: dict, args: argparse.Namespace, before: dict | None) -> dict:
    config = load_config(args.config, args.set + variant_overrides(variant, config, args.step_credit))
    data = GSM8KDataModule(**config.get("data", {}))
    data.setup("fit")
    budget = configured_budget(config, args)
    progress = Progress(data, args.eval_every, budget)
    trainer, module = build(config, args, [budget, progress])  # budget first: it stops its clock first
    if before is None and args.before:
        before = load_before(args.before, heldout_setup(config, args.device))
        if len(before["correct"]) != len(data.val_rows):
            raise ValueError(
                f"--before {args.before}: {len(before['correct'])} held-out problems, this run has "
                f"{len(data.val_rows)}"
            )
    if before is None:  # the same weights and greedy decoding: one measurement serves every run
        module.configure_model()
        start, cpu_start = time.perf_counter(), time.process_time()
        before = heldout_accuracy(module.to(trainer.strategy.root_device), data)
        before["eval_seconds"] = round(time.perf_counter() - start, 1)
        before["eval_cpu_seconds"] = round(time.process_time() - cpu_start, 1)
    point = {k: before[k] for k in ("strict", "lenient")}
    progress.curve.append({"step": 0, "rounds": 0, "seconds": 0.0, "cpu_seconds": 0.0, **point})
    print(f"{variant}: before {point}", file=sys.stderr, flush=True)
    trainer.fit(module, data)
    shares, weights = zip(*progress.no_signal, strict=True)
    updates = progress.updates
    return {
        "variant": f"{args.label}+{variant}"
        if args.label and variant != "baseline"
        else args.label or variant,
        "heldout_problems": len(data.val_rows),
        "before": before,
        "after": {k: progress.curve[-1][k] for k in ("strict", "lenient")} | {"correct": progress.correct},
        "gain_se": paired_gain_se(before["correct"], progress.correct),
        "steps": trainer.global_step,
        "rounds": progress.rounds,
        "train_seconds": round(budget.wall_seconds, 1),
        "train_cpu_seconds": round(budget.cpu_seconds, 1),
        "eval_seconds": round(progress.eval_seconds, 1),
        "eval_cpu_seconds": round(progress.eval_cpu_seconds, 1),
        # Wall-clock shares of the training batches (the module's own timers).
        "generate_share": sum(u.get("generate_seconds", 0) for u in updates)
        / max(1e-9, sum(u.get("step_seconds", 0) for u in updates)),
        "frac_truncated": sum(u.get("frac_truncated", 0) for u in updates) / len(updates),
        "frac_no_signal": sum(s * w for s, w in zip(shares, weights, strict=True)) / sum(weights),
        "curve": progress.curve,
        "updates": updates,
    }


# ------------------------------------------------------------------------------------------ report
COLUMNS = (
    "| run | seed | strict acc. before → after | gain ± SE (points) | lenient after | optimizer steps "
    "| generation rounds | groups w/o signal | truncated | generation share | train CPU s | CPU s / step "
    "| train wall s |"
)


def row(r: dict, seed: str) -> str:
    b, a = r["before"], r["after"]
    gain = 100 * (a["strict"] - b["strict"])
    return (
        f"| {r['variant']} | {seed} | {b['strict']:.3f} → {a['strict']:.3f} "
        f"| {gain:+.1f} ± {100 * r['gain_se']:.1f} "
        f"| {a['lenient']:.3f} | {r['steps']} | {r['rounds']} | {r['frac_no_signal']:.0%} "
        f"| {r['frac_truncated']:.0%} | {r['generate_share']:.0%} | {r['train_cpu_seconds']:.0f} "
        f"| {r['train_cpu_seconds'] / max(1, r['steps']):.1f} | {r['train_seconds']:.0f} |"
    )


def report(results: list[dict], seed: int) -> str:
    """One row per run of this process. The SE of a gain is paired over the held-out problems."""
    target = results[0]["after"]["strict"]  # the first run's final accuracy, the baseline's by default
    lines = [f"{COLUMNS} steps (CPU s) to strict ≥ {target:.3f} |", "|" + "---|" * (COLUMNS.count("|"))]
    for r in results:
        lines.append(f"{row(r, str(seed))} {first_reaching(r['curve'], target)} |")
    return "\n".join(lines)


def first_reaching(curve: list[dict], target: float) -> str:
    for point in curve:
        if point["strict"] >= target:
            return f"{point['step']} ({point.get('cpu_seconds', 0):.0f})"
    return "not reached"


def seeds_report(paths: list[str]) -> str:
    """The runs of several `--out` files, one row per variant and seed, then each variant's mean gain with
    its spread over seeds (sample standard deviation, min..max) and the mean training CPU seconds."""
    real = [os.path.realpath(path) for path in paths]
    twice = next((path for i, path in enumerate(paths) if real[i] in real[:i]), None)
    if twice is not None:
        raise ValueError(f"--report {twice} is given twice: its runs would count as more seeds")
    runs, holder = [], {}  # holder: the file of each (run, seed)
    for path in paths:
        saved = read_results(path, "--report")
        if "seed" in saved:
            seed = saved["seed"]
        else:  # a file from before the seed was recorded: its config's
            seed = load_config(saved["config"], saved["overrides"]).get("seed_everything", 0)
        for r in saved["results"]:
            run = (r["variant"], seed)
            if run in holder:
                raise ValueError(
                    f"--report: {holder[run]} and {path} both hold run {run[0]!r} of seed {seed}: one run "
                    "would count as two seeds; give each run once"
                )
            holder[run] = path
            runs.append((*run, r))
    lines = [COLUMNS, "|" + "---|" * (COLUMNS.count("|") - 1)]
    for variant in dict.fromkeys(v for v, _, _ in runs):  # in the order first seen
        mine = sorted(((seed, r) for v, seed, r in runs if v == variant), key=lambda item: item[0])
        lines += [row(r, str(seed)) for seed, r in mine]
        if len(mine) > 1:
            gains = seed_spread([100 * (r["after"]["strict"] - r["before"]["strict"]) for _, r in mine])
            cpu = seed_spread([r["train_cpu_seconds"] for _, r in mine])
            steps = seed_spread([r["steps"] for _, r in mine])
            lines.append(
                f"| **{variant}** | mean of {len(mine)} | | **{gains['mean']:+.1f}** (sd {gains['std']:.1f}, "
                f"{gains['min']:+.1f}..{gains['max']:+.1f}) | | {steps['mean']:.0f} | | | | "
                f"| {cpu['mean']:.0f} | | |"
            )
    return "\n".join(lines)


def check_args(args: argparse.Namespace) -> dict:
    """Every flag, and every run's options, checked before the first step; returns the config."""
    for flag in ("eval_every", "threads", "max_steps"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag} {value}: must be >= 1")
    twice = sorted({v for v in args.variants if args.variants.count(v) > 1})
    if twice:
        raise ValueError(f"--variants names {twice[0]!r} twice: each run once")
    if not os.path.isfile(args.config):
        raise ValueError(f"--config {args.config}: no such file")
    if args.step_credit is not None and "step_credit" not in args.variants:
        raise ValueError(
            f"--step_credit {args.step_credit}: only the step_credit run reads it, and --variants leaves "
            "that run out"
        )
    claim_output(args.out, "--out", WRITER, args.overwrite)
    config = load_config(args.config, args.set)
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise ValueError(f"--config {args.config}: not a config with a model: section")
    check_keys(config, args.set)
    max_steps = args.max_steps or (config.get("trainer") or {}).get("max_steps", -1)
    if not isinstance(max_steps, int) or max_steps == 0 or max_steps < -1:
        raise ValueError(f"trainer.max_steps={max_steps!r}: every run needs at least one step (or -1)")
    L.Trainer(**trainer_options(config, args), logger=False, enable_checkpointing=False)  # its values
    configured_budget(config, args)  # the budgets' values
    for variant in args.variants:  # each run's options, as its module and data module will take them
        options = load_config(args.config, args.set + variant_overrides(variant, config, args.step_credit))
        model = options["model"]
        GRPOConfig(**model.get("grpo", {}))
        ModelOptions(**model.get("model_options", {}))
        if model.get("lora"):
            LoraOptions(**model["lora"])
        GSM8KDataModule(**options.get("data", {})).check_options()
    if args.before:
        load_before(args.before, heldout_setup(config, args.device))
    return config


def results_record(args: argparse.Namespace, config: dict, results: list[dict]) -> dict:
    return {
        "config": args.config,
        "overrides": args.set,
        "seed": config.get("seed_everything", 0),
        "max_steps": args.max_steps,
        "device": args.device,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "heldout_setup": heldout_setup(config, args.device),
        "results": results,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.report:
        print(seeds_report(args.report))
        return
    config = check_args(args)
    torch.set_num_threads(args.threads)
    # One untimed step first, or the first run alone would pay the process's one-time costs (kernels,
    # allocator, autograd threads): on CPU they came to several times a tiny model's step.
    trainer, module = build(config, args, [], max_steps=1)
    trainer.fit(module, GSM8KDataModule(**config.get("data", {})))
    results, before = [], None
    for variant in args.variants:
        results.append(run_variant(variant, config, args, before))
        before = results[-1]["before"]
        write_json(args.out, results_record(args, config, results), WRITER)  # a later failure keeps these
    print(
        f"{args.config} {' '.join(args.set)}; max_steps {args.max_steps or 'as configured'}; seed "
        f"{config.get('seed_everything', 0)}; {results[0]['heldout_problems']} held-out problems, greedy"
    )
    print(report(results, config.get("seed_everything", 0)))
    print(f"curves and figures: {args.out}")


if __name__ == "__main__":
    run_script(main, sys.argv[1:])
