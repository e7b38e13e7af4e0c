"""Learning-rate schedules: linear warm-up, then constant, linear or cosine decay to a floor.

The multiplier of the base learning rate at optimizer step `s` (0-based: step 0 is the first update), with
`w` warm-up steps, `n` optimizer steps in all and floor ratio `r`:

    warm-up   s < w:  (s + 1) / w
    then      p = (s - w) / max(1, n - w), clamped to [0, 1]
        constant:  1
        linear:    r + (1 - r) * (1 - p)
        cosine:    r + (1 - r) * (1 + cos(pi * p)) / 2     (SGDR, Loshchilov & Hutter, arXiv:1608.03983)

As TRL's / transformers' "linear" and "cosine" schedules (and verl's `lr_scheduler_type`, OpenRLHF's
`lr_scheduler`), with the floor of transformers' "cosine_with_min_lr" / verl's `min_lr_ratio`; the warm-up
starts at 1/w rather than 0 so that the first update is not wasted (as this project always did).
Nothing here imports Lightning: the module passes in the number of optimizer steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

SCHEDULES = ("constant", "linear", "cosine")


def lr_multiplier(step: int, warmup_steps: int, total_steps: int, kind: str, min_ratio: float = 0.0) -> float:
    """The factor applied to the base learning rate at optimizer step `step` (formula in the module doc)."""
    if kind not in SCHEDULES:
        raise ValueError(f"lr_scheduler_type={kind!r}: must be one of {', '.join(SCHEDULES)}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if kind == "constant":
        return 1.0
    progress = min(1.0, max(0.0, (step - warmup_steps) / max(1, total_steps - warmup_steps)))
    decayed = 1.0 - progress if kind == "linear" else (1.0 + math.cos(math.pi * progress)) / 2
    return min_ratio + (1.0 - min_ratio) * decayed


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    warmup_steps: int,
    total_steps: Callable[[], int],
    kind: str,
    min_ratio: float,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A `LambdaLR` of `lr_multiplier`, to be stepped once after each optimizer step.

    `total_steps` is asked only once a decay has begun (step 0's multiplier needs no length): the trainer
    knows its batches per epoch when training runs, not yet when the optimizer is built.
    """

    def multiplier(step: int) -> float:
        decaying = kind != "constant" and step > warmup_steps
        total = total_steps() if decaying else 0  # not read before the decay's first step
        return lr_multiplier(step, warmup_steps, total, kind, min_ratio)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)


def optimizer_steps_in_fit(
    max_steps: int, max_epochs: int | None, batches_per_epoch: float, steps_per_batch: int
) -> int:
    """Optimizer steps a `fit` makes at most, the schedule's length: the trainer's `max_steps` (the module
    counts optimizer steps in the global step, `steps_per_batch` = num_iterations x steps_per_generation
    per training step), or its epochs x batches x `steps_per_batch`, whichever ends first. Dynamic
    sampling's rounds without an update make no step, so a run bounded by epochs then ends before the
    schedule does."""
    bounds = [max_steps] if max_steps is not None and max_steps >= 0 else []
    if max_epochs is not None and max_epochs >= 0 and math.isfinite(batches_per_epoch):
        bounds.append(int(batches_per_epoch) * max_epochs * steps_per_batch)
    if not bounds:
        raise ValueError(
            "grpo.lr_scheduler_type decays over the run, whose length is unknown (no max_steps, no "
            "max_epochs, or an unsized data loader): set trainer.max_steps, or lr_scheduler_type: constant"
        )
    return min(bounds)
