"""The long tail of synchronous rollouts: the share of a rollout's wall time spent while only the last 10% of
its sequences are still being decoded, which is what asynchrony inside the trainer's process could win (the
device idles on the few long rows while the batch's finished rows wait for them).

Each in-process engine (`eager`, `static`, and `vllm` colocated where vLLM imports) samples the demo's
rollouts as a training step does: the run's config (`--config`, the demo's by default: SmolLM2-135M-Instruct,
2 arithmetic problems x 8 completions, up to 64 tokens at temperature 0.5, the trainer's precision), built
by the CLI with `model.grpo.engine.backend` set to the engine, its prompts the data module's training
batches, sampled through `module.rollouts.sample` under the trainer's autocast. Before each call the engine
is told the weights changed and takes them (as after an optimizer step), outside the timed part: the
timing is the engine's `generate` alone, finished rows dropped as the engine drops them.

Per decoding step, when it started is read from the engine's own loop: a forward pre-hook on the model that
`generate` decodes with (eager: the policy; static: its inference copy), and the start of each engine step
of vLLM that produced tokens. A call's step k runs from its start to the next one's (step 0 from the call's
start: the prefill with it; the last to the call's end). Each completion of L tokens is running during
steps 0 .. L-1, so the rows still running at step k are those longer than k. The tail is the steps during
which at most `--tail` of the batch's rows are still running; its share is the tail's seconds over the
calls' seconds, over all calls, and per call (its spread). By length: the completions' lengths (quantiles,
how many ran to the cap) and, per call, the longest completion against the 90th percentile's length.

    python benchmarks/rollout_tail.py --batches 8 --threads 2
    python benchmarks/rollout_tail.py --batches 8 --trainer.precision=32-true   # a CPU without bf16 matmuls
    LD_PRELOAD=.venv-vllm/lib/libiomp5.so .venv-vllm/bin/python benchmarks/rollout_tail.py --engines vllm

Further `--key=value` arguments go to the CLI (`--model.policy=...`, `--data.batch_size=4`). The demo itself
trains in float32 on a CPU without bf16 matrix instructions (`scripts/demo.py`): pass
`--trainer.precision=32-true` there to time what it runs.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
# As the demo (`scripts/demo.py`): OpenMP workers that sleep while they wait, read when torch loads OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from grpo_lightning.cli import build_cli  # noqa: E402
from grpo_lightning.core.generation.backends import BACKENDS  # noqa: E402
from grpo_lightning.core.generation.inference_copy import hf_model  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_CONFIG = os.path.join(ROOT, "configs/demo_arithmetic.yaml")
ENGINES = ("eager", "static", "vllm")


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        allow_abbrev=False,  # other options go to the CLI
    )
    parser.add_argument("--config", default=DEMO_CONFIG, help="a `cli.py fit` config (the demo's)")
    parser.add_argument(
        "--engines",
        default=None,
        help=f"some of {','.join(ENGINES)} (default: eager,static, and vllm where it imports)",
    )
    parser.add_argument("--batches", type=int, default=8, help="timed calls per engine after a warm-up (8)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (2)")
    parser.add_argument(
        "--tail", default="0.1", help="shares of rows still running that make the tail, e.g. 0.5,0.25,0.1"
    )
    args, cli_args = parser.parse_known_args(argv)
    if args.engines is None:
        args.engines = [name for name in ENGINES if BACKENDS[name].unavailable() is None]
    else:
        args.engines = args.engines.split(",")
    unknown = sorted(set(args.engines) - set(ENGINES))
    if unknown:
        parser.error(f"--engines: unknown {unknown}; choose from {list(ENGINES)}")
    for name in args.engines:
        if (problem := BACKENDS[name].unavailable()) is not None:
            parser.error(f"--engines: {name}: {problem}")
    args.tail = [float(share) for share in args.tail.split(",")]
    return args, cli_args


class StepClock:
    """When each decoding step of an engine's own loop started (`starts`, in `time.perf_counter` seconds),
    read from a hook: before each forward of a Hugging Face model that `generate` decodes with, or before
    each vLLM engine step that produced tokens."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_model(self, model: torch.nn.Module) -> None:
        model.register_forward_pre_hook(lambda module, args: self.starts.append(time.perf_counter()))

    def on_vllm(self, llm) -> None:
        core = llm.llm_engine.engine_core  # in-process: each `get_output` runs one scheduler step
        step = core.get_output

        def timed_step():
            start = time.perf_counter()
            outputs = step()
            if any(output.new_token_ids for output in outputs.outputs):
                self.starts.append(start)
            return outputs

        core.get_output = timed_step


def hook_engine(engine, policy: torch.nn.Module, clock: StepClock) -> None:
    """`clock` on the loop of `engine` (built and refreshed: its copy or its vLLM exists)."""
    if hasattr(engine, "llm"):  # vLLM
        clock.on_vllm(engine.llm)
    elif hasattr(engine, "copy"):  # the static engine's inference copy
        clock.on_model(engine.copy.model)
    else:
        clock.on_model(hf_model(policy))  # the Hugging Face model under a PEFT wrapper


def timed_generate(engine, record: Callable[[float, float], None]) -> None:
    """`engine.generate` reporting each call's start and end to `record`."""
    generate = engine.generate

    def timed(*args, **kwargs):
        start = time.perf_counter()
        rollout = generate(*args, **kwargs)
        record(start, time.perf_counter())
        return rollout

    engine.generate = timed


