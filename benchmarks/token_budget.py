"""Padding of fixed-size micro-batches against token-budget micro-batches, on MATH-like lengths.

A rollout of `--prompts` prompts x `--generations` completions. Prompt lengths are uniform in
[`--prompt_min`, `--prompt_max`]; completion lengths have MATH's long tail: most between 100 and 300 tokens
(log-normal around 180), a share `--at_limit` cut at `--max_completion_length`. Each rollout is cut
three ways, and the share of computed tokens that are padding is reported (the mean over `--rollouts`
seeded rollouts):

- `fixed`: micro-batches of `--micro_batch_size` rows, all padded to the rollout's longest row (the
  training step today: the rollout is one padded tensor, sliced by rows);
- `fixed, own longest`: the same rows, each micro-batch padded to its own longest row only;
- `budget`: `grpo_lightning.core.algorithm.token_budget` with `max_tokens_per_micro_batch` =
  micro_batch_size x
  (prompt_max + max_completion_length), the fixed path's worst-case micro-batch: the same peak memory;
  `--group` keeps each prompt's completions together, as `share_prompt` needs.

With `--step_time`, a random tiny Llama (`--hidden`, `--layers`, a vocabulary of `--vocab`) also runs one
optimizer step's work on each of `--repeats` such rollouts, on the CPU: the reference pass (no gradient)
and the policy's forward and backward, micro-batch by micro-batch (`update.micro_batch_losses`), as the
training step runs them; the median seconds are reported. `fixed` is then the training step with
`micro_batch_size`, `budget` with `max_tokens_per_micro_batch` (`fixed, own longest` is not a path of the
training step and is not timed).

    python benchmarks/token_budget.py
    python benchmarks/token_budget.py --max_completion_length 2048 --at_limit 0.1 --group
    python benchmarks/token_budget.py --step_time --rollouts 3 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torch  # noqa: E402

from grpo_lightning.core.algorithm.token_budget import (  # noqa: E402
    padded_tokens,
    padding_share,
    token_budget_micro_batches,
)
from grpo_lightning.core.algorithm.update import (  # noqa: E402
    MicroBatchSums,
    OneProcess,
    build_trajectory,
    logprobs_in_micro_batches,
    micro_batch_losses,
    micro_batches,
    mini_batch_denominators,
)
from grpo_lightning.core.config import GRPOConfig  # noqa: E402
from grpo_lightning.core.generation.engines import LogProbScorer  # noqa: E402
from grpo_lightning.core.types import Rollout, ScoredGroups  # noqa: E402
from grpo_lightning.offline.tiny import build_model  # noqa: E402


def math_like_rows(args: argparse.Namespace, seed: int) -> list[tuple[int, int]]:
    """(prompt, completion) tokens of each row, a prompt's `generations` rows contiguous."""
    rng = random.Random(seed)
    rows = []
    for _ in range(args.prompts):
        prompt = rng.randint(args.prompt_min, args.prompt_max)
        for _ in range(args.generations):
            if rng.random() < args.at_limit:
                completion = args.max_completion_length
            else:
                completion = min(args.max_completion_length, max(20, round(rng.lognormvariate(5.2, 0.35))))
            rows.append((prompt, completion))
    return rows


def random_trajectory(args: argparse.Namespace, rows: list[tuple[int, int]], seed: int):
    """A trajectory of random tokens with the rows' lengths: prompts left-padded, completions right-padded
    to the longest, random old log-probs and rewards."""
    g = torch.Generator().manual_seed(seed)
    B, P, T = len(rows), max(p for p, _ in rows), max(c for _, c in rows)
    prompts = torch.tensor([p for p, _ in rows])  # [B]
    completions = torch.tensor([c for _, c in rows])  # [B]
    prompt_mask = (torch.arange(P)[None, :] >= P - prompts[:, None]).long()  # [B, P]
    group_prompts = torch.randint(3, args.vocab, (args.prompts, P), generator=g)  # [N, P]
    prompt_ids = group_prompts.repeat_interleave(args.generations, 0) * prompt_mask  # [B, P]
    completion_mask = (torch.arange(T)[None, :] < completions[:, None]).long()  # [B, T]
    completion_ids = torch.randint(3, args.vocab, (B, T), generator=g) * completion_mask
    rollout = Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, completions == T)
    rewards = torch.randn(B, generator=g)  # [B]
    scored = ScoredGroups(
        list(range(args.prompts)), rollout, [""] * B, rewards[:, None], rewards, args.generations
    )
    cfg = GRPOConfig(num_generations=args.generations, max_completion_length=args.max_completion_length)
    old = -torch.rand(B, T, generator=g)  # [B, T]
    return build_trajectory(scored, cfg, old_logprobs=old), cfg


