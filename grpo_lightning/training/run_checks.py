"""What a `fit` is about to do, checked before any weights load, so that a run never trains to find it.

`check_setup` (the module's `setup`, for every stage): a chat data set needs a chat template; tools and
environments need chat prompts; the data's columns must hold what the rewards and the validation read; a
checkpoint cadence that is not a multiple of a training step's optimizer steps, and a reward with no import
path, are warned about.

`callbacks.fit_checks.FitChecks` (one of `GRPOModule`'s default callbacks) checks, when the Trainer sets up
`fit` (the rows' length also for `validate`; `check_fit` for a script that works before its `fit`):

- the engine (at every stage's set-up): `generation_backend: vllm` where vLLM does not import is refused, and
  so are the engine's own refusals (`check_engine`: `vllm_server`'s servers that cannot be reached or serve
  another model, from the policy's config and the LoRA rank it trains);
- the folders the run writes (`default_root_dir`, the loggers', `ModelCheckpoint`'s, `InterruptCheckpoint`'s):
  a path through a file, or a folder this process cannot write, is refused;
- the metric each `ModelCheckpoint` and `EarlyStopping` monitors: the module logs every `val/...` metric
  itself, so a `val/...` name it does not log is refused with the ones it does, and so is a name without a
  namespace close to one of them (`val_accuracy`); a `val/...` monitor with validation off is warned about;
- the run's length: `max_steps` or `max_epochs` 0 trains nothing and is refused; a decaying learning-rate
  schedule needs `trainer.max_steps` or `max_epochs`; a `max_steps` that is not a multiple of the
  optimizer steps a training step makes is warned about (the module stops at `max_steps`, part-way through
  the last rollout's mini-batches), and so is a warm-up longer than `max_steps` (the learning rate never
  reaches `learning_rate`);
- the rows' length: `max_prompt_length` + `max_completion_length` against the positions the policy has
  (`max_position_embeddings`, read from its config before its weights load): a completion that cannot fit
  is refused, where the pre-flight would sample it for minutes.
"""

from __future__ import annotations

import difflib
import os
import warnings

import lightning as L
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_warn

from grpo_lightning.core.generation.engines import PolicyOutline
from grpo_lightning.core.generation.inference_copy import active_lora
from grpo_lightning.core.generation.prompts import check_chat_template
from grpo_lightning.io.hparams import unimportable_rewards
from grpo_lightning.io.models import model_positions, policy_config
from grpo_lightning.training.callbacks.interrupt_checkpoint import InterruptCheckpoint
from grpo_lightning.training.data import EnvironmentPromptDataModule, PromptDataModule
from grpo_lightning.training.resume import warn_checkpoint_cadence


def check_fit(trainer: L.Trainer, module: L.LightningModule, datamodule: object) -> None:
    """The checks above, for a fit of `module` on `datamodule` with `trainer`: also for a script that works
    before its `fit` (`scripts/demo.py` evaluates the policy first), so that a refused run does no work."""
    check_row_length(module)
    check_output_folders(trainer)
    check_monitors(trainer, logged_metric_names(datamodule, module))
    check_run_length(trainer, module.grpo)


def check_engine(module: L.LightningModule, device: torch.device) -> None:
    """The rollout engine's own checks before any weights load (`PolicyRollouts.check_engine`), on the
    policy's config and the rank of the LoRA adapter it trains; where the config cannot be read before the
    weights (a GGUF file, a hub id not downloaded yet), the engine makes them when it starts."""
    config = policy_config(module.policy, module.policy_source, module.model_options)
    if config is None:
        return
    adapter = active_lora(module.policy) if module.policy is not None else None
    lora_rank = adapter[1].r if adapter is not None else module.lora.r if module.lora is not None else None
    module.rollouts.check_engine(PolicyOutline(config, lora_rank, module.grpo.sampling), device)


def check_output_folders(trainer: L.Trainer) -> None:
    """Each folder the run will write must be a folder, or makeable as one, that this process can write."""
    folders = {"trainer.default_root_dir": trainer.default_root_dir}
    for logger in trainer.loggers:
        folders[f"{type(logger).__name__}.save_dir"] = getattr(logger, "save_dir", None)
    for callback in trainer.callbacks:
        if isinstance(callback, ModelCheckpoint):
            folders[f"ModelCheckpoint(dirpath={callback.dirpath!r})"] = callback.dirpath
        elif isinstance(callback, InterruptCheckpoint):
            folders[f"InterruptCheckpoint(dirpath={callback.dirpath!r})"] = callback.dirpath
    for option, folder in folders.items():
        if folder:
            problem = _unwritable(os.path.abspath(folder))
            if problem:
                raise ValueError(f"{option}: {problem}; the run writes there")


