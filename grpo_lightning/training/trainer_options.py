"""The Trainer's own options, as Lightning users set them, for a module that optimises manually.

Lightning refuses `accumulate_grad_batches` and `gradient_clip_val` under manual optimisation (with a
`MisconfigurationException` traceback). `GRPOModule` has the same things as options of its own, and maps the
Trainer's onto them when the Trainer attaches it, from Python and from the CLI alike (`configure_callbacks`,
the module's hook that Lightning calls before it checks these options):

- `accumulate_grad_batches=N` (one optimizer step per N batches of B prompts) becomes the data module's
  `batch_size=N * B` prompts per step, with `grpo.update.micro_batch_size=B * G` (one batch's sequences per
  forward/backward, as Lightning accumulates one batch at a time) unless one is set already. The loss is
  normalised over the whole step's rollout either way.
- `gradient_clip_val=c` (clipping by the global norm, Lightning's default algorithm) becomes
  `grpo.optimizer.max_grad_norm=c`. Clipping by value has no counterpart: refused, naming our option.

The run's length in optimizer steps, which a decaying learning-rate schedule needs, comes from the same
options (`optimizer_steps_in_run`).

`configure_optimizers` may return one optimizer over the policy's weights in any form Lightning accepts
(`check_one_optimizer`; its schedulers are checked and stepped in `training.lr_schedulers`).

Lightning's tools that do not apply to a module that samples its own batches and optimises manually are
refused when the Trainer attaches it, in one line naming what to use instead (`refuse_unsupported_tools`):
`torch.compile(module)`, `BatchSizeFinder` / `Tuner.scale_batch_size`, `LearningRateFinder` /
`Tuner.lr_find`, `GradientAccumulationScheduler` and `Trainer(strategy="fsdp")`.

A run bounded by `max_steps` alone has Lightning's `max_epochs=-1`, which its progress bar shows as
`Epoch 0/-2`: such a run gets the epochs its steps take as `max_epochs` (`bound_epochs_by_steps`), raised at
an epoch's end when the steps are not made yet (dynamic sampling's batches without an update, skipped
steps), so `max_steps` alone still ends the run.

And one default that a GRPO run needs: an `EarlyStopping` on a validation metric (`val/...`) whose
`check_on_train_epoch_end` is left unset checks after each validation (`check_on_train_epoch_end=False`).
Lightning would otherwise check it at the training epoch's end whenever `val_check_interval` is 1.0, and a
run that `max_steps` ends mid-epoch, before its first validation, would stop with "metric not available".
"""

from __future__ import annotations

import math
from dataclasses import replace

import lightning as L
import torch
from lightning.pytorch.callbacks import (
    BatchSizeFinder,
    EarlyStopping,
    GradientAccumulationScheduler,
    LearningRateFinder,
)
from lightning.pytorch.strategies import FSDPStrategy

from grpo_lightning.core.algorithm.schedules import OptimizerOptions, fit_length, optimizer_steps_in_fit
from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.options import plain_options

DEFAULT_MAX_GRAD_NORM = OptimizerOptions.max_grad_norm
VALIDATION_PREFIX = "val/"  # the metrics that only validation logs

# Lightning's callbacks and strategies that GRPOModule refuses, with what to use instead.
REFUSED_TOOLS = {
    BatchSizeFinder: (
        "BatchSizeFinder (Tuner.scale_batch_size) cannot size a GRPO step, whose memory follows "
        "data.batch_size x grpo.sampling.num_generations sampled sequences: keep data.batch_size and "
        "bound each "
        "forward/backward with model.grpo.update.micro_batch_size or "
        "model.grpo.update.max_tokens_per_micro_batch (the "
        "pre-flight prints the memory estimate)"
    ),
    LearningRateFinder: (
        "LearningRateFinder (Tuner.lr_find) reads a loss that falls with a good learning rate, and GRPO's is "
        "a policy-gradient surrogate on fresh samples each step: set "
        "model.grpo.optimizer.learning_rate (the shipped "
        "GPU configs: 1e-6, 1e-5 with LoRA) and compare short runs' val/accuracy"
    ),
    GradientAccumulationScheduler: (
        "GradientAccumulationScheduler: GRPOModule optimises manually and accumulates no schedule; a fixed "
        "Trainer(accumulate_grad_batches=N) maps onto data.batch_size and model.grpo.update.micro_batch_size"
    ),
    FSDPStrategy: (
        "trainer.strategy FSDPStrategy (FSDP1) is not supported: GRPOModule shards with FSDP2, set "
        "trainer.strategy to ModelParallelStrategy (docs/scaling.md)"
    ),
}
COMPILED_MODULE = (
    "torch.compile(module) would trace the rollout's generation and the reward functions: compile the "
    "policy's forward alone (module.policy, once configure_model has loaded it), or let the rollout engine "
    "compile its decoding step (model.grpo.engine.backend: static, on CUDA)"
)