def step_seconds(args: argparse.Namespace, model, scorer, trajectory, cfg, parts) -> float:
    """One optimizer step's work: the reference pass and the policy's forward and backward."""
    start = time.perf_counter()
    logprobs_in_micro_batches(scorer, model, trajectory.rollout, parts)
    denominators = mini_batch_denominators(trajectory, OneProcess())
    for loss in micro_batch_losses(scorer, model, trajectory, parts, cfg, *denominators, MicroBatchSums()):
        loss.backward()
    seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return seconds


def step_times(args: argparse.Namespace, budget: int, group: int) -> dict[str, float]:
    """Median step seconds of `fixed` and `budget` micro-batches over `--repeats` rollouts."""
    torch.manual_seed(0)
    model = build_model(args.vocab, hidden_size=args.hidden, num_layers=args.layers).train()
    scorer = LogProbScorer(args.generations, share_prompt=args.group)
    times = {"fixed": [], "budget": []}
    for seed in range(args.repeats + 1):  # the first is a warm-up
        trajectory, cfg = random_trajectory(args, math_like_rows(args, seed), seed)
        rollout = trajectory.rollout
        parts = {
            "fixed": micro_batches(rollout, args.micro_batch_size),
            "budget": micro_batches(rollout, None, budget, group),
        }
        for name, micro in parts.items():
            seconds = step_seconds(args, model, scorer, trajectory, cfg, micro)
            if seed > 0:
                times[name].append(seconds)
    return {name: statistics.median(values) for name, values in times.items()}


def fixed_micro_batches(count: int, size: int) -> list[list[int]]:
    return [list(range(start, min(start + size, count))) for start in range(0, count, size)]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--prompt_min", type=int, default=60)
    parser.add_argument("--prompt_max", type=int, default=200)
    parser.add_argument("--max_completion_length", type=int, default=1024)
    parser.add_argument("--at_limit", type=float, default=0.05, help="share of completions cut at the limit")
    parser.add_argument("--micro_batch_size", type=int, default=8)
    parser.add_argument("--group", action="store_true", help="keep each prompt's completions together")
    parser.add_argument("--rollouts", type=int, default=200)
    parser.add_argument("--step_time", action="store_true", help="also time a step of a random tiny Llama")
    parser.add_argument("--repeats", type=int, default=3, help="rollouts timed (after one warm-up)")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=2048)
    args = parser.parse_args()

    budget = args.micro_batch_size * (args.prompt_max + args.max_completion_length)
    group = args.generations if args.group else 1
    totals = {"fixed": [0.0, 0], "fixed, own longest": [0.0, 0], "budget": [0.0, 0]}
    every_row = []
    for seed in range(args.rollouts):
        lengths = [p + c for p, c in math_like_rows(args, seed)]
        every_row += lengths
        fixed = fixed_micro_batches(len(lengths), args.micro_batch_size)
        by_budget = token_budget_micro_batches(lengths, budget, group)
        computed = {
            "fixed": len(lengths) * max(lengths),
            "fixed, own longest": padded_tokens(lengths, fixed),
            "budget": padded_tokens(lengths, by_budget),
        }
        counts = {"fixed": len(fixed), "fixed, own longest": len(fixed), "budget": len(by_budget)}
        for name, tokens in computed.items():
            totals[name][0] += padding_share(lengths, tokens) / args.rollouts
            totals[name][1] += counts[name] / args.rollouts

    print(
        f"{args.rollouts} rollouts of {args.prompts} x {args.generations} rows; rows of {min(every_row)}-"
        f"{max(every_row)} tokens; budget {budget} tokens per micro-batch"
        + (f", groups of {group} kept together" if args.group else "")
    )
    seconds = step_times(args, budget, group) if args.step_time else {}
    if seconds:
        print(
            f"step time: median of {args.repeats} rollouts, tiny Llama (hidden {args.hidden}, {args.layers} "
            f"layers, vocabulary {args.vocab}), {torch.get_num_threads()} threads"
        )
    print("| micro-batches | padding share | micro-batches per rollout | step time (s) |")
    print("| --- | --- | --- | --- |")
    for name, (share, count) in totals.items():
        timed = f"{seconds[name]:.2f}" if name in seconds else "—"
        print(f"| {name} | {share:.1%} | {count:.1f} | {timed} |")


if __name__ == "__main__":
    main()
