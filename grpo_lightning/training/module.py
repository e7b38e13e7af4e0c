"""GRPOModule: the Lightning glue around sampling, rewards and the GRPO update.

A training step: the group source (`self.group_source`, `core/group_source.py`) gives the scored groups of
the update (the policy's samples, G per prompt, by `self.rollouts`, scored by the reward functions; none
while dynamic sampling waits for more), the update (`self.update`, `core/update.py`) builds the trajectory
and hands over each micro-batch's loss, which this module backpropagates and steps, and the step's metrics
are logged.
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Callable

import lightning as L
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.types import OptimizerLRScheduler
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase, TrainerState

from grpo_lightning.core.algorithm.reference_sync import ReferenceSync
from grpo_lightning.core.algorithm.schedules import build_optimizer, build_scheduler
from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.group_source import group_source
from grpo_lightning.core.rewards.scoring import checked_reward_functions, trainer_state
from grpo_lightning.core.rewards.verifiable import reward_name
from grpo_lightning.core.rng import restore_rng_states
from grpo_lightning.core.stop_requests import end_rollout
from grpo_lightning.core.update import RolloutUpdate
from grpo_lightning.io.checkpoints import register_safe_globals
from grpo_lightning.io.distributed import offloaded_to_cpu, ranks_of, shard_models
from grpo_lightning.io.hparams import as_options, resolve_rewards
from grpo_lightning.io.models import (
    LoraOptions,
    ModelOptions,
    check_lora_choice,
    load_model,
    policy_parts,
    prepare_models,
)
from grpo_lightning.training.callbacks.collapse_monitor import CollapseMonitor
from grpo_lightning.training.callbacks.completions_panel import CompletionsPanel
from grpo_lightning.training.callbacks.fit_checks import FitChecks
from grpo_lightning.training.callbacks.interrupt_checkpoint import InterruptCheckpoint
from grpo_lightning.training.callbacks.preflight import Preflight
from grpo_lightning.training.held_out_loops import HeldOutLoops
from grpo_lightning.training.hyperparameters import save_own_hyperparameters
from grpo_lightning.training.lr_schedulers import reading_schedulers
from grpo_lightning.training.manual_optimization import ManualOptimization
from grpo_lightning.training.rollouts import PolicyRollouts
from grpo_lightning.training.run_checks import check_setup
from grpo_lightning.training.step_metrics import RolloutRecord, log_training_step, rollout_metrics
from grpo_lightning.training.tool_rollouts import ToolSampling
from grpo_lightning.training.trainer_options import (
    bound_epochs_by_steps,
    check_after_validation,
    check_one_optimizer,
    map_trainer_options,
    optimizer_steps_in_run,
    planned_optimizer_steps,
    refuse_unsupported_tools,
)
from grpo_lightning.training.training_state import load_module_state, save_module_state
from grpo_lightning.training.validation_scores import ValidationScoring

register_safe_globals()  # our checkpoints hold GRPOConfig & co. and must load under weights_only=True


class GRPOModule(HeldOutLoops, L.LightningModule):
    """Group Relative Policy Optimization (DeepSeekMath, arXiv:2402.03300) with verifiable rewards.

    Each `training_step` takes a batch of prompts, samples `num_generations` completions per prompt with
    the policy, scores them with the reward functions, turns the rewards into group-relative advantages
    and takes `num_iterations` x `steps_per_generation` optimizer steps on the clipped policy loss (with a
    KL penalty to a frozen reference when `beta > 0`), each on a mini-batch of whole groups
    (`core.update`). Optimisation is manual, so one training step may hold several optimizer
    steps (each counted in `global_step`) and several micro-batches. `self.rollouts.sample(prompts, G)`
    samples as a training step does.

    Args:
        policy: hub id or local folder of a causal LM, or an already-built `PreTrainedModel`.
        tokenizer: hub id / folder / tokenizer object; None uses the policy's.
        reward_funcs: reward functions, called as TRL 1.16's `GRPOTrainer` calls them (keywords `prompts`,
            `completions`, `completion_ids`, `trainer_state`, `log_extra`, `log_metric` and every data
            column; see `grpo_lightning.core.rewards.scoring`). Default `[accuracy_reward, format_reward]`;
            with an `environment_factory` whose environment has `get_reward()`, none (None or `[]`): its
            `get_reward` is the reward, as TRL's.
        reward_weights: one weight per reward function. Default all 1.0.
        grpo: the algorithm's options (`GRPOConfig`, every option documented there).
        model_options: how the policy loads (dtype, attention, GGUF, gradient checkpointing).
        lora: LoRA options; None trains all weights.
        num_generations_eval: samples per problem in validation; 1 means greedy decoding. Default 1.
        val_reward: the reward function that judges validation completions, called as the training
            rewards are: `val/accuracy` is the share of completions it gives full marks (>= 1.0; None counts
            as wrong), `val/pass_at_k` the share of problems with one. Use it for answers other than
            numbers, e.g. `trl.rewards.accuracy_reward` (math-verify) for LaTeX `\\boxed{}` answers. Default
            None: the data module's answer column holds a number (or GSM8K's `#### N`), checked by
            `GSM8KAccuracy` (strict and lenient extraction, pass@k, maj@k, format).
        tools: functions (or import paths) the policy may call, as TRL's `tools`: multi-turn rollouts
            (`training.tool_rollouts`, bounded by `grpo.tools`), tool-result tokens out of the loss. Default
            None: single turns.
        environment_factory: a class (or import path), or a dict of them by name, as TRL's: one instance per
            sample, `reset(**row)` (the text it returns appended to the last user turn; with an
            `environment`-column-only data set, the whole prompt), its public methods as tools, `get_reward()`
            as a reward of weight 1.
        rollout_func: `rollout_func(prompts, module)` returning `prompt_ids`, `completion_ids`, `logprobs`
            (optionally `env_mask` and fields for the rewards), as TRL's; instead of the module's sampling.
    """

    def __init__(
        self,
        policy: str | PreTrainedModel,
        tokenizer: str | PreTrainedTokenizerBase | None = None,
        reward_funcs: list[Callable] | None = None,
        reward_weights: list[float] | None = None,
        grpo: GRPOConfig = GRPOConfig(),
        model_options: ModelOptions = ModelOptions(),
        lora: LoraOptions | None = None,
        num_generations_eval: int = 1,
        val_reward: Callable | None = None,
        tools: list[Callable | str] | None = None,
        environment_factory: type | str | dict[str, type | str] | None = None,
        rollout_func: Callable | str | None = None,
    ) -> None:
        super().__init__()
        grpo, model_options, lora = as_options(grpo, model_options, lora)  # dicts: a checkpoint's
        save_own_hyperparameters(self, inspect.currentframe(), GRPOModule, policy=policy, tokenizer=tokenizer)
        reward_funcs, val_reward = resolve_rewards(reward_funcs, val_reward)  # recipes: a checkpoint's
        self.grpo, self.model_options, self.lora = grpo, model_options, lora
        staleness = grpo.async_rollouts.max_staleness
        multi_turn = ToolSampling.of(tools, environment_factory, rollout_func, grpo.tools, self, staleness)
        environment_rewards = len(multi_turn.rewards) if multi_turn is not None else 0
        self.reward_funcs, weights = checked_reward_functions(
            reward_funcs, reward_weights, environment_rewards
        )
        if multi_turn is not None:  # an environment's get_reward is a reward of its own
            self.reward_funcs, weights = multi_turn.with_rewards(self.reward_funcs, weights)
        self.reward_names = [reward_name(fn) for fn in self.reward_funcs]
        check_lora_choice(lora, model_options, (grpo.reference_sync is not None))
        self.policy_source, self.policy, self.tokenizer = policy_parts(policy, tokenizer, model_options)
        self.rollouts = PolicyRollouts(grpo, self.tokenizer)  # encoding, sampling, log-prob scoring
        self.rollouts.multi_turn = multi_turn
        self.register_load_state_dict_post_hook(PolicyRollouts.weights_loaded)
        # Sampling, the rollout checks, the rewards, dynamic sampling's buffer: what each update learns from.
        rewards = (self.reward_funcs, weights, self.reward_names)
        self.group_source = group_source(grpo, self.rollouts, *rewards, self.tokenizer.pad_token_id)
        self.reference: PreTrainedModel | None = None
        self.update: RolloutUpdate | None = None  # the trajectory and the losses, built when `fit` starts
        if self.policy is not None:
            self._prepare_models()
        self.validation = ValidationScoring(num_generations_eval, val_reward)  # checks num_generations_eval
        self.val_accuracy = self.validation.accuracy  # a submodule: it moves with the module
        self.automatic_optimization = False
        # Non-finite updates skipped, the run stopped after many.
        self.optimization = ManualOptimization(grpo.update.max_bad_steps)
        self.last_rollout: RolloutRecord | None = None  # the latest training step's rollout, for callbacks
        self.rng_to_restore: dict | None = None  # RNG states of a checkpoint, applied when training starts
        self._epochs_from_steps = False  # max_epochs set from max_steps (`bound_epochs_by_steps`)
        self._planned_steps = (
            -1
        )  # the run's optimizer steps (`planned_optimizer_steps`), when training starts
        sync = grpo.reference_sync  # TR-DPO
        self.reference_sync = ReferenceSync(sync.sync_steps, sync.mixup_alpha) if sync is not None else None

    def setup(self, stage: str) -> None:
        check_setup(self, stage)  # before any weights load

    def configure_model(self) -> None:
        # Loading here rather than in __init__ lets the data module check its files before any weights
        # load, and lets sharding strategies wrap the model; the guard makes a second call a no-op.
        if self.grpo.run.cpu_offload and self.device_mesh is None:  # said before any weights load
            raise ValueError(
                "grpo.run.cpu_offload needs FSDP2: set trainer.strategy to ModelParallelStrategy"
            )
        if self.policy is None:
            self.policy = load_model(self.policy_source, self.model_options)
            self._prepare_models()
        if self.device_mesh is not None:  # set by ModelParallelStrategy only: FSDP2 sharding
            mesh, precision = self.device_mesh, self.trainer.precision
            shard_models(self.policy, self.reference, mesh, precision, self.grpo.run.cpu_offload)

    def _prepare_models(self) -> None:
        self.policy, self.reference = prepare_models(
            self.policy,
            self.tokenizer,
            self.policy_source,
            self.model_options,
            self.lora,
            self.grpo.kl.beta > 0,
        )
        self.rollouts.policy = self.policy

    def train(self, mode: bool = True) -> GRPOModule:
        super().train(mode)
        if self.reference is not None:
            self.reference.eval()  # frozen: never dropout, whatever Lightning asks of the module
        return self

    def __init_subclass__(cls, **kwargs) -> None:
        # A subclass's own `configure_optimizers` is checked and its schedulers' monitors kept, as ours.
        super().__init_subclass__(**kwargs)
        if "configure_optimizers" in vars(cls):
            cls.configure_optimizers = reading_schedulers(vars(cls)["configure_optimizers"])

    @reading_schedulers
    def configure_optimizers(self) -> OptimizerLRScheduler:
        """AdamW at `grpo.optimizer.learning_rate` with the schedule of `grpo.optimizer.lr_scheduler_type`. A
        subclass may return
        any form Lightning accepts (an optimizer alone, a list, a dict with `lr_scheduler` and its `interval`
        and `frequency`, a `ReduceLROnPlateau` with its `monitor`), with one optimizer over the policy's
        weights: the module steps each scheduler as Lightning would under automatic optimisation
        (`training.lr_schedulers`)."""
        cfg, trainer = self.grpo, self.trainer
        params = [p for p in self.policy.parameters() if p.requires_grad]
        optimizer = build_optimizer(params, cfg.optimizer)
        steps = optimizer_steps_in_run(trainer, cfg)  # the schedule's length
        schedule = (
            cfg.optimizer.warmup_steps_of(steps),
            steps,
            cfg.optimizer.lr_scheduler_type,
            cfg.optimizer.min_lr_ratio,
        )
        # Stepped after every optimizer step (`step_schedulers`): a bare scheduler is Lightning's "epoch".
        scheduler = {"scheduler": build_scheduler(optimizer, *schedule), "interval": "step"}
        return {"optimizer": optimizer, "lr_scheduler": scheduler}

    def configure_callbacks(self) -> list[L.Callback]:
        # Called before Lightning refuses the Trainer's clipping and accumulation under manual optimisation:
        # they become the module's own here, from Python as from the CLI; the tools that do not apply are
        # refused before any of them runs.
        refuse_unsupported_tools(self.trainer, self)
        if self.trainer.state.fn == TrainerFn.FITTING:
            for line in map_trainer_options(self.trainer, self) + check_after_validation(self.trainer):
                rank_zero_info(line)
        # GRPO's monitors (the reward audit in the pre-flight), unless the Trainer holds one of that type.
        defaults = [CollapseMonitor(), InterruptCheckpoint(), FitChecks()]
        if self.grpo.run.log_completions_every > 0:
            defaults.append(CompletionsPanel(every_n_steps=self.grpo.run.log_completions_every))
        if self.grpo.run.preflight:
            defaults.append(Preflight())
        configured = {type(c) for c in self.trainer.callbacks}
        return [c for c in defaults if type(c) not in configured]

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        save_module_state(self, checkpoint)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.rollouts.weights_changed()  # the loaded weights, not the copy's, are sampled next
        load_module_state(self, checkpoint)

    def on_fit_start(self) -> None:
        check_one_optimizer(self.trainer, self.policy)
        self.rollouts.weights_changed()  # whatever changed the policy since, the first rollout samples it
        self.on_validation_start()
        ranks = ranks_of(self.trainer.strategy)
        self.update = RolloutUpdate(self.grpo, self.rollouts.scorer, ranks, self.tokenizer)
        self.group_source.ranks = ranks

    def on_validation_start(self) -> None:  # also `trainer.validate` alone, before the first forward
        # ModelParallelStrategy moved every weight to the device after configure_model; no forward ran yet.
        if self.grpo.run.cpu_offload:
            offloaded_to_cpu(self.policy, self.reference)
        self.rollouts.place(self.device, self.trainer.precision)

    def on_train_batch_start(self, batch: dict[str, list], batch_idx: int) -> None:
        self.optimization.batch_started(self.global_step)
        if self.reference_sync is not None:  # before the rollout that the reference's log-probs are for
            self.reference_sync.apply_due(self.reference, self.policy, self.global_step)

    def on_train_batch_end(self, outputs: Tensor | None, batch: dict[str, list], batch_idx: int) -> None:
        self.optimization.batch_ended(self.trainer)

    def on_train_start(self) -> None:
        trainer = self._trainer  # None where a test calls the hook on a module alone
        self._epochs_from_steps = trainer is not None and trainer.max_epochs == -1 and trainer.max_steps > 0
        if self._epochs_from_steps:
            bound_epochs_by_steps(self.trainer, self.grpo)
        self._planned_steps = planned_optimizer_steps(self.trainer, self.grpo) if trainer is not None else -1
        # Restored here, not on load: the sanity check and the data loader's first fetch come in between.
        if self.rng_to_restore is not None:
            restore_rng_states(self.rng_to_restore)
            self.rng_to_restore = None
        # Lightning loads checkpoints on the CPU, and may do so before moving the module to its device.
        source = self.group_source
        source.load_state_dict(move_data_to_device(source.state_dict(), self.device))

    def training_step(self, batch: dict[str, list], batch_idx: int) -> Tensor | None:
        start = time.perf_counter()
        scored = self.group_source.next(batch, self._trainer_state(batch_idx))
        end_rollout()  # the rollout is in: on several ranks, they agree here (if not before) whether to stop
        if scored is None:
            self.last_rollout = None  # no update on this batch: nothing new for the callbacks
            return None
        sourced = self.group_source.report  # what sampling and scoring measured
        models = (self.policy, self.reference)
        trajectory = self.update.trajectory(scored, *models, sourced.stats, self.global_step)
        stats, updates = self.optimization.rollout_steps(self, trajectory)  # each optimizer step's metrics
        extra = {**sourced.reward_metrics, **self.rollouts.engine_metrics()}  # rewards', the engine's speed
        metrics = rollout_metrics(
            trajectory,
            {**trajectory.stats, **{name: torch.tensor(v) for name, v in extra.items()}},
            self.reward_names,
            skipped_steps=self.optimization.step_guard.bad_steps,
            generate_seconds=sourced.generate_seconds,
            step_seconds=time.perf_counter() - start,
        )
        log_training_step(self, metrics, updates, batch_size=trajectory.rewards.numel())
        self.last_rollout = RolloutRecord.of(
            trajectory, self.reward_names, float(stats["entropy"]), sourced.columns
        )
        return stats["loss"]

    def _trainer_state(self, batch_idx: int) -> TrainerState:
        """The reward functions' `trainer_state`, as TRL's: optimizer steps so far, fractional epoch."""
        trainer = self.trainer
        batches = trainer.num_training_batches
        epoch = trainer.current_epoch + (batch_idx / batches if 0 < batches < math.inf else 0.0)
        planned = self._planned_steps if trainer.training else planned_optimizer_steps(trainer, self.grpo)
        return trainer_state(self.global_step, planned, epoch, trainer.max_epochs or -1)

    def on_train_epoch_end(self) -> None:
        self.optimization.epoch_ended(self.trainer)
        if self._epochs_from_steps:  # before Lightning checks max_epochs: raised if the steps are not made
            bound_epochs_by_steps(self.trainer, self.grpo)
