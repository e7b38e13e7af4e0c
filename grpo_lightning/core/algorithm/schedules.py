"""The optimizer TRL's `optim` names (`build_optimizer`: torch's AdamW, fused or not, or bitsandbytes' 8-bit
AdamW), and learning-rate schedules from transformers, the rates of TRL's `lr_scheduler_type` at every step:
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
import importlib.util
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Annotated, Literal

import torch
from torch.optim.lr_scheduler import LRScheduler, SequentialLR
from transformers import get_constant_schedule_with_warmup, get_wsd_schedule

from grpo_lightning.core.options import (
    Alias,
    Choices,
    NonNegativeFloat,
    Range,
    TRLValues,
    check_fields,
    option_error,
    warn_inert,
)


def _adamw(fused: bool) -> Callable[[Iterable[torch.Tensor], OptimizerOptions], torch.optim.Optimizer]:
    def build(params: Iterable[torch.Tensor], options: OptimizerOptions) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, fused=fused, **_adam_arguments(options))

    return build


def _adamw_8bit(params: Iterable[torch.Tensor], options: OptimizerOptions) -> torch.optim.Optimizer:
    import bitsandbytes  # present: `OptimizerOptions` refuses the choice without it

    return bitsandbytes.optim.AdamW8bit(params, **_adam_arguments(options))


# TRL's (transformers') `optim` names -> (the policy's trainable weights, the options) -> the optimizer.
# fused: one kernel for all tensors (transformers' default, "adamw_torch_fused"); the per-tensor loop costs
# ~4x more, 0.6 CPU-s a step for a 135M model on CPU.
OPTIMIZERS = Choices(
    "optim",
    {
        "adamw_torch_fused": _adamw(fused=True),
        "adamw_torch": _adamw(fused=False),
        "adamw_bnb_8bit": _adamw_8bit,
        "adamw_8bit": _adamw_8bit,  # transformers' other name for it
    },
)
OptimizerName = Literal[tuple(OPTIMIZERS)]
NEEDS_BITSANDBYTES = ("adamw_bnb_8bit", "adamw_8bit")


def _adam_arguments(options: OptimizerOptions) -> dict[str, object]:
    return {
        "lr": options.learning_rate,
        "betas": (options.beta1, options.beta2),
        "eps": options.epsilon,
        "weight_decay": options.weight_decay,
    }


def build_optimizer(params: Iterable[torch.Tensor], options: OptimizerOptions) -> torch.optim.Optimizer:
    """The optimizer `options.name` names over `params`, at its learning rate, betas, epsilon and weight
    decay."""
    return OPTIMIZERS[options.name](params, options)


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

    name: Annotated[OptimizerName, Alias("optim")] = "adamw_torch_fused"
    """The optimizer, by TRL's (transformers') `optim` names: "adamw_torch_fused" (torch's AdamW, one kernel
    for all tensors; transformers' default), "adamw_torch" (torch's AdamW, tensor by tensor), or
    "adamw_bnb_8bit" / "adamw_8bit" (bitsandbytes' 8-bit AdamW, its two moments in 8 bits; needs
    bitsandbytes installed)."""
    learning_rate: Annotated[float, Range("> 0", why="at 0 no weight ever changes")] = 1e-6
    """AdamW learning rate; 1e-6 is TRL's GRPO default."""
    beta1: Annotated[float, Range(">= 0, < 1"), Alias("adam_beta1")] = 0.9
    """AdamW's decay rate of the first moment (the gradient's running mean); TRL's `adam_beta1`."""
    beta2: Annotated[float, Range(">= 0, < 1"), Alias("adam_beta2")] = 0.999
    """AdamW's decay rate of the second moment (the squared gradient's running mean); TRL's `adam_beta2`
    (DAPO's and open-r1's recipes set 0.99)."""
    epsilon: Annotated[float, Range(">= 0"), Alias("adam_epsilon")] = 1e-8
    """Added to AdamW's denominator for numerical stability; TRL's `adam_epsilon`."""
    weight_decay: NonNegativeFloat = 0.0
    """AdamW weight decay."""
    warmup_steps: Annotated[
        int,
        Range(">= 0", why="a share of the run is warmup_ratio: TRL's warmup_steps 0.1 is warmup_ratio 0.1"),
    ] = 0
    """Linear warm-up optimizer steps, from 0 (the first update's rate) towards learning_rate as in
    transformers' schedules, then the `lr_scheduler_type` schedule."""
    warmup_ratio: Annotated[float, Range(">= 0, < 1", why="a share of the run's optimizer steps")] = 0.0
    """The warm-up as a share of the run's optimizer steps instead, rounded up (`warmup_steps_of`): TRL's
    `warmup_ratio`, and transformers 5's `warmup_steps` below 1. Give one of the two."""
    lr_scheduler_type: Annotated[
        ScheduleType, TRLValues(("constant_with_warmup", "constant"), ("cosine_with_min_lr", "cosine"))
    ] = "constant"
    """The learning rate after the warm-up: "constant", or decaying over the rest of the run's optimizer
    steps to `min_lr_ratio` x learning_rate, "linear" or "cosine" (SGDR, arXiv:1608.03983); formulas in
    `grpo_lightning.core.algorithm.schedules`. The run's length is the trainer's max_steps (optimizer
    steps), or its epochs x batches x num_iterations x steps_per_generation. TRL: `lr_scheduler_type` (its
    "constant_with_warmup" is "constant" here, its "cosine_with_min_lr" is "cosine" with `min_lr_ratio`;
    both are taken by TRL's name); verl: `optim.lr_scheduler_type`.
    """
    min_lr_ratio: Annotated[float, Range(">= 0, <= 1", why="a share of learning_rate")] = 0.0
    """The floor of a decaying schedule, as a share of learning_rate, reached at the last step; ignored by
    "constant". verl: `optim.min_lr_ratio`; TRL: `lr_scheduler_kwargs={"min_lr_rate": ...}` with
    "cosine_with_min_lr".
    """
    max_grad_norm: (
        Annotated[
            float, Range("> 0", why="a negative norm flips the gradient"), TRLValues((0, None), (0.0, None))
        ]
        | None
    ) = 1.0
    """Gradient clipping by global norm, > 0; None disables."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.name in NEEDS_BITSANDBYTES and importlib.util.find_spec("bitsandbytes") is None:
            raise option_error(
                self,
                "name",
                self.name,
                "8-bit AdamW needs bitsandbytes, which is not installed: pip install bitsandbytes, or use "
                "adamw_torch_fused",
            )
        if self.warmup_steps and self.warmup_ratio:
            raise option_error(
                self,
                "warmup_ratio",
                self.warmup_ratio,
                f"give the warm-up once: warmup_steps={self.warmup_steps} is set too",
            )
        if self.lr_scheduler_type == "constant":
            warn_inert(self, "min_lr_ratio", "lr_scheduler_type: linear or cosine")

    def warmup_steps_of(self, total_steps: int) -> int:
        """The warm-up's optimizer steps in a run of `total_steps`: `warmup_steps`, or `warmup_ratio` of
        them rounded up, as transformers' `TrainingArguments.get_warmup_steps`."""
        return self.warmup_steps or math.ceil(self.warmup_ratio * total_steps)