def refuse_unsupported_tools(trainer: L.Trainer, module: L.LightningModule) -> None:
    """Raise ValueError, in one line naming what to use instead, for a Lightning tool that does not apply
    to `module` (`REFUSED_TOOLS`, a compiled module)."""
    if module._compiler_ctx is not None:  # Lightning's record of a `torch.compile`d module
        raise ValueError(COMPILED_MODULE)
    for tool in [*trainer.callbacks, trainer.strategy]:
        refused = next((line for cls, line in REFUSED_TOOLS.items() if isinstance(tool, cls)), None)
        if refused is not None:
            raise ValueError(refused)


def map_trainer_options(trainer: L.Trainer, module: L.LightningModule) -> list[str]:
    """Move the Trainer's accumulation and clipping options onto `module.grpo` (and its hyper-parameters,
    which checkpoints store) and the data module's `batch_size`, in place, turning the Trainer's off; returns
    a line per mapping. Raises ValueError naming our option where there is no counterpart or the two
    disagree."""
    grpo = module.grpo
    done = []
    accumulate = trainer.accumulate_grad_batches
    if accumulate != 1:
        data = trainer.datamodule
        batch_size = getattr(data, "hparams", {}).get("batch_size")
        if not isinstance(batch_size, int) or not isinstance(accumulate, int) or accumulate < 1:
            raise ValueError(
                f"trainer.accumulate_grad_batches={accumulate!r}: GRPOModule optimises manually; it takes a "
                "larger data.batch_size (prompts per optimizer step) with model.grpo.update.micro_batch_size "
                "(sequences per backward) instead: set those"
            )
        data.hparams.batch_size = batch_size * accumulate
        if grpo.update.micro_batch_size is None:
            grpo.update = replace(grpo.update, micro_batch_size=batch_size * grpo.sampling.num_generations)
        trainer.accumulate_grad_batches = 1
        done.append(
            f"trainer.accumulate_grad_batches={accumulate} -> data.batch_size={batch_size * accumulate}, "
            f"model.grpo.update.micro_batch_size={grpo.update.micro_batch_size} (GRPOModule optimises "
            "manually)"
        )
    clip = trainer.gradient_clip_val
    if clip is not None and clip > 0:
        algorithm = getattr(trainer.gradient_clip_algorithm, "value", trainer.gradient_clip_algorithm)
        if algorithm not in (None, "norm"):
            raise ValueError(
                f"trainer.gradient_clip_algorithm={algorithm!r}: GRPOModule clips "
                "the gradients by their global norm only, with model.grpo.optimizer.max_grad_norm: "
                "remove the "
                "Trainer's clipping options and set that"
            )
        if grpo.optimizer.max_grad_norm not in (DEFAULT_MAX_GRAD_NORM, clip):
            raise ValueError(
                f"trainer.gradient_clip_val={clip} and "
                f"model.grpo.optimizer.max_grad_norm={grpo.optimizer.max_grad_norm} "
                "disagree: GRPOModule clips with model.grpo.optimizer.max_grad_norm; set only that"
            )
        grpo.optimizer = replace(grpo.optimizer, max_grad_norm=float(clip))
        trainer.gradient_clip_val = None
        done.append(f"trainer.gradient_clip_val={clip} -> model.grpo.optimizer.max_grad_norm={float(clip)}")
    if done and "grpo" in module.hparams:  # not where a subclass fixes grpo: its __init__ builds it again
        module.hparams["grpo"] = plain_options(grpo)
    return done