def _unwritable(folder: str) -> str | None:
    """Why `folder` cannot be written (a file on its path, no permission), or None."""
    existing = folder
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{existing} is a file, not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"this process may not write in {existing}"
    return None


def check_row_length(module: L.LightningModule) -> None:
    """A row's longest prompt and completion must fit the positions the policy has: beyond them it computes
    nothing meaningful (or fails), after sampling for as long as `max_completion_length` asks."""
    cfg = module.grpo
    positions = model_positions(module.policy, module.policy_source, module.model_options)
    prompt = cfg.sampling.max_prompt_length or 0
    longest = prompt + cfg.sampling.max_completion_length
    if positions is None or longest <= positions:
        return
    given = (
        f"max_prompt_length={prompt} + max_completion_length={cfg.sampling.max_completion_length} = {longest}"
    )
    if not prompt:
        given = f"max_completion_length={cfg.sampling.max_completion_length}"
    fix = (
        f"lower max_completion_length to at most {positions - prompt}"
        if positions > prompt
        else "lower max_prompt_length and max_completion_length"
    )
    raise ValueError(
        f"model.grpo.{given} tokens per row exceed the {positions} positions of the policy "
        f"(max_position_embeddings in its config): {fix}"
    )


def logged_metric_names(datamodule: object, pl_module: L.LightningModule) -> list[str]:
    """The `val/...` metrics the module logs (every validation set's of `datamodule`), and its rewards'
    `train/...` means."""
    names = pl_module.validation.metric_names(datamodule)
    names += ["train/reward", *(f"train/rewards/{name}" for name in pl_module.reward_names)]
    return names


def check_monitors(trainer: L.Trainer, logged: list[str]) -> None:
    """Refuse a monitored metric that the module will never log (see the module's docstring)."""
    validates = trainer.limit_val_batches != 0
    for callback in trainer.callbacks:
        if not isinstance(callback, ModelCheckpoint | EarlyStopping) or not callback.monitor:
            continue
        monitor, owner = callback.monitor, f"{type(callback).__name__}(monitor={callback.monitor!r})"
        if monitor in logged:
            if monitor.startswith("val/") and not validates:
                rank_zero_warn(
                    f"{owner}: validation never runs (trainer.limit_val_batches=0), so {monitor} is never "
                    "logged and the callback never acts"
                )
            continue
        close = difflib.get_close_matches(monitor, logged, n=1, cutoff=0.8)
        # Another namespace (`gsm8k/`, `monitor/`, `train/`) is another logger's, or a reward's log_metric.
        if monitor.startswith("val/") or (close and "/" not in monitor):
            hint = f"did you mean {close[0]!r}? " if close else ""
            shown = [name for name in logged if name.startswith("val/")]
            raise ValueError(
                f"{owner}: GRPOModule never logs {monitor!r}; {hint}it logs {', '.join(shown)} (and "
                "train/... metrics each step)"
            )


