"""The Trainer's own options, as Lightning users set them, for a module that optimises manually.

Lightning refuses `accumulate_grad_batches` and `gradient_clip_val` under manual optimisation (with a
`MisconfigurationException` traceback). `GRPOModule` has the same things as options of its own, and maps the
Trainer's onto them when the Trainer attaches it, from Python and from the CLI alike (`configure_callbacks`,
the module's hook that Lightning calls before it checks these options):

- `accumulate_grad_batches=N` (one optimizer step per N batches of B prompts) becomes the data module's
  `batch_size=N * B` prompts per step, with `grpo.micro_batch_size=B * G` (one batch's sequences per
  forward/backward, as Lightning accumulates one batch at a time) unless one is set already. The loss is
  normalised over the whole step's rollout either way.
- `gradient_clip_val=c` (clipping by the global norm, Lightning's default algorithm) becomes
  `grpo.max_grad_norm=c`. Clipping by value has no counterpart: refused, naming our option.

The run's length in optimizer steps, which a decaying learning-rate schedule needs, comes from the same
options (`optimizer_steps_in_run`).

And one default that a GRPO run needs: an `EarlyStopping` on a validation metric (`val/...`) whose
`check_on_train_epoch_end` is left unset checks after each validation (`check_on_train_epoch_end=False`).
Lightning would otherwise check it at the training epoch's end whenever `val_check_interval` is 1.0, and a
run that `max_steps` ends mid-epoch, before its first validation, would stop with "metric not available".
"""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import EarlyStopping

from grpo_lightning.core.algorithm.schedules import optimizer_steps_in_fit
from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.options import plain_options

DEFAULT_MAX_GRAD_NORM = GRPOConfig.max_grad_norm
VALIDATION_PREFIX = "val/"  # the metrics that only validation logs


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
                "larger data.batch_size (prompts per optimizer step) with model.grpo.micro_batch_size "
                "(sequences per backward) instead: set those"
            )
        data.hparams.batch_size = batch_size * accumulate
        if grpo.micro_batch_size is None:
            grpo.micro_batch_size = batch_size * grpo.num_generations
        trainer.accumulate_grad_batches = 1
        done.append(
            f"trainer.accumulate_grad_batches={accumulate} -> data.batch_size={batch_size * accumulate}, "
            f"model.grpo.micro_batch_size={grpo.micro_batch_size} (GRPOModule optimises manually)"
        )
    clip = trainer.gradient_clip_val
    if clip is not None and clip > 0:
        algorithm = getattr(trainer.gradient_clip_algorithm, "value", trainer.gradient_clip_algorithm)
        if algorithm not in (None, "norm"):
            raise ValueError(
                f"trainer.gradient_clip_algorithm={algorithm!r}: GRPOModule clips "
                "the gradients by their global norm only, with model.grpo.max_grad_norm: remove the "
                "Trainer's clipping options and set that"
            )
        if grpo.max_grad_norm not in (DEFAULT_MAX_GRAD_NORM, clip):
            raise ValueError(
                f"trainer.gradient_clip_val={clip} and model.grpo.max_grad_norm={grpo.max_grad_norm} "
                "disagree: GRPOModule clips with model.grpo.max_grad_norm; set only that"
            )
        grpo.max_grad_norm = float(clip)
        trainer.gradient_clip_val = None
        done.append(f"trainer.gradient_clip_val={clip} -> model.grpo.max_grad_norm={float(clip)}")
    if done:
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
    """The optimizer steps `fit` makes at most, the length of a decaying learning-rate schedule: from the
    Trainer's `max_steps` (which counts them under the module's manual optimisation) and `max_epochs`
    (`schedules.optimizer_steps_in_fit`), the training data loaded for its batches per epoch. 0 for a
    constant schedule, which reads no length (and nothing is loaded)."""
    if cfg.lr_scheduler_type == "constant":
        return 0
    trainer.estimated_stepping_batches  # noqa: B018  (loads the training data: its batches per epoch)
    batches = trainer.num_training_batches
    return optimizer_steps_in_fit(
        trainer.max_steps, trainer.max_epochs, batches, cfg.optimizer_steps_per_batch
    )
