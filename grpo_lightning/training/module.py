"""GRPOModule: the Lightning glue around sampling, rewards and the GRPO loss."""

from __future__ import annotations

import functools
import math
import time
import warnings
from collections.abc import Callable
from contextlib import nullcontext

import lightning as L
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo_lightning.core.algorithm.batching import MicroBatch, logprobs_in_micro_batches, micro_batches
from grpo_lightning.core.algorithm.dynamic_sampling import GroupBuffer
from grpo_lightning.core.algorithm.reference_sync import ReferenceSync
from grpo_lightning.core.algorithm.schedules import build_scheduler, optimizer_steps_in_fit
from grpo_lightning.core.algorithm.step_metrics import training_step_metrics
from grpo_lightning.core.algorithm.trajectory import build_trajectory
from grpo_lightning.core.algorithm.update import (
    StepGuard,
    accumulate_gradients,
    mini_batch_denominators,
    mini_batches,
)
from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.generation.engines import (
    RolloutEngine,
    check_chat_template,
    warn_if_unteachable,
)
from grpo_lightning.core.generation.packing import PackedLogProbScorer, packing_unsupported
from grpo_lightning.core.generation.sampling import stop_token_ids
from grpo_lightning.core.metrics import GSM8KAccuracy, RewardAccuracy
from grpo_lightning.core.rewards.scoring import (
    RewardInputs,
    check_reward_weights,
    score_completions,
    trainer_state,
)
from grpo_lightning.core.rewards.verifiable import accuracy_reward, format_reward, reward_name
from grpo_lightning.core.rng import capture_rng_states, restore_rng_states
from grpo_lightning.core.types import Rollout, ScoredGroups, Trajectory
from grpo_lightning.io.checkpoints import (
    as_options,
    portable_hparams,
    register_safe_globals,
    resolve_callable,
)
from grpo_lightning.io.distributed import (
    gather_per_rank,
    is_sharded,
    shard_models,
)
from grpo_lightning.io.export import check_fits
from grpo_lightning.io.models import (
    LoraOptions,
    ModelOptions,
    load_model,
    load_tokenizer,
    prepare_models,
    prepare_tokenizer,
)
from grpo_lightning.trainer_options import check_after_validation, map_trainer_options
from grpo_lightning.training.data import PromptDataModule
from grpo_lightning.training.monitoring import CollapseMonitor, CompletionsPanel, RolloutRecord
from grpo_lightning.training.preflight import Preflight
from grpo_lightning.training.resume import InterruptCheckpoint
from grpo_lightning.training.rollouts import PolicyRollouts
from grpo_lightning.training.run_checks import FitChecks
from grpo_lightning.training.training_state import (
    check_resumed_data,
    drop_reference,
    load_grpo_state,
    reference_syncs_of,
    restore_reference,
    save_grpo_state,
    warn_changed_options,
)
from grpo_lightning.training.validation import ValidationScoring

register_safe_globals()  # our checkpoints hold GRPOConfig & co. and must load under weights_only=True


def _weights_loaded(module: GRPOModule, incompatible_keys) -> None:
    module.rollouts.weights_changed()