def check_run_length(trainer: L.Trainer, grpo) -> None:
    """A decaying schedule needs a known length; `max_steps` should fall at a training step's end."""
    max_steps, max_epochs = trainer.max_steps, trainer.max_epochs
    if max_steps == 0 or max_epochs == 0:
        option = "max_steps" if max_steps == 0 else "max_epochs"
        raise ValueError(f"trainer.{option}=0: the run would train nothing; give it at least 1")
    unbounded = max_steps < 0 and (max_epochs is None or max_epochs < 0)
    if grpo.optimizer.lr_scheduler_type != "constant" and unbounded:
        raise ValueError(
            f"model.grpo.optimizer.lr_scheduler_type={grpo.optimizer.lr_scheduler_type!r} decays over "
            "the run, whose length is "
            "unknown (trainer.max_steps=-1 and trainer.max_epochs=-1): set trainer.max_steps, or "
            "lr_scheduler_type: constant"
        )
    if grpo.optimizer.warmup_ratio and unbounded:
        raise ValueError(
            f"model.grpo.optimizer.warmup_ratio={grpo.optimizer.warmup_ratio} is a share of the run, whose "
            "length is unknown (trainer.max_steps=-1 and trainer.max_epochs=-1): set trainer.max_steps, or "
            "the warm-up in steps (warmup_steps)"
        )
    warmup = grpo.optimizer.warmup_steps_of(max(max_steps, 0))
    if max_steps > 0 and warmup >= max_steps:  # the warm-up's last rate, (w - 1) / w, is below the full one
        rank_zero_warn(
            f"model.grpo.optimizer.warmup_steps={warmup} does not end before the run does (trainer.max_steps="
            f"{max_steps} optimizer steps): the learning rate never reaches learning_rate="
            f"{grpo.optimizer.learning_rate:g}, only {(max_steps - 1) / warmup:.0%} of it at the last step, "
            "and no step is left for a decay; shorten the warm-up or lengthen the run"
        )
    per_batch = grpo.update.steps_per_generation * grpo.update.num_iterations
    if max_steps > 0 and max_steps % per_batch:
        rank_zero_warn(
            f"trainer.max_steps={max_steps} is not a multiple of the {per_batch} optimizer steps a training "
            f"step makes (model.grpo.update.steps_per_generation={grpo.update.steps_per_generation} x "
            f"num_iterations={grpo.update.num_iterations}): the run stops at step {max_steps}, after "
            f"{max_steps % per_batch} of the last rollout's {per_batch}"
        )


def check_environment_prompts(multi_turn: object) -> None:
    """`EnvironmentPromptDataModule`'s empty prompts need one environment to write them, as TRL's
    `train_dataset=None` does: no `environment_factory`, or a dict of them (which environment would a row
    get?), is refused."""
    factories = getattr(multi_turn, "factories", None)
    if not factories:
        raise ValueError(
            "data: EnvironmentPromptDataModule's prompts are empty user turns that an environment's reset() "
            "writes: set model.environment_factory, or read a data set of prompts with PromptDataModule"
        )
    if multi_turn.multi_environment:
        raise ValueError(
            "data: EnvironmentPromptDataModule with a dict of environments (model.environment_factory): each "
            "row must name its own, so give a data set with an 'environment' column (PromptDataModule), or "
            "pass a single environment class"
        )


def check_setup(module: L.LightningModule, stage: str) -> None:
    """A `GRPOModule`'s checks at `setup(stage)`: after the data module checked its files, before any weights
    load (see the module docstring)."""
    datamodule, trainer = module.trainer.datamodule, module.trainer
    if isinstance(datamodule, EnvironmentPromptDataModule):
        check_environment_prompts(module.rollouts.multi_turn)
    if isinstance(datamodule, PromptDataModule):
        multi_turn = module.rollouts.multi_turn
        if datamodule.conversational:
            check_chat_template(module.tokenizer)
        elif multi_turn is not None and multi_turn.rollout_func is None:
            option = "model.tools" if multi_turn.tools else "model.environment_factory"
            raise ValueError(
                f"{option} needs chat prompts (lists of messages), and data.source's prompts are text: set "
                "data.chat_prompt: true (each text prompt becomes the user's turn), or give the rows chat "
                "messages"
            )
        rewards = module.reward_funcs if stage == "fit" else []
        supplied = multi_turn.supplied_keywords if multi_turn else set()
        validates = trainer.limit_val_batches != 0
        datamodule.check_columns(rewards, module.validation.reward, validates=validates, supplied=supplied)
    if stage == "fit":
        warn_checkpoint_cadence(trainer.checkpoint_callbacks, module.grpo.optimizer_steps_per_batch)
        # Lightning warns on every step-cadence checkpoint of a manually optimised module that it holds the
        # weights after the step's updates, not before. Here that is the point to resume from: the weights,
        # optimizer and schedulers, RNG and data position all of one moment, between two training steps
        # (tests/test_resume.py resumes exactly from it). Nothing to act on.
        warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization")
        for reward in unimportable_rewards(module.hparams):
            rank_zero_warn(
                f"{reward} has no import path: this run's checkpoints cannot rebuild it, and "
                "load_from_checkpoint(ckpt) needs it passed again; define it at a module's top level (or "
                "as a functools.partial of such a function) for checkpoints that load alone"
            )