def check_after_validation(trainer: L.Trainer) -> list[str]:
    """Set `check_on_train_epoch_end=False` on each `EarlyStopping` that monitors a validation metric and
    leaves it unset; returns a line per callback changed."""
    done = []
    for callback in trainer.callbacks:
        if (
            isinstance(callback, EarlyStopping)
            and callback._check_on_train_epoch_end is None
            and callback.monitor.startswith(VALIDATION_PREFIX)
        ):
            # EarlyStopping keeps its constructor's choice in a private attribute, and a callback built by
            # the user has no public setter for it: None there means "not chosen", so ours is the default.
            callback._check_on_train_epoch_end = False
            done.append(
                f"EarlyStopping(monitor={callback.monitor!r}) checks after each validation "
                "(check_on_train_epoch_end=False)"
            )
    return done


def optimizer_steps_in_run(trainer: L.Trainer, cfg: GRPOConfig) -> int:
    """The optimizer steps `fit` makes at most, the length of a decaying learning-rate schedule (and of the
    run a `warmup_ratio` is a share of): from the
    Trainer's `max_steps` (which counts them under the module's manual optimisation) and `max_epochs`
    (`schedules.optimizer_steps_in_fit`), the training data loaded for its batches per epoch. 0 for a
    constant schedule with no `warmup_ratio`, which reads no length (and nothing is loaded)."""
    if cfg.optimizer.lr_scheduler_type == "constant" and not cfg.optimizer.warmup_ratio:
        return 0
    trainer.estimated_stepping_batches  # noqa: B018  (loads the training data: its batches per epoch)
    batches = trainer.num_training_batches
    return optimizer_steps_in_fit(
        trainer.max_steps, trainer.max_epochs, batches, cfg.optimizer_steps_per_batch
    )


def planned_optimizer_steps(trainer: L.Trainer, cfg: GRPOConfig) -> int:
    """The optimizer steps `fit` makes at most (`schedules.fit_length`), -1 where neither `max_steps` nor
    `max_epochs` over sized data bounds it: the `max_steps` of the reward functions' `trainer_state`, the
    run's computed total as TRL passes it, also where epochs alone bound the run (Lightning's own
    `max_steps` is then -1)."""
    steps = fit_length(
        trainer.max_steps, trainer.max_epochs, trainer.num_training_batches, cfg.optimizer_steps_per_batch
    )
    return -1 if steps is None else steps


def check_one_optimizer(trainer: L.Trainer, policy: torch.nn.Module) -> None:
    """GRPO steps one optimizer over the policy: `configure_optimizers` returning several is refused, and so
    is one holding weights that are not the policy's (the loss gives them no gradient) or none of its
    trainable ones (it would train nothing)."""
    if len(trainer.optimizers) != 1:
        names = [type(optimizer).__name__ for optimizer in trainer.optimizers]
        raise ValueError(
            f"configure_optimizers returned {len(names)} optimizers ({', '.join(names) or 'none'}): "
            "GRPOModule steps one, over the policy's trainable weights (parameter groups give parts of "
            "them their own options)"
        )
    optimizer = trainer.optimizers[0]
    held = [p for group in optimizer.param_groups for p in group["params"]]
    policy_params = {id(p): p.requires_grad for p in policy.parameters()}
    foreign = sum(id(p) not in policy_params for p in held)
    name, fix = type(optimizer).__name__, "give it [p for p in self.policy.parameters() if p.requires_grad]"
    if foreign:
        raise ValueError(
            f"configure_optimizers returned {name} holding {foreign} of its {len(held)} weights outside the "
            f"policy: the GRPO loss gives them no gradient; {fix}"
        )
    if not any(policy_params[id(p)] for p in held):
        raise ValueError(
            f"configure_optimizers returned {name} over none of the policy's trainable weights: {fix}"
        )


def bound_epochs_by_steps(trainer: L.Trainer, cfg: GRPOConfig) -> None:
    """Set `max_epochs` to the epochs that the optimizer steps left to `max_steps` take after the epochs done,
    where those are more (a run that `max_steps` alone bounds; see the module's docstring)."""
    loop, batches = trainer.fit_loop, trainer.num_training_batches
    remaining = trainer.max_steps - trainer.global_step
    if remaining <= 0 or not 0 < batches < math.inf:
        return
    done = loop.epoch_progress.current.processed
    needed = done + math.ceil(remaining / (batches * cfg.optimizer_steps_per_batch))
    loop.max_epochs = max(loop.max_epochs, needed)
