"""Padding of fixed-size micro-batches against token-budget micro-batches and packed rows, on MATH-like
lengths.

A rollout of `--prompts` prompts x `--generations` completions. Prompt lengths are uniform in
[`--prompt_min`, `--prompt_max`]; completion lengths have MATH's long tail: most between 100 and 300 tokens
(log-normal around 180), a share `--at_limit` cut at `--max_completion_length`. Each rollout is cut
five ways, and the share of computed decoder positions that are padding is reported (the mean over
`--rollouts` seeded rollouts), with the positions computed per token of the rows (prompt + completion):

- `fixed`: micro-batches of `--micro_batch_size` rows, all padded to the rollout's longest row (the
  training step with `micro_batch_size`: the rollout is one padded tensor, sliced by rows);
- `fixed, own longest`: the same rows, each micro-batch padded to its own longest row only;
- `budget`: `grpo_lightning.core.algorithm.token_budget` with `max_tokens_per_micro_batch` =
  micro_batch_size x (prompt_max + max_completion_length), the fixed path's worst-case micro-batch: the
  same peak memory; `--group` keeps each prompt's completions together, as `share_prompt` needs;
- `fixed, packed` and `budget, packed`: the same micro-batches with their rows packed end to end
  (`grpo.packed_sequences`, `grpo_lightning.core.generation.packing`; lines as wide as its cost model
  picks for the model timed, the tiny Llama's without `--model`); with `--group` each line holds a group's
  prompt once and several of its completions, so that fewer positions than the rows' tokens run.

The attention keys per position count the scores sdpa and eager attention compute, masked ones too.

With `--group` the padded layouts count what the shared passes run: one prompt pass per group, then the
completions.

With `--step_time`, a random tiny Llama (`--hidden`, `--layers`, a vocabulary of `--vocab`) or `--model`'s
checkpoint also runs one optimizer step's work on each of `--repeats` such rollouts, on the CPU: the
reference pass (no gradient) and the policy's forward and backward, micro-batch by micro-batch
(`update.micro_batch_losses`), as the training step runs them; the median seconds are reported.
`fixed` is then the training step with `micro_batch_size`, `budget` with `max_tokens_per_micro_batch`, and
the packed rows the same with `packed_sequences` (`fixed, own longest` is not a path of the training step
and is not timed).

    python benchmarks/token_budget.py
    python benchmarks/token_budget.py --max_completion_length 2048 --at_limit 0.1 --group
    python benchmarks/token_budget.py --step_time --rollouts 3 --repeats 3
    python benchmarks/token_budget.py --step_time --group --model models/smollm2-135m-instruct \
        --prompts 2 --max_completion_length 256 --rollouts 3 --repeats 2
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

from grpo_lightning.core.algorithm.batches import micro_batches, mini_batch_denominators  # noqa: E402
from grpo_lightning.core.algorithm.token_budget import (  # noqa: E402
    token_budget_micro_batches,
)
from grpo_lightning.core.config import GRPOConfig  # noqa: E402
from grpo_lightning.core.generation.packing import (  # noqa: E402
    PackedLogProbScorer,
    pack_rows,
    scores_per_position,
)
from grpo_lightning.core.generation.scorer import LogProbScorer  # noqa: E402
from grpo_lightning.core.ranks import OneProcess  # noqa: E402
from grpo_lightning.core.types import Rollout, ScoredGroups  # noqa: E402
from grpo_lightning.core.update import (  # noqa: E402
    MicroBatchSums,
    build_trajectory,
    logprobs_in_micro_batches,
    micro_batch_losses,
)
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


def random_rollout(args: argparse.Namespace, rows: list[tuple[int, int]], seed: int) -> Rollout:
    """A rollout of random tokens with the rows' lengths: prompts left-padded, completions right-padded to
    the longest; a prompt's rows share its tokens."""
    g = torch.Generator().manual_seed(seed)
    B, P, T = len(rows), max(p for p, _ in rows), max(c for _, c in rows)
    prompts = torch.tensor([p for p, _ in rows])  # [B]
    completions = torch.tensor([c for _, c in rows])  # [B]
    prompt_mask = (torch.arange(P)[None, :] >= P - prompts[:, None]).long()  # [B, P]
    group_prompts = torch.randint(3, args.vocab, (args.prompts, P), generator=g)  # [N, P]
    prompt_ids = group_prompts.repeat_interleave(args.generations, 0) * prompt_mask  # [B, P]
    completion_mask = (torch.arange(T)[None, :] < completions[:, None]).long()  # [B, T]
    completion_ids = torch.randint(3, args.vocab, (B, T), generator=g) * completion_mask
    return Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, completions == T)


