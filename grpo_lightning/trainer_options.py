"""The Trainer's own optimisation options, as Lightning users set them, for a module optimising manually.

Lightning refuses `accumulate_grad_batches` and `gradient_clip_val` under manual optimisation (with a
`MisconfigurationException` traceback). `GRPOModule` has the same things as options of its own, so the CLI
maps them there before anything is built:

- `trainer.accumulate_grad_batches: N` (one optimizer step per N batches of B prompts) becomes
  `data.batch_size: N * B` prompts per step, with `model.grpo.micro_batch_size: B * G` (one batch's
  sequences per forward/backward, as Lightning accumulates one batch at a time) unless one is set already.
  The loss is normalised over the whole step's rollout either way.
- `trainer.gradient_clip_val: c` (clipping by the global norm, Lightning's default algorithm) becomes
  `model.grpo.max_grad_norm: c`. Clipping by value has no counterpart: refused, naming our option.
"""

from __future__ import annotations

from jsonargparse import Namespace

from grpo_lightning.core.config import GRPOConfig

DEFAULT_MAX_GRAD_NORM = GRPOConfig.max_grad_norm


def map_trainer_options(trainer: Namespace, model: Namespace, data: Namespace) -> list[str]:
    """Move the Trainer's accumulation and clipping options onto the module's (`model.grpo`) and the data
    module's (`data.init_args.batch_size`) in these parsed configs, in place; returns a line per mapping.
    Raises ValueError naming our option where there is no counterpart or the two disagree."""
    grpo = model["grpo"]
    done = []
    accumulate = trainer.get("accumulate_grad_batches", 1)
    if accumulate != 1:
        init_args = data.get("init_args") or Namespace()
        batch_size = init_args.get("batch_size")
        if not isinstance(batch_size, int) or not isinstance(accumulate, int) or accumulate < 1:
            raise ValueError(
                f"trainer.accumulate_grad_batches={accumulate!r}: GRPOModule optimises manually; it takes a "
                "larger data.batch_size (prompts per optimizer step) with model.grpo.micro_batch_size "
                "(sequences per backward) instead: set those"
            )
        init_args["batch_size"] = batch_size * accumulate
        if grpo["micro_batch_size"] is None:
            grpo["micro_batch_size"] = batch_size * grpo["num_generations"]
        trainer["accumulate_grad_batches"] = 1
        done.append(
            f"trainer.accumulate_grad_batches={accumulate} -> data.batch_size={batch_size * accumulate}, "
            f"model.grpo.micro_batch_size={grpo['micro_batch_size']} (GRPOModule optimises manually)"
        )
    clip = trainer.get("gradient_clip_val")
    if clip is not None and clip > 0:
        if trainer.get("gradient_clip_algorithm") not in (None, "norm"):
            raise ValueError(
                f"trainer.gradient_clip_algorithm={trainer['gradient_clip_algorithm']!r}: GRPOModule clips "
                "the gradients by their global norm only, with model.grpo.max_grad_norm: remove the "
                "Trainer's clipping options and set that"
            )
        if grpo["max_grad_norm"] not in (DEFAULT_MAX_GRAD_NORM, clip):
            raise ValueError(
                f"trainer.gradient_clip_val={clip} and model.grpo.max_grad_norm={grpo['max_grad_norm']} "
                "disagree: GRPOModule clips with model.grpo.max_grad_norm; set only that"
            )
        grpo["max_grad_norm"] = float(clip)
        trainer["gradient_clip_val"] = None
        done.append(f"trainer.gradient_clip_val={clip} -> model.grpo.max_grad_norm={float(clip)}")
    return done