class GRPOModule(L.LightningModule):
    """Group Relative Policy Optimization (DeepSeekMath, arXiv:2402.03300) with verifiable rewards.

    Each `training_step` takes a batch of prompts, samples `num_generations` completions per prompt with
    the policy, scores them with the reward functions, turns the rewards into group-relative advantages
    and takes `num_iterations` x `steps_per_generation` optimizer steps on the clipped policy loss (with a
    KL penalty to a frozen reference when `beta > 0`), each on a mini-batch of whole groups
    (`core.update.mini_batches`). Optimisation is manual, so one training step may hold several optimizer
    steps (each counted in `global_step`) and several micro-batches.

    Args:
        policy: hub id or local folder of a causal LM, or an already-built `PreTrainedModel`.
        tokenizer: hub id / folder / tokenizer object; None uses the policy's.
        reward_funcs: reward functions, called as TRL 1.16's `GRPOTrainer` calls them (keywords `prompts`,
            `completions`, `completion_ids`, `trainer_state`, `log_extra`, `log_metric` and every data
            column; see `grpo_lightning.core.rewards.scoring`). Default `[accuracy_reward, format_reward]`.
        reward_weights: one weight per reward function. Default all 1.0.
        grpo: the algorithm's options (`GRPOConfig`, every option documented there).
        model_options: how the policy loads (dtype, attention, GGUF, gradient checkpointing).
        lora: LoRA options; None trains all weights.
        num_generations_eval: samples per problem in validation; 1 means greedy decoding. Default 1.
        val_reward: the reward function that judges validation completions, called as the training
            rewards are: `val/accuracy` is the share of completions it gives full marks (>= 1.0; None counts
            as wrong), `val/pass@k` the share of problems with one. Use it for answers other than
            numbers, e.g. `trl.rewards.accuracy_reward` (math-verify) for LaTeX `\\boxed{}` answers. Default
            None: the data module's answer column holds a number (or GSM8K's `#### N`), checked by
            `GSM8KAccuracy` (strict and lenient extraction, pass@k, maj@k, format).
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
    ) -> None:
        super().__init__()
        grpo, model_options, lora = as_options(grpo, model_options, lora)  # dicts: a checkpoint's
        self.save_hyperparameters(ignore=["policy", "tokenizer"])
        portable_hparams(self.hparams, policy, tokenizer)  # what load_from_checkpoint(ckpt) needs
        if reward_funcs is not None:
            reward_funcs = [resolve_callable(fn, f"reward_funcs[{i}]") for i, fn in enumerate(reward_funcs)]
        if val_reward is not None:
            val_reward = resolve_callable(val_reward, "val_reward")
        self.grpo = grpo
        self.model_options = model_options
        self.lora = lora
        self.reward_funcs = (
            list(reward_funcs) if reward_funcs is not None else [accuracy_reward, format_reward]
        )
        if not self.reward_funcs:
            raise ValueError("reward_funcs is empty: GRPO needs at least one reward function")
        weights = reward_weights if reward_weights is not None else [1.0] * len(self.reward_funcs)
        if len(weights) != len(self.reward_funcs):
            raise ValueError(
                f"reward_weights has {len(weights)} values for {len(self.reward_funcs)} reward_funcs"
            )
        check_reward_weights(weights, self.reward_funcs)
        self.register_buffer("reward_weights", torch.tensor(weights, dtype=torch.float32), persistent=False)
        if num_generations_eval < 1:
            raise ValueError(f"num_generations_eval must be >= 1, got {num_generations_eval}")
        self.num_generations_eval = num_generations_eval

        if grpo.sync_ref_model and lora is not None:
            raise ValueError(
                "grpo.sync_ref_model with LoRA: the reference is the policy's own base weights (adapters "
                "off), which LoRA never changes; sync needs full fine-tuning (a separate reference)"
            )
        if model_options.load_in_4bit and lora is None:
            raise ValueError(
                "ModelOptions.load_in_4bit trains LoRA adapters over a frozen 4-bit base: set `lora`"
            )
        if policy is None:
            raise ValueError(
                "policy is None: give a hub id, a model folder or a PreTrainedModel (the checkpoint of a "
                "module built from a model object without a name_or_path cannot say where its policy came "
                "from: load_from_checkpoint(ckpt, policy=...))"
            )
        self.policy_source = policy if isinstance(policy, str) else None
        self.policy: PreTrainedModel | None = None if isinstance(policy, str) else policy
        if tokenizer is None and self.policy_source is None:
            raise ValueError("pass a tokenizer along with an already-built policy model")
        if tokenizer is None or isinstance(tokenizer, str):
            tokenizer = load_tokenizer(tokenizer or self.policy_source, self.model_options.gguf_file)
        self.tokenizer = prepare_tokenizer(tokenizer)
        self.rollouts = PolicyRollouts(grpo, self.tokenizer)  # encoding, sampling, log-prob scoring
        # After any `load_state_dict` (Lightning restoring, or a user) rollouts sample the loaded weights.
        self.register_load_state_dict_post_hook(_weights_loaded)
        self._packs_sequences: bool | None = None  # grpo.packed_sequences where the policy can, decided once
        self.reference: PreTrainedModel | None = None
        if self.policy is not None:
            self._prepare_models()
        self.val_reward = val_reward
        self.val_accuracy = (
            GSM8KAccuracy(k=num_generations_eval)
            if val_reward is None
            else RewardAccuracy(k=num_generations_eval)
        )
        self.validation = ValidationScoring(num_generations_eval, val_reward, self.val_accuracy)
        self.automatic_optimization = False
        self.step_guard = StepGuard(grpo.max_bad_steps)  # skips non-finite updates, stops after too many
        self.last_rollout: RolloutRecord | None = None  # the latest training step's rollout, for callbacks
        self.group_buffer = GroupBuffer.for_config(
            grpo, self.reward_names
        )  # dynamic sampling's waiting groups
        self._rng_to_restore: dict | None = None  # RNG states of a checkpoint, applied when training starts
        self._step_learning_rate = grpo.learning_rate  # the last optimizer step's, for train/learning_rate
        self.reference_sync = (
            ReferenceSync(grpo.ref_model_sync_steps, grpo.ref_model_mixup_alpha)
            if grpo.sync_ref_model
            else None
        )

    # ----------------------------------------------------------------------------------------- models
    def setup(self, stage: str) -> None:
        # Chat prompts need a template: a tokenizer without one fails here, after the data module checked its
        # files but before any weights load, instead of at the first step.
        datamodule = self.trainer.datamodule
        if isinstance(datamodule, PromptDataModule):
            if datamodule.conversational:
                self.check_chat_template()
            rewards = self.reward_funcs if stage == "fit" else []
            datamodule.check_columns(rewards, self.val_reward, validates=self.trainer.limit_val_batches != 0)
        if stage != "fit":
            return
        # ModelCheckpoint tests the global step after each training step, which adds this many at once.
        per_batch = self.grpo.num_iterations * self.grpo.steps_per_generation
        for callback in self.trainer.checkpoint_callbacks:
            every = getattr(callback, "_every_n_train_steps", 0)
            if every % per_batch:
                rank_zero_warn(
                    f"ModelCheckpoint(every_n_train_steps={every}) counts optimizer steps, of which a "
                    f"training step makes {per_batch} (grpo.num_iterations x steps_per_generation): it saves "
                    f"only where a multiple of both falls; set a multiple of {per_batch}"
                )

    def configure_model(self) -> None:
        # Loading here rather than in __init__ lets the data module check its files before any weights
        # load, and lets sharding strategies wrap the model; the guard makes a second call a no-op.
        if self.grpo.cpu_offload and self.device_mesh is None:  # said before any weights load
            raise ValueError("grpo.cpu_offload needs FSDP2: set trainer.strategy to ModelParallelStrategy")
        if self.policy is None:
            self.policy = load_model(self.policy_source, self.model_options)
            self._prepare_models()
        if self.device_mesh is not None:  # set by ModelParallelStrategy only: FSDP2 sharding
            mesh, precision = self.device_mesh, self.trainer.precision
            shard_models(self.policy, self.reference, mesh, precision, self.grpo.cpu_offload)

    def _prepare_models(self) -> None:
        self.policy, self.reference = prepare_models(
            self.policy, self.tokenizer, self.policy_source, self.model_options, self.lora, self.grpo.beta > 0
        )

    def train(self, mode: bool = True) -> GRPOModule:
        super().train(mode)
        if self.reference is not None:
            self.reference.eval()  # frozen: never dropout, whatever Lightning asks of the module
        return self

    def reference_context(self):
        """Where the reference log-probs come from: the frozen copy, or the policy with LoRA switched off."""
        if self.lora is not None and self.grpo.beta > 0:
            return self.policy.disable_adapter()
        return nullcontext()

    def configure_optimizers(self):
        cfg = self.grpo
        params = [p for p in self.policy.parameters() if p.requires_grad]
        # fused: one kernel for all tensors, as transformers' default "adamw_torch_fused"; the per-tensor
        # loop costs ~4x more, 0.6 CPU-s a step for a 135M model on CPU.
        optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay, fused=True)
        trainer = self.trainer

        def total_steps() -> int:  # asked once training runs and the batches per epoch are known
            batches = trainer.num_training_batches
            per_rollout = cfg.num_iterations * cfg.steps_per_generation
            return optimizer_steps_in_fit(trainer.max_steps, trainer.max_epochs, batches, per_rollout)

        scheduler = build_scheduler(
            optimizer, cfg.warmup_steps, total_steps, cfg.lr_scheduler_type, cfg.min_lr_ratio
        )
        return [optimizer], [scheduler]

    def configure_callbacks(self) -> list[L.Callback]:
        # GRPO's own monitors run by default. Lightning would let these replace a Trainer callback of the
        # same type, so one that the Trainer's config already holds is kept as configured instead.
        # The reward audit is part of the pre-flight block (RewardAuditCallback stays for other modules).
        # Lightning calls this hook before it refuses the Trainer's clipping and accumulation options under
        # manual optimisation: they become the module's own here, from Python as from the CLI.
        if self.trainer.state.fn == TrainerFn.FITTING:
            for line in map_trainer_options(self.trainer, self) + check_after_validation(self.trainer):
                rank_zero_info(line)
        defaults = [CollapseMonitor(), InterruptCheckpoint(), FitChecks()]
        if self.grpo.log_completions_every > 0:
            defaults.append(CompletionsPanel(every_n_steps=self.grpo.log_completions_every))
        if self.grpo.preflight:
            defaults.append(Preflight())
        configured = {type(c) for c in self.trainer.callbacks}
        return [c for c in defaults if type(c) not in configured]

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # Interrupted during validation (SIGTERM), the generators are the training stream's, saved before it.
        rng = self.validation.training_rng or capture_rng_states()
        syncs = self.reference_sync.syncs_done if self.reference_sync is not None else None
        save_grpo_state(checkpoint, self.step_guard.bad_steps, rng, self.group_buffer, syncs)
        if not is_sharded(self.policy) and self.reference_sync is None:  # a synced reference is stored
            drop_reference(checkpoint)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.rollouts.weights_changed()  # the loaded weights, not the copy's, are sampled next
        warn_changed_options(checkpoint.get("hyper_parameters", {}), dict(self.hparams))
        if self._trainer is not None and self.trainer.training and self.trainer.datamodule is not None:
            new_data = getattr(self.trainer, "new_data", False)  # GRPOTrainer.fit's
            check_resumed_data(checkpoint, self.trainer.datamodule, new_data)
        if self.reference is not None:
            restore_reference(checkpoint, self.reference)
        if "state_dict" in checkpoint and self.strict_loading:  # one line, not load_state_dict's dump
            check_fits(self.state_dict(), checkpoint["state_dict"], self._trainer and self._trainer.ckpt_path)
        world = self.trainer.world_size if self._trainer is not None else 1
        own = load_grpo_state(checkpoint, self.global_rank, world)
        if own is not None:
            self.step_guard.bad_steps = own.bad_steps
            self._rng_to_restore = own.rng
            vars(self.group_buffer).update(own.group_buffer)
        if self.reference_sync is not None:
            self.reference_sync.syncs_done = reference_syncs_of(checkpoint, self.reference_sync.every)

    def on_fit_start(self) -> None:
        self.rollouts.weights_changed()  # whatever changed the policy since, the first rollout samples it
        # ModelParallelStrategy moved every weight to the device after configure_model; FSDP2 keeps
        # offloaded shards on the CPU and refuses them anywhere else. No forward has run yet.
        if self.grpo.cpu_offload:
            for model in (self.policy, self.reference):
                if model is not None:
                    model.to("cpu")

    def on_validation_start(self) -> None:
        self.on_fit_start()  # `trainer.validate` alone: the same move, before the first forward

    def on_train_batch_start(self, batch: dict[str, list], batch_idx: int) -> None:
        if self.reference_sync is not None:  # before the rollout that the reference's log-probs are for
            self.reference_sync.apply_due(self.reference, self.policy, self.global_step)

    def on_train_start(self) -> None:
        # Restored here, not on load: the sanity check and the data loader's first fetch come in between.
        if self._rng_to_restore is not None:
            restore_rng_states(self._rng_to_restore)
            self._rng_to_restore = None
        # Lightning loads checkpoints on the CPU, and may do so before moving the module to its device.
        vars(self.group_buffer).update(move_data_to_device(vars(self.group_buffer), self.device))

    # ----------------------------------------------------------------------------------------- rollout
    def check_chat_template(self) -> None:
        check_chat_template(self.tokenizer)

    def shares_prompt(self) -> bool:
        """Whether each group's prompt is encoded once (`grpo.share_prompt`, if the policy can)."""
        return self.rollouts.shares_prompt(self.policy)

    def _precision(self) -> str | None:
        return self.trainer.precision if self._trainer is not None else None

    def build_rollout_engine(self) -> RolloutEngine:
        """The engine that generates the rollouts (`grpo.generation_backend`), in the trainer's precision."""
        return self.rollouts.build_engine(self.policy, self.device, self._precision())

    @property
    def rollout_engine(self) -> RolloutEngine:
        """Built once the policy is loaded, and again when the trainer's precision is not the one it was built
        for: a module that sampled before `fit` (an evaluation before training) must not keep its float32
        inference copy under `bf16-mixed`."""
        precision = self._precision()
        if self.rollouts.engine is None or self.rollouts.engine_precision != precision:
            self.rollouts.engine = self.build_rollout_engine()
            self.rollouts.engine_precision = precision
        return self.rollouts.engine

    def encode_prompts(self, prompts: list) -> tuple[Tensor, Tensor]:
        """Apply the chat template to conversational prompts and tokenize, left-padded: `[N, P]` each."""
        return self.rollouts.prompt_encoder.encode(prompts, self.device)

    def sample(
        self, prompts: list, num_generations: int, do_sample: bool = True
    ) -> tuple[Rollout, list[str]]:
        """Generate `num_generations` completions per prompt and decode them."""
        return self.rollouts.sample(
            self.rollout_engine, self.policy, prompts, num_generations, do_sample, self.device
        )

    def packs_sequences(self) -> bool:
        """Whether the log-prob passes pack their rows (`grpo.packed_sequences`, if the policy can)."""
        if self._packs_sequences is None:
            reason = packing_unsupported(self.policy) if self.grpo.packed_sequences else None
            if reason is not None:
                warnings.warn(f"grpo.packed_sequences: {reason}; the passes run padded rows", stacklevel=2)
            self._packs_sequences = self.grpo.packed_sequences and reason is None
        return self._packs_sequences

    def logprobs(self, model: PreTrainedModel, rollout: Rollout, rows: slice, with_entropy: bool = False):
        """`(logprobs, entropies)` `[b, T]` of `rollout`'s `rows` under `model`."""
        scorer = self.rollouts.scorer(self.policy)
        if self.packs_sequences():
            scorer = PackedLogProbScorer(**vars(scorer))
        return scorer(model, rollout, rows, with_entropy)

    def micro_batches(self, rollout: Rollout) -> list[MicroBatch]:
        """`rollout`'s micro-batches: `micro_batch_size` rows, or by `max_tokens_per_micro_batch` (a
        prompt's G rows kept together where they share its prompt pass)."""
        cfg = self.grpo
        group = cfg.num_generations if self.shares_prompt() else 1
        options = (cfg.micro_batch_size, cfg.max_tokens_per_micro_batch, group)
        parts = micro_batches(rollout, *options)
        if cfg.max_tokens_per_micro_batch is None or self.trainer.world_size == 1:
            return parts
        # Each forward/backward synchronises the ranks (DDP, FSDP2): all run as many as the busiest.
        most = int(self.all_gather(torch.tensor(len(parts), device=self.device)).max())
        return micro_batches(rollout, *options, at_least=most)

    def _frozen_logprobs(self, rollout: Rollout, model: PreTrainedModel) -> Tensor:
        return logprobs_in_micro_batches(self.logprobs, model, rollout, self.micro_batches(rollout))  # [B, T]

    def _weights_updated(self) -> None:
        self.rollouts.weights_changed()  # a static engine's copy takes them before the next rollout

    # ----------------------------------------------------------------------------------------- training
    def training_step(self, batch: dict[str, list], batch_idx: int) -> Tensor | None:
        cfg = self.grpo
        start = time.perf_counter()
        rollout, completions = self.sample(batch["prompt"], cfg.num_generations)
        generate_seconds = time.perf_counter() - start
        self._check_rollout(rollout, completions)
        scores = score_completions(
            self.reward_funcs, self.reward_inputs(batch, rollout, completions, batch_idx)
        )
        rewards_per_func = scores.rewards.to(self.device)  # [B, F]
        rewards = (rewards_per_func.nan_to_num(0.0) * self.reward_weights).sum(dim=1)  # [B]
        scored = ScoredGroups(
            batch["prompt"], rollout, completions, rewards_per_func, rewards, cfg.num_generations
        )
        logged_columns, stats = scores.extra, {}  # log_extra's columns, for the completions panel
        if cfg.dynamic_sampling:
            filled = self._dynamic_sampling(scored)
            if filled is None:
                self.last_rollout = None  # no update on this batch: nothing new for the callbacks
                return None
            (scored, stats), logged_columns = filled, {}  # the columns belong to this round, not the update's

        trajectory = self._trajectory(scored, stats)
        stats, grad_norm = self._update(trajectory)
        step_seconds = time.perf_counter() - start
        extra = {**scores.metrics, **self.rollouts.engine_metrics()}  # rewards' metrics, the engine's speed
        stats = {**stats, **trajectory.stats, **{name: torch.tensor(v) for name, v in extra.items()}}
        metrics = training_step_metrics(
            trajectory,
            stats,
            grad_norm,
            self.reward_names,
            learning_rate=self._step_learning_rate,
            skipped_steps=self.step_guard.bad_steps,
            generate_seconds=generate_seconds,
            step_seconds=step_seconds,
        )
        metrics = {k: v.to(self.device) for k, v in metrics.items()}
        batch_size = trajectory.rewards.numel()
        self.log_dict(metrics, on_step=True, on_epoch=False, batch_size=batch_size)
        self.log("reward", metrics["train/reward"], prog_bar=True, logger=False, batch_size=batch_size)
        self.last_rollout = RolloutRecord.of(
            trajectory, self.reward_names, float(stats["entropy"]), logged_columns
        )
        return stats["loss"]

    @property
    def reward_names(self) -> list[str]:
        return [reward_name(fn) for fn in self.reward_funcs]

    def _trajectory(self, scored: ScoredGroups, stats: dict[str, Tensor]) -> Trajectory:
        """The reference and old-policy passes over `scored`'s rollout, then `build_trajectory`."""
        cfg = self.grpo
        ref_logprobs = None
        if cfg.beta > 0:
            with self.reference_context():
                ref_logprobs = self._frozen_logprobs(scored.rollout, self.reference or self.policy)  # [B, T]
        # With one step per rollout the sampling policy is the current one: grpo_loss uses logprobs.detach().
        # The KL in the reward needs the sampling policy's log-probs before any update all the same.
        several_steps = cfg.num_iterations > 1 or cfg.steps_per_generation > 1
        sampling_logprobs_needed = several_steps or cfg.use_kl_in_reward
        old_logprobs = (
            self._frozen_logprobs(scored.rollout, self.policy) if sampling_logprobs_needed else None
        )
        batch_std_over_ranks = cfg.scale_rewards == "batch" and self.trainer.world_size > 1
        return build_trajectory(
            scored,
            cfg,
            old_logprobs=old_logprobs,
            ref_logprobs=ref_logprobs,
            tokenizer=self.tokenizer,
            gather=self._everyones_rewards if batch_std_over_ranks else None,
            stats=stats,
        )

    def _everyones_rewards(self, rewards: Tensor) -> tuple[Tensor, int]:
        """The `[B]` rewards of every rank, in rank order, and where this rank's start."""
        # As lists: B may differ between ranks (dynamic sampling's update at an epoch's short last batch).
        per_rank = gather_per_rank(rewards.tolist())
        everyone = torch.tensor(sum(per_rank, []), dtype=rewards.dtype, device=rewards.device)  # [sum of B]
        return everyone, sum(len(r) for r in per_rank[: self.global_rank])

    def _update(self, trajectory: Trajectory) -> tuple[dict[str, Tensor], Tensor | None]:
        """`num_iterations` passes over `trajectory`'s `steps_per_generation` mini-batches, an optimizer step
        each: the last one's statistics and gradient norm."""
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        sum_over_ranks = functools.partial(self.trainer.strategy.reduce, reduce_op="sum")
        max_steps = self.trainer.max_steps  # -1: no limit
        for _ in range(self.grpo.num_iterations):
            for mini_batch in mini_batches(trajectory, self.grpo.steps_per_generation):
                denominators = mini_batch_denominators(mini_batch, sum_over_ranks, self.trainer.world_size)
                stats, grad_norm = self._optimizer_step(optimizer, mini_batch, *denominators)
                if grad_norm is not None:
                    self._step_learning_rate = optimizer.param_groups[0]["lr"]  # this update's, for the log
                    scheduler.step()
                    self._weights_updated()
                if 0 <= max_steps <= self.global_step:  # the run ends here, part-way through the rollout
                    return stats, grad_norm
        return stats, grad_norm

    def reward_inputs(
        self, batch: dict[str, list], rollout: Rollout, completions: list[str], batch_idx: int
    ) -> RewardInputs:
        """What the reward functions get for the rollout's completions of `batch`'s prompts: the prompts and
        every other column repeated for each prompt's group, as TRL repeats them, the completions' token ids
        (end-of-sequence token included, padding left out) and the trainer's state."""
        completion_ids = [
            ids[m.bool()].tolist()
            for ids, m in zip(rollout.completion_ids, rollout.completion_mask, strict=True)
        ]
        trainer = self.trainer
        batches = trainer.num_training_batches
        epoch = trainer.current_epoch + (batch_idx / batches if 0 < batches < math.inf else 0.0)
        state = trainer_state(self.global_step, trainer.max_steps, epoch, trainer.max_epochs or -1)
        return RewardInputs.of_groups(batch, completions, completion_ids, state)

    def _dynamic_sampling(self, groups: ScoredGroups) -> tuple[ScoredGroups, dict[str, Tensor]] | None:
        """Buffer this round's informative groups; the update's groups once there are enough, else None."""
        self.group_buffer.add(groups)
        # Every rank must update together (DDP and FSDP synchronise inside the update): wait while any waits.
        waiting = torch.tensor(float(not self.group_buffer.ready()), device=self.device)
        if self.trainer.strategy.reduce(waiting, reduce_op="sum") > 0:
            return None
        groups, stats = self.group_buffer.pop(self.tokenizer.pad_token_id)
        return groups, {f"dynamic_sampling/{key}": torch.tensor(value) for key, value in stats.items()}

    def _check_rollout(self, rollout: Rollout, completions: list[str]) -> None:
        eos = stop_token_ids(self.policy, self.tokenizer)
        warn_if_unteachable(
            rollout,
            completions,
            eos,
            self.grpo.max_completion_length,
            tokenizer_size=len(self.tokenizer),
            vocab_size=self.policy.config.vocab_size,
        )

    def _optimizer_step(
        self, optimizer, trajectory: Trajectory, total_tokens: Tensor, total_sequences: Tensor
    ) -> tuple[dict[str, Tensor], Tensor | None]:
        """One optimizer step on `trajectory`, micro-batch by micro-batch: its statistics, and the gradient
        norm if the step was taken (None when the step guard skipped it)."""
        cfg = self.grpo
        optimizer.zero_grad()
        parts = self.micro_batches(trajectory.rollout)
        denominators = (total_tokens, total_sequences)
        sums = accumulate_gradients(
            self.logprobs, self.policy, trajectory, parts, cfg, *denominators, self.manual_backward
        )
        params = [p for p in self.policy.parameters() if p.requires_grad]
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        if scaler is not None:  # 16-mixed: clip the true gradients; fused AdamW would unscale only in step
            scaler.unscale_(optimizer.optimizer)
        max_norm = cfg.max_grad_norm if cfg.max_grad_norm is not None else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        taken = self.step_guard.step(optimizer, sums.loss, grad_norm, scaler is not None, self.global_step)
        return sums.values, grad_norm if taken else None

    # ----------------------------------------------------------------------------------------- validation
    def on_validation_epoch_start(self) -> None:
        self.validation.start(self.trainer.datamodule, self.device)

    def validation_step(
        self, batch: dict[str, list], batch_idx: int, dataloader_idx: int = 0
    ) -> dict[str, list[str]]:
        return self.validation.step(batch, batch_idx, dataloader_idx, self.sample, self.reward_inputs)

    def on_validation_epoch_end(self) -> None:
        for key, value in self.validation.end().items():
            self.log(key, value, prog_bar=key == "val/accuracy", add_dataloader_idx=False)
