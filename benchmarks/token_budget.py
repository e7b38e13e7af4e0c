"""Padding of fixed-size micro-batches against token-budget micro-batches, on MATH-like lengths.

A rollout of `--prompts` prompts x `--generations` completions. Prompt lengths are uniform in
[`--prompt_min`, `--prompt_max`]; completion lengths have MATH's long tail: most between 100 and 300 tokens
(log-normal around 180), a share `--at_limit` cut at `--max_completion_length`. Each rollout is cut
three ways, and the share of computed tokens that are padding is reported (the mean over `--rollouts`
seeded rollouts):

- `fixed`: micro-batches of `--micro_batch_size` rows, all padded to the rollout's longest row (the
  training step today: the rollout is one padded tensor, sliced by rows);
- `fixed, own longest`: the same rows, each micro-batch padded to its own longest row only;
- `budget`: `grpo_lightning.core.token_budget` with `max_tokens_per_micro_batch` = micro_batch_size x
  (prompt_max + max_completion_length), the fixed path's worst-case micro-batch: the same peak memory;
  `--group` keeps each prompt's completions together, as `share_prompt` needs.

No model runs: the step-time comparison needs the budget wired into the training step.

    python benchmarks/token_budget.py
    python benchmarks/token_budget.py --max_completion_length 2048 --at_limit 0.1 --group
"""

from __future__ import annotations

import argparse
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from grpo_lightning.core.token_budget import (  # noqa: E402
    padded_tokens,
    padding_share,
    token_budget_micro_batches,
)


def math_like_lengths(args: argparse.Namespace, seed: int) -> list[int]:
    """Prompt + completion tokens of each row, a prompt's `generations` rows contiguous."""
    rng = random.Random(seed)
    lengths = []
    for _ in range(args.prompts):
        prompt = rng.randint(args.prompt_min, args.prompt_max)
        for _ in range(args.generations):
            if rng.random() < args.at_limit:
                completion = args.max_completion_length
            else:
                completion = min(args.max_completion_length, max(20, round(rng.lognormvariate(5.2, 0.35))))
            lengths.append(prompt + completion)
    return lengths


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
    args = parser.parse_args()

    budget = args.micro_batch_size * (args.prompt_max + args.max_completion_length)
    group = args.generations if args.group else 1
    totals = {"fixed": [0.0, 0], "fixed, own longest": [0.0, 0], "budget": [0.0, 0]}
    every_row = []
    for seed in range(args.rollouts):
        lengths = math_like_lengths(args, seed)
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
    print("| micro-batches | padding share | micro-batches per rollout |")
    print("| --- | --- | --- |")
    for name, (share, count) in totals.items():
        print(f"| {name} | {share:.1%} | {count:.1f} |")


if __name__ == "__main__":
    main()
