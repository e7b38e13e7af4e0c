"""Learning-rate schedules from transformers, the rates of TRL's `lr_scheduler_type` at every step:
`get_constant_schedule_with_warmup`, or its warm-up then `get_wsd_schedule` decaying from the first step
after it, chained by torch's `SequentialLR`.

The multiplier of the base learning rate at optimizer step `s` (0-based: step 0 is the first update), with
`w` warm-up steps, `n` optimizer steps in all and floor ratio `r`:

    warm-up   s < w:  s / w     (the first update of a warm-up is at rate 0, as in transformers)
    then      p = (s - w) / (n - w) for s < n, and r from s = n on
        constant:  1
        linear:    r + (1 - r) * (1 - p)
        cosine:    r + (1 - r) * (1 + cos(pi * p)) / 2     (SGDR, Loshchilov & Hutter, arXiv:1608.03983)

These are transformers' "constant_with_warmup", "linear" (r = 0) and "cosine" (r = 0) or
"cosine_with_min_lr" (`min_lr_rate` r), step for step over a run (`tests/test_schedules.py` checks them
against transformers' own functions); verl's and OpenRLHF's `lr_scheduler` decay the same way, with verl's
`min_lr_ratio` as the floor. Nothing here imports Lightning: the module passes in the run's number of
optimizer steps.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Annotated, Literal

import torch
from torch.optim.lr_scheduler import LRScheduler, SequentialLR
from transformers import get_constant_schedule_with_warmup, get_wsd_schedule

from grpo_lightning.core.options import (
    Choices,
    NonNegativeFloat,
    NonNegativeInt,
    Range,
    check_fields,
    warn_inert,
)


def _warmed_up_decay(
    decay_type: str, optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, min_ratio: float
) -> LRScheduler:
    # The decay counts its own steps from 0, from step w of the run, to the floor at step n.
    decay = get_wsd_schedule(
        optimizer,
        0,
        total_steps - warmup_steps,
        num_stable_steps=0,
        decay_type=decay_type,
        min_lr_ratio=min_ratio,
    )
    if warmup_steps == 0:
        return decay
    warmup = get_constant_schedule_with_warmup(optimizer, warmup_steps)  # s / w
    return SequentialLR(optimizer, [warmup, decay], milestones=[warmup_steps])


# (optimizer, warm-up steps, optimizer steps in the run, floor ratio) -> the scheduler from step 0.
SCHEDULES = Choices(
    "lr_scheduler_type",
    {
        "constant": lambda optimizer, warmup, steps, floor: get_constant_schedule_with_warmup(
            optimizer, warmup
        ),
        "linear": functools.partial(_warmed_up_decay, "linear"),
        "cosine": functools.partial(_warmed_up_decay, "cosine"),
    },
)
ScheduleType = Literal[tuple(SCHEDULES)]


def build_scheduler(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, kind: str, min_ratio: float
) -> LRScheduler:
    """The schedule of the module doc, to be stepped once after each optimizer step; `total_steps` (`n`) is
    only read by the decaying schedules."""
    return SCHEDULES[kind](optimizer, warmup_steps, total_steps, min_ratio)


def fit_length(
    max_steps: int, max_epochs: int | None, batches_per_epoch: float, steps_per_batch: int
) -> int | None:
    """Optimizer steps a `fit` makes at most: the trainer's `max_steps` (the module counts optimizer steps
    in the global step, `steps_per_batch` = num_iterations x steps_per_generation per training step), or
    its epochs x batches x `steps_per_batch`, whichever ends first; None where neither bounds the run.
    Dynamic sampling's rounds without an update make no step, so a run bounded by epochs then ends
    before this."""
    bounds = [max_steps] if max_steps is not None and max_steps >= 0 else []
    if max_epochs is not None and max_epochs >= 0 and math.isfinite(batches_per_epoch):
        bounds.append(int(batches_per_epoch) * max_epochs * steps_per_batch)
    return min(bounds) if bounds else None


def optimizer_steps_in_fit(
    max_steps: int, max_epochs: int | None, batches_per_epoch: float, steps_per_batch: int
) -> int:
    """The schedule's length, `fit_length`; refused where the run has none."""
    length = fit_length(max_steps, max_epochs, batches_per_epoch, steps_per_batch)
    if length is None:
        raise ValueError(
            "grpo.optimizer.lr_scheduler_type decays over the run, whose length is unknown (no max_steps, no "
            "max_epochs, or an unsized data loader): set trainer.max_steps, or lr_scheduler_type: constant"
        )
    return length


@dataclass(frozen=True)
class OptimizerOptions:
    """AdamW, its learning-rate schedule and gradient clipping (`GRPOConfig.optimizer`)."""

    learning_rate: Annotated[float, Range("> 0", why="at 0 no weight ever changes")] = 1e-6
    """AdamW learning rate; 1e-6 is TRL's GRPO default."""
    weight_decay: NonNegativeFloat = 0.0
    """AdamW weight decay."""
    warmup_steps: NonNegativeInt = 0
    """Linear warm-up optimizer steps, from 0 (the first update's rate) towards learning_rate as in
    transformers' schedules, then the `lr_scheduler_type` schedule."""
    lr_scheduler_type: ScheduleType = "constant"
    """The learning rate after the warm-up: "constant", or decaying over the rest of the run's optimizer
    steps to `min_lr_ratio` x learning_rate, "linear" or "cosine" (SGDR, arXiv:1608.03983); formulas in
    `grpo_lightning.core.algorithm.schedules`. The run's length is the trainer's max_steps (optimizer
    steps), or its epochs x batches x num_iterations x steps_per_generation. TRL: `lr_scheduler_type` (its
    "constant_with_warmup" is "constant" here, its "cosine_with_min_lr" is "cosine" with `min_lr_ratio`);
    verl: `optim.lr_scheduler_type`.
    """
    min_lr_ratio: Annotated[float, Range(">= 0, <= 1", why="a share of learning_rate")] = 0.0
    """The floor of a decaying schedule, as a share of learning_rate, reached at the last step; ignored by
    "constant". verl: `optim.min_lr_ratio`; TRL: `lr_scheduler_kwargs={"min_lr_rate": ...}` with
    "cosine_with_min_lr".
    """
    max_grad_norm: Annotated[float, Range("> 0", why="a negative norm flips the gradient")] | None = 1.0
    """Gradient clipping by global norm, > 0; None disables."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.lr_scheduler_type == "constant":
            warn_inert(self, "min_lr_ratio", "lr_scheduler_type: linear or cosine")