def call_profile(lengths: list[int], step_starts: list[float], start: float, end: float) -> dict:
    """Per decoding step of one call of completions of `lengths` tokens: its seconds and the rows still
    running (those longer than its index). `step_starts`: the start of every step the hook saw in the call;
    the last max(lengths) of them are the decoding steps (an earlier one is a shared prompt's prefill)."""
    T = max(lengths)
    if len(step_starts) < T:
        raise RuntimeError(f"the hook saw {len(step_starts)} steps for completions of up to {T} tokens")
    # T + 1 bounds: step k runs from bounds[k] to bounds[k + 1]
    bounds = [start, *step_starts[len(step_starts) - T + 1 :], end]
    seconds = [b - a for a, b in itertools.pairwise(bounds)]
    running = [sum(length > k for length in lengths) for k in range(T)]
    return {"seconds": seconds, "running": running, "rows": len(lengths), "lengths": lengths}


def tail_seconds(profile: dict, share: float) -> float:
    """The seconds of the steps during which at most `share` of the call's rows are still running."""
    limit = share * profile["rows"]
    return sum(
        s for s, running in zip(profile["seconds"], profile["running"], strict=True) if running <= limit
    )


def tail_share(profile: dict, share: float) -> float:
    """`tail_seconds` over the call's seconds."""
    return tail_seconds(profile, share) / sum(profile["seconds"])


def measure(args: argparse.Namespace, cli_args: list[str]) -> dict[str, list[dict]]:
    """Per engine, one profile per timed call; the engines interleaved call by call, each call on the same
    prompts and seed for every engine."""
    torch.set_num_threads(args.threads)
    runs, batches = {}, None
    for name in args.engines:
        cli = build_cli(
            ["--config", args.config, f"--model.grpo.engine.backend={name}", *cli_args], run=False
        )
        trainer, module = cli.trainer, cli.model
        module.configure_model()
        module.rollouts.place(trainer.strategy.root_device, trainer.precision)
        if batches is None:
            cli.datamodule.setup("fit")
            loader = iter(cli.datamodule.train_dataloader())
            batches = [next(loader)["prompt"] for _ in range(args.batches + 1)]
        runs[name] = (trainer, module)
    G = next(iter(runs.values()))[1].grpo.sampling.num_generations
    profiles: dict[str, list[dict]] = {name: [] for name in runs}
    clocks = {name: StepClock() for name in runs}
    calls: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    for call, prompts in enumerate(batches):
        for name, (trainer, module) in runs.items():
            rollouts = module.rollouts
            rollouts.weights_changed()  # as after an optimizer step
            with rollouts.ready_engine():  # the copy refreshed, the weights pushed: not timed
                pass
            clocks[name].starts.clear()
            torch.manual_seed(call)
            with trainer.precision_plugin.forward_context():  # the training step's autocast
                rollout, _ = rollouts.sample(prompts, G)
            if call == 0:  # the warm-up: the engine exists from here on
                hook_engine(rollouts.engine, module.policy, clocks[name])
                timed_generate(rollouts.engine, lambda a, b, name=name: calls[name].append((a, b)))
                continue
            start, end = calls[name][-1]
            lengths = rollout.completion_mask.sum(dim=1).tolist()
            profile = call_profile(lengths, clocks[name].starts, start, end)
            profile["cap"] = int(rollout.truncated.sum())
            profiles[name].append(profile)
        print(f"call {call} done", file=sys.stderr, flush=True)
    for _, module in runs.values():
        module.rollouts.engine.close()
    return profiles


def quantile(values: list[int], q: float) -> int:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def tail_table(profiles: dict[str, list[dict]], shares: list[float]) -> str:
    header = " | ".join(
        f"tail <= {share:g} of rows: share of time (calls min-median-max)" for share in shares
    )
    lines = [
        f"| engine | calls | rows | s / call | steps / call | {header} |",
        "|---|---|---|---|---|" + "---|" * len(shares),
    ]
    for name, calls in profiles.items():
        total = sum(sum(p["seconds"]) for p in calls)
        cells = []
        for share in shares:
            per_call = [tail_share(p, share) for p in calls]
            overall = sum(tail_seconds(p, share) for p in calls) / total
            spread = f"{min(per_call):.0%}-{statistics.median(per_call):.0%}-{max(per_call):.0%}"
            cells.append(f"**{overall:.1%}** ({spread})")
        steps = statistics.mean(len(p["seconds"]) for p in calls)
        lines.append(
            f"| {name} | {len(calls)} | {calls[0]['rows']} | {total / len(calls):.2f} | {steps:.1f} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def length_table(profiles: dict[str, list[dict]], share: float) -> str:
    lines = [
        "| engine | completion tokens p10 / p50 / p90 / max | at the cap | per call: longest - 90th pct, "
        f"tail <= {share:g} share |",
        "|---|---|---|---|",
    ]
    for name, calls in profiles.items():
        lengths = [length for p in calls for length in p["lengths"]]
        quantiles = " / ".join(str(quantile(lengths, q)) for q in (0.1, 0.5, 0.9, 1.0))
        capped = sum(p["cap"] for p in calls)
        per_call = ", ".join(
            f"{max(p['lengths'])}-{quantile(p['lengths'], 0.9)} {tail_share(p, share):.0%}" for p in calls
        )
        lines.append(f"| {name} | {quantiles} | {capped} of {len(lengths)} | {per_call} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args, cli_args = parse_args(argv)
    print(
        f"{os.path.relpath(args.config, ROOT)} {' '.join(cli_args)}: engines {args.engines}, "
        f"{args.batches} timed calls, {args.threads} threads, torch {torch.__version__}, "
        f"load {os.getloadavg()[0]:.2f}"
    )
    profiles = measure(args, cli_args)
    print(tail_table(profiles, args.tail))
    print(length_table(profiles, args.tail[-1]))
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