def random_trajectory(args: argparse.Namespace, rows: list[tuple[int, int]], seed: int):
    """`random_rollout` as a trajectory, with random old log-probs and rewards."""
    rollout = random_rollout(args, rows, seed)
    g = torch.Generator().manual_seed(seed + 1)
    B, T = rollout.completion_ids.shape
    rewards = torch.randn(B, generator=g)  # [B]
    scored = ScoredGroups(
        list(range(args.prompts)), rollout, [""] * B, rewards[:, None], rewards, args.generations
    )
    cfg = GRPOConfig(num_generations=args.generations, max_completion_length=args.max_completion_length)
    old = -torch.rand(B, T, generator=g)  # [B, T]
    return build_trajectory(scored, cfg, old_logprobs=old), cfg


def shared_padded_positions(
    rows: list[tuple[int, int]], parts: list[list[int]], group: int, own_longest: bool
) -> tuple[int, int, int]:
    """(positions computed, of which padding, attention scores computed) by the padded shared passes: per
    micro-batch one prompt pass of its groups and one pass of its completions but their last token, padded
    to the micro-batch's own longest prompt and completion (`own_longest`) or the rollout's."""
    computed = padding = keys = 0
    for part in parts:
        scope = part if own_longest else range(len(rows))
        P, T = max(rows[r][0] for r in scope), max(rows[r][1] for r in scope)
        groups = {r // group for r in part}
        positions = len(groups) * P + len(part) * (T - 1)
        tokens = sum(rows[g * group][0] for g in groups) + sum(rows[r][1] - 1 for r in part)
        computed, padding = computed + positions, padding + positions - tokens
        keys += len(groups) * P * P + len(part) * (T - 1) * (P + T - 1)
    return computed, padding, keys


def padded_positions(lengths: list[int], parts: list[list[int]], width: int | None) -> tuple[int, int, int]:
    """(positions computed, of which padding, attention scores computed) when each micro-batch is padded to
    `width`, None: to its own longest row."""
    computed = keys = 0
    for part in parts:
        longest = width or max(lengths[r] for r in part)
        computed, keys = computed + len(part) * longest, keys + len(part) * longest * longest
    return computed, computed - sum(lengths), keys


def packed_positions(
    rollout: Rollout, parts: list[list[int]], group: int | None, cost: float
) -> tuple[int, int, int]:
    """(positions computed, of which padding, attention scores computed) when each micro-batch's rows are
    packed (`cost`: the model's `scores_per_position`); sdpa and eager attention compute the masked scores
    too."""
    computed = padding = keys = 0
    for rows in parts:
        packed = pack_rows(rollout.select(torch.tensor(rows), trim=True), slice(None), group, cost)
        lines, width = packed.segment.shape
        computed, keys = computed + lines * width, keys + lines * width * width
        padding += int((packed.segment == -1).sum())
    return computed, padding, keys


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


def the_model(args: argparse.Namespace) -> torch.nn.Module:
    """`--model`'s checkpoint in float32 (its vocabulary then sets `--vocab`), or a random tiny Llama."""
    torch.manual_seed(0)
    if args.model:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        args.vocab = model.config.vocab_size
        return model
    return build_model(args.vocab, hidden_size=args.hidden, num_layers=args.layers)


def step_times(args: argparse.Namespace, budget: int, group: int) -> dict[str, float]:
    """Median step seconds of each timed layout over `--repeats` rollouts."""
    model = the_model(args).train()
    padded = LogProbScorer(args.generations, share_prompt=args.group)
    packed = PackedLogProbScorer(args.generations, share_prompt=args.group)
    times = {name: [] for name in TIMED}
    for seed in range(args.repeats + 1):  # the first is a warm-up
        trajectory, cfg = random_trajectory(args, math_like_rows(args, seed), seed)
        rollout = trajectory.rollout
        fixed = micro_batches(rollout, args.micro_batch_size)
        by_budget = micro_batches(rollout, None, budget, group)
        runs = {
            "fixed": (padded, fixed),
            "budget": (padded, by_budget),
            "fixed, packed": (packed, fixed),
            "budget, packed": (packed, by_budget),
        }
        for name, (scorer, micro) in runs.items():
            seconds = step_seconds(args, model, scorer, trajectory, cfg, micro)
            if seed > 0:
                times[name].append(seconds)
    return {name: statistics.median(values) for name, values in times.items()}


TIMED = ("fixed", "budget", "fixed, packed", "budget, packed")


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
    parser.add_argument("--model", help="a checkpoint folder to time instead of the tiny Llama")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads; default torch's")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    budget = args.micro_batch_size * (args.prompt_max + args.max_completion_length)
    group = args.generations if args.group else 1
    names = ("fixed", "fixed, own longest", "budget", "fixed, packed", "budget, packed")
    cost = scores_per_position(the_model(args))
    totals = {name: [0.0] * 4 for name in names}  # padding share, positions per token, keys, micro-batches
    every_row = []
    for seed in range(args.rollouts):
        rows = math_like_rows(args, seed)
        lengths = [p + c for p, c in rows]
        every_row += lengths
        fixed = fixed_micro_batches(len(lengths), args.micro_batch_size)
        by_budget = token_budget_micro_batches(lengths, budget, group)
        rollout = random_rollout(args, rows, seed)
        shared = args.generations if args.group else None
        if shared:
            computed = {  # (positions computed, of which padding)
                "fixed": shared_padded_positions(rows, fixed, shared, own_longest=False),
                "fixed, own longest": shared_padded_positions(rows, fixed, shared, own_longest=True),
                "budget": shared_padded_positions(rows, by_budget, shared, own_longest=True),
            }
        else:
            computed = {
                "fixed": padded_positions(lengths, fixed, max(lengths)),
                "fixed, own longest": padded_positions(lengths, fixed, None),
                "budget": padded_positions(lengths, by_budget, None),
            }
        computed["fixed, packed"] = packed_positions(rollout, fixed, shared, cost)
        computed["budget, packed"] = packed_positions(rollout, by_budget, shared, cost)
        counts = {name: len(by_budget if name.startswith("budget") else fixed) for name in names}
        for name, (positions, padding, keys) in computed.items():
            totals[name][0] += padding / positions / args.rollouts
            totals[name][1] += positions / sum(lengths) / args.rollouts
            totals[name][2] += keys / positions / args.rollouts
            totals[name][3] += counts[name] / args.rollouts

    print(
        f"{args.rollouts} rollouts of {args.prompts} x {args.generations} rows; rows of {min(every_row)}-"
        f"{max(every_row)} tokens; budget {budget} tokens per micro-batch"
        + (f", groups of {group} kept together and sharing their prompt" if args.group else "")
    )
    seconds = step_times(args, budget, group) if args.step_time else {}
    if seconds:
        model = (
            args.model or f"tiny Llama (hidden {args.hidden}, {args.layers} layers, vocabulary {args.vocab})"
        )
        print(f"step time: median of {args.repeats} rollouts, {model}, {torch.get_num_threads()} threads")
    print(
        "| micro-batches | padding share | positions per row token | attention keys per position "
        "| micro-batches per rollout | step time (s) |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for name, (share, per_token, keys, count) in totals.items():
        timed = f"{seconds[name]:.2f}" if name in seconds else "—"
        print(f"| {name} | {share:.1%} | {per_token:.2f} | {keys:.0f} | {count:.1f} | {timed} |")


if __name__ == "__main__":
    main()
