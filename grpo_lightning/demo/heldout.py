"""Greedy held-out accuracy per problem, and the standard errors that say how far to trust a gain.

- `heldout_correct`: for each held-out problem, whether the greedy completion's answer is right (strict
  `#### N` and lenient extraction, as `GSM8KAccuracy` reads them) and whether it uses the `#### N` form.
- `binomial_se`: the standard error of an accuracy over `n` problems, sqrt(p (1 - p) / n).
- `paired_gain_se`: the standard error of the gain between two evaluations of the same problems, from the
  per-problem differences (a problem solved both times adds no variance, unlike sqrt(se_a^2 + se_b^2)).
- `seed_spread`: mean, sample standard deviation and standard error of the mean of per-seed figures.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from grpo_lightning.core.rewards.verifiable import extract_answer, reference_answer
from grpo_lightning.io.rows import collate_rows


@torch.no_grad()
def heldout_correct(module, rows: Sequence[dict], batch_size: int, system_prompt: str | None) -> dict:
    """Greedy completions of `module.rollouts.sample_batch` (a `GRPOModule`; with tools, the whole multi-turn
    rollout, as validation samples it) on `rows`; per problem, in row order: `strict` and `lenient` (the
    extracted answer equals the reference), `formatted` (a `#### N` answer) and `called` (a tool ran: a tool
    message in its turns), lists of bools, and `lengths`, the completions' token counts (tool results
    included)."""
    results: dict[str, list] = {"strict": [], "lenient": [], "formatted": [], "called": [], "lengths": []}
    for start in range(0, len(rows), batch_size):
        batch = collate_rows(list(rows[start : start + batch_size]), system_prompt)
        rollout, completions, turns = module.rollouts.sample_batch(batch, 1, do_sample=False)
        for completion, answer in zip(completions, batch["answer"], strict=True):
            reference, strict = reference_answer(answer), extract_answer(completion, strict=True)
            results["strict"].append(strict == reference)
            results["lenient"].append(extract_answer(completion) == reference)
            results["formatted"].append(strict is not None)
        messages = (turns.messages if turns is not None else None) or [[] for _ in completions]
        results["called"] += [any(m["role"] == "tool" for m in sample) for sample in messages]
        results["lengths"] += rollout.completion_mask.sum(dim=1).tolist()
    return results


def binomial_se(correct: Sequence[bool]) -> float:
    """sqrt(p (1 - p) / n): the standard error of the share `p` of true values among `n`."""
    n = len(correct)
    p = sum(correct) / n
    return math.sqrt(p * (1 - p) / n)


def paired_gain_se(before: Sequence[bool], after: Sequence[bool]) -> float:
    """Standard error of mean(after) - mean(before) over the same `n` problems: sqrt(var(d) / n), with
    d_i = after_i - before_i in {-1, 0, 1} and var the population variance (as in `binomial_se`)."""
    if len(before) != len(after):
        raise ValueError(f"paired_gain_se: {len(before)} problems before, {len(after)} after")
    n = len(before)
    diffs = [float(a) - float(b) for b, a in zip(before, after, strict=True)]
    mean = sum(diffs) / n
    return math.sqrt(sum((d - mean) ** 2 for d in diffs) / n / n)


def seed_spread(values: Sequence[float]) -> dict[str, float]:
    """`mean`, `std` (sample, n - 1; 0 for one value), `se` (std / sqrt(n)), `min` and `max` of per-seed
    figures."""
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return {"mean": mean, "std": std, "se": std / math.sqrt(n), "min": min(values), "max": max(values)}
