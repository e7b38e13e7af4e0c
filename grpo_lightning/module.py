"""GRPOModule: the Lightning glue around sampling, rewards and the GRPO loss."""

from __future__ import annotations

import copy
import math
import time
import warnings
from collections.abc import Callable
from contextlib import nullcontext

import lightning as L
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo_lightning.config import GRPOConfig, option_differences
from grpo_lightning.credit import step_credit_penalties
from grpo_lightning.data import PromptDataModule
from grpo_lightning.distributed import (
    call_in_root_forward,
    gather_per_rank,
    gathered_for_generation,
    is_sharded,
    mixed_precision_policy,
    shard_model,
)
from grpo_lightning.dynamic_sampling import GroupBuffer, ScoredGroups
from grpo_lightning.loss import group_advantages, grpo_loss, kl_in_reward
from grpo_lightning.metrics import GSM8KAccuracy, RewardAccuracy
from grpo_lightning.models import (
    LoraOptions,
    ModelOptions,
    apply_lora,
    load_model,
    load_tokenizer,
    prepare_tokenizer,
)
from grpo_lightning.monitoring import CollapseMonitor, CompletionsPanel, RolloutRecord
from grpo_lightning.preflight import Preflight
from grpo_lightning.resume import (
    InterruptCheckpoint,
    capture_rng_states,
    register_safe_globals,
    restore_rng_states,
    state_of_rank,
)
from grpo_lightning.rewards import accuracy_reward, format_reward, reward_name
from grpo_lightning.sampling import Rollout, completion_logprobs, generate_completions, stop_token_ids
from grpo_lightning.scoring import RewardInputs, call_reward, score_completions, trainer_state
from grpo_lightning.shared_prompt import (
    group_completion_logprobs,
    prefill_groups,
    rows_share_prompts,
    sharing_unsupported,
)
from grpo_lightning.static_rollout import StaticEngine, static_unsupported

REFERENCE_PREFIX = "reference."
register_safe_globals()  # our checkpoints hold GRPOConfig & co. and must load under weights_only=True


class GRPOModule(L.LightningModule):
    """Group Relative Policy Optimization (DeepSeekMath, arXiv:2402.03300) with verifiable rewards.

    Each `training_step` takes a batch of prompts, samples `num_generations` completions per prompt with
    the policy, scores them with the reward functions, turns the rewards into group-relative advantages
    and takes `num_iterations` optimizer steps on the clipped policy loss (with a KL penalty to a frozen
    reference when `beta > 0`). Optimisation is manual, so one training step may hold several optimizer
    steps and several micro-batches.

    Args:
        policy: hub id or local folder of a causal LM, or an already-built `PreTrainedModel`.
        tokenizer: hub id / folder / tokenizer object; None uses the policy's.
        reward_funcs: reward functions, called as TRL 1.16's `GRPOTrainer` calls them (keywords `prompts`,
            `completions`, `completion_ids`, `trainer_state`, `log_extra`, `log_metric` and every data
            column; see `grpo_lightning.scoring`). Default `[accuracy_reward, format_reward]`.
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
        self.save_hyperparameters(ignore=["policy", "tokenizer", "reward_funcs", "val_reward"])
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
        self.register_buffer("reward_weights", torch.tensor(weights, dtype=torch.float32), persistent=False)
        if num_generations_eval < 1:
            raise ValueError(f"num_generations_eval must be >= 1, got {num_generations_eval}")
        self.num_generations_eval = num_generations_eval

        if model_options.load_in_4bit and lora is None:
            raise ValueError(
                "ModelOptions.load_in_4bit trains LoRA adapters over a frozen 4-bit base: set `lora`"
            )
        self.policy_source = policy if isinstance(policy, str) else None
        self.policy: PreTrainedModel | None = None if isinstance(policy, str) else policy
        if tokenizer is None and self.policy_source is None:
            raise ValueError("pass a tokenizer along with an already-built policy model")
        if tokenizer is None or isinstance(tokenizer, str):
            tokenizer = load_tokenizer(tokenizer or self.policy_source, self.model_options.gguf_file)
        self.tokenizer = prepare_tokenizer(tokenizer)
        self.reference: PreTrainedModel | None = None
        if self.policy is not None:
            self._prepare_models()
        self.val_reward = val_reward
        self.val_accuracy = (
            GSM8KAccuracy(k=num_generations_eval)
            if val_reward is None
            else RewardAccuracy(k=num_generations_eval)
        )
        self.automatic_optimization = False
        self._bad_steps = 0
        self.last_rollout: RolloutRecord | None = None  # the latest training step's rollout, for callbacks
        self.group_buffer = GroupBuffer(  # dynamic sampling's waiting groups
            grpo.dynamic_sampling_max_rounds, self._dynamic_sampling_metric_column()
        )
        self._rng_to_restore: dict | None = None  # RNG states of a checkpoint, applied when training starts
        self._rng_outside_validation: dict | None = None
        self._share_prompt: bool | None = None  # grpo.share_prompt where the policy supports it, decided once
        self._rollout_engine: _EagerRollouts | StaticEngine | None = None  # built at the first rollout

    def _dynamic_sampling_metric_column(self) -> int | None:
        metric = self.grpo.dynamic_sampling_metric
        if not self.grpo.dynamic_sampling or metric is None:
            return None
        names = [reward_name(fn) for fn in self.reward_funcs]
        if metric not in names:
            raise ValueError(
                f"GRPOConfig.dynamic_sampling_metric={metric!r} is not one of the reward functions {names}: "
                "name the one that says whether a completion is right, or null for their weighted total"
            )
        return names.index(metric)

    # ----------------------------------------------------------------------------------------- models
    def setup(self, stage: str) -> None:
        # Chat prompts need a template: a tokenizer without one fails here, after the data module checked its
        # files but before any weights load, instead of at the first step.
        datamodule = self.trainer.datamodule
        if isinstance(datamodule, PromptDataModule) and datamodule.conversational:
            self.check_chat_template()

    def configure_model(self) -> None:
        # Loading here rather than in __init__ lets the data module check its files before any weights
        # load, and lets sharding strategies wrap the model; the guard makes a second call a no-op.
        if self.policy is None:
            self.policy = load_model(self.policy_source, self.model_options)
            self._prepare_models()
        mesh = self.device_mesh  # set by ModelParallelStrategy only: FSDP2 sharding
        if mesh is not None and not is_sharded(self.policy):
            if mesh["tensor_parallel"].size() != 1:
                raise ValueError("GRPOModule shards with FSDP2 only: set tensor_parallel_size=1")
            mp_policy = mixed_precision_policy(self.trainer.precision)
            for model in (self.policy, self.reference):  # the reference is sharded too, never gathered whole
                if model is not None:
                    shard_model(model, mesh["data_parallel"], mp_policy)

    def _prepare_models(self) -> None:
        opts = self.model_options
        if opts.gradient_checkpointing:
            self.policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.lora is not None:
            self.policy = apply_lora(self.policy, self.lora)
            if opts.gradient_checkpointing:
                self.policy.enable_input_require_grads()  # else the frozen embeddings cut the LoRA gradient
        elif self.grpo.beta > 0:
            self.reference = copy.deepcopy(self.policy)
        if self.reference is not None:
            self.reference.requires_grad_(False).eval()
        self.policy.config.use_cache = True
        self.policy.train()  # from_pretrained returns eval mode; Lightning keeps the modes it finds

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
        warmup = max(1, cfg.warmup_steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        return [optimizer], [scheduler]

    def configure_callbacks(self) -> list[L.Callback]:
        # GRPO's own monitors run by default. Lightning would let these replace a Trainer callback of the
        # same type, so one that the Trainer's config already holds is kept as configured instead.
        # The reward audit is part of the pre-flight block (RewardAuditCallback stays for other modules).
        defaults = [CollapseMonitor(), InterruptCheckpoint()]
        if self.grpo.log_completions_every > 0:
            defaults.append(CompletionsPanel(every_n_steps=self.grpo.log_completions_every))
        if self.grpo.preflight:
            defaults.append(Preflight())
        configured = {type(c) for c in self.trainer.callbacks}
        return [c for c in defaults if type(c) not in configured]

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # What Lightning does not store, for an exact resume: the generators that sampling draws from, the
        # count of consecutive non-finite steps and dynamic sampling's waiting groups (not its options).
        # The data position is the data module's state. The generators and the waiting groups are each
        # rank's own (each samples its own prompts): all ranks' go into the checkpoint, on the CPU.
        # Interrupted during validation (SIGTERM), the generators are the training stream's, saved before it.
        buffer = {k: v for k, v in vars(self.group_buffer).items() if k not in GroupBuffer.OPTIONS}
        own = {
            "rng": self._rng_outside_validation or capture_rng_states(),
            "group_buffer": move_data_to_device(buffer, "cpu"),
        }
        checkpoint["grpo_state"] = {"bad_steps": self._bad_steps, "per_rank": gather_per_rank(own)}
        # The reference never changes: it is rebuilt from the policy's source, not stored a second time.
        # Sharded checkpoints keep it: the strategy loads them in place and checks every key.
        if is_sharded(self.policy):
            return
        state = checkpoint["state_dict"]
        for key in [k for k in state if k.startswith(REFERENCE_PREFIX)]:
            del state[key]

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        # Lightning restores weights and state into this module as built: its options win. Said, not silent.
        changed = option_differences(checkpoint.get("hyper_parameters", {}), dict(self.hparams))
        if changed:
            listed = "; ".join(
                f"{key}: checkpoint {theirs!r}, this module {ours!r}" for key, theirs, ours in changed
            )
            rank_zero_warn(f"the checkpoint was trained with other options, this module's apply: {listed}")
        if self.reference is not None and "state_dict" in checkpoint:  # a sharded one was loaded in place
            for key, value in self.reference.state_dict().items():
                checkpoint["state_dict"].setdefault(REFERENCE_PREFIX + key, value)
        if "grpo_state" in checkpoint:
            state = checkpoint["grpo_state"]
            self._bad_steps = state["bad_steps"]
            world = self.trainer.world_size if self._trainer is not None else 1
            own = state_of_rank(state["per_rank"], self.global_rank, world)
            self._rng_to_restore = own["rng"]
            vars(self.group_buffer).update(own["group_buffer"])

    def on_train_start(self) -> None:
        # Restored here, not on load: the sanity check and the data loader's first fetch come in between.
        if self._rng_to_restore is not None:
            restore_rng_states(self._rng_to_restore)
            self._rng_to_restore = None
        # Lightning loads checkpoints on the CPU, and may do so before moving the module to its device.
        vars(self.group_buffer).update(move_data_to_device(vars(self.group_buffer), self.device))

    # ----------------------------------------------------------------------------------------- rollout
    def check_chat_template(self) -> None:
        if not self.tokenizer.chat_template:
            raise ValueError(
                "the tokenizer has no chat template but the prompts are chat messages: set "
                "`tokenizer.chat_template` (e.g. copy the instruct model's), or use plain-text prompts"
            )

    def encode_prompts(self, prompts: list) -> tuple[Tensor, Tensor]:
        """Apply the chat template to conversational prompts and tokenize, left-padded: `[N, P]` each."""
        tok = self.tokenizer
        conversational = isinstance(prompts[0], list)
        if conversational:
            self.check_chat_template()
        texts = (
            [tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
            if conversational
            else list(prompts)
        )
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=not conversational)
        ids, mask = enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device)
        limit = self.grpo.max_prompt_length
        if limit is not None and ids.size(1) > limit:
            longest = int(mask.sum(1).max())
            if self.grpo.truncate_prompts == "error":
                raise ValueError(f"a prompt has {longest} tokens, over max_prompt_length={limit}")
            warnings.warn(
                f"prompt of {longest} tokens cut from the left to max_prompt_length={limit}", stacklevel=2
            )
            ids, mask = (
                ids[:, -limit:],
                mask[:, -limit:],
            )  # left padding: the last `limit` columns hold the ends
        return ids, mask

    def eos_token_ids(self) -> list[int]:
        return stop_token_ids(self.policy, self.tokenizer)

    def shares_prompt(self) -> bool:
        """Whether each group's prompt is encoded once (`grpo.share_prompt`, if the policy can)."""
        if self._share_prompt is None:
            reason = sharing_unsupported(self.policy) if self.grpo.share_prompt else None
            if reason is not None:
                warnings.warn(f"grpo.share_prompt: {reason}; every prompt is encoded G times", stacklevel=2)
            self._share_prompt = self.grpo.share_prompt and reason is None
        return self._share_prompt

    def rollout_engine(self) -> _EagerRollouts | StaticEngine:
        """What samples the rollouts (`grpo.generation_backend`), decided and built at the first rollout."""
        if self._rollout_engine is not None:
            return self._rollout_engine
        cfg = self.grpo
        backend = cfg.generation_backend
        if backend == "auto":
            backend = "static" if self.device.type == "cuda" else "eager"
        reason = static_unsupported(self.policy) if backend == "static" else None
        if reason is not None:
            warnings.warn(
                f"grpo.generation_backend={cfg.generation_backend!r}: {reason}; rollouts use eager decoding",
                stacklevel=2,
            )
            backend = "eager"
        settings = {
            "max_new_tokens": cfg.max_completion_length,
            "min_new_tokens": cfg.min_completion_length,
            "eos_token_ids": tuple(self.eos_token_ids()),
            "pad_token_id": self.tokenizer.pad_token_id,
            "temperature": cfg.temperature,
            "top_p": cfg.top_p,
            "top_k": cfg.top_k,
            "share_prompt": self.shares_prompt(),
        }
        if backend == "eager":
            self._rollout_engine = _EagerRollouts(**settings)
        else:
            precision = str(self.trainer.precision) if self._trainer is not None else ""
            dtype = {"bf16": torch.bfloat16, "16": torch.float16}.get(precision.split("-")[0])
            self._rollout_engine = StaticEngine(
                **settings,
                dtype=dtype,
                compile=self.device.type == "cuda",
                max_prompt_tokens=cfg.max_prompt_length,
            )
        return self._rollout_engine

    def sample(
        self, prompts: list, num_generations: int, do_sample: bool = True
    ) -> tuple[Rollout, list[str]]:
        """Generate `num_generations` completions per prompt and decode them."""
        ids, mask = self.encode_prompts(prompts)
        engine = self.rollout_engine()
        # Sharded: full weights once, no collective per token. The static engine generates on its own copy
        # of them, filled from the gathered weights once and refreshed after each optimizer step.
        gather = not isinstance(engine, StaticEngine) or engine.copy is None
        with gathered_for_generation(self.policy) if gather else nullcontext():
            rollout = engine.generate(
                self.policy, ids, mask, num_generations=num_generations, do_sample=do_sample
            )
        completions = self.tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)
        return rollout, completions

    def logprobs(self, model: PreTrainedModel, rollout: Rollout, rows: slice, with_entropy: bool = False):
        if self.shares_prompt() and rows_share_prompts(rollout, self.grpo.num_generations):
            scorer, inputs = group_completion_logprobs, (rollout, rows, self.grpo.num_generations)
        else:
            inputs = (rollout.input_ids[rows], rollout.attention_mask[rows], rollout.completion_ids.size(1))
            scorer = completion_logprobs
        return call_in_root_forward(  # sharded: the root's FSDP hooks gather the embeddings and LM head
            model,
            scorer,
            model,
            *inputs,
            temperature=self.grpo.temperature,
            with_entropy=with_entropy,
            entropy_grad=with_entropy and self.grpo.entropy_coef != 0,
        )

    def _micro_batches(self, size: int) -> list[slice]:
        step = self.grpo.micro_batch_size or size
        return [slice(i, min(i + step, size)) for i in range(0, size, step)]

    @torch.no_grad()
    def _frozen_logprobs(self, rollout: Rollout, model: PreTrainedModel) -> Tensor:
        rows = self._micro_batches(rollout.completion_ids.size(0))
        return torch.cat([self.logprobs(model, rollout, r)[0] for r in rows])  # [B, T]

    # ----------------------------------------------------------------------------------------- training
    def training_step(self, batch: dict[str, list], batch_idx: int) -> Tensor | None:
        cfg, G = self.grpo, self.grpo.num_generations
        start = time.perf_counter()
        rollout, completions = self.sample(batch["prompt"], G)
        generate_seconds = time.perf_counter() - start
        self._check_rollout(rollout, completions)

        scores = score_completions(
            self.reward_funcs, self.reward_inputs(batch, rollout, completions, batch_idx)
        )
        rewards_per_func = scores.rewards.to(self.device)  # [B, F]
        rewards = (rewards_per_func.nan_to_num(0.0) * self.reward_weights).sum(dim=1)  # [B]
        prompts, extra = batch["prompt"], {}  # extra: metrics of the options below, logged with the loss's
        logged_columns = scores.extra  # log_extra's columns, for the completions panel
        if cfg.dynamic_sampling:
            scored = ScoredGroups(prompts, rollout, completions, rewards_per_func, rewards, G)
            filled = self._dynamic_sampling(scored)
            if filled is None:
                self.last_rollout = None  # no update on this batch: nothing new for the callbacks
                return None
            groups, extra = filled
            logged_columns = {}  # they belong to this round's completions, not to the buffered groups
            prompts, rollout, completions = groups.prompts, groups.rollout, groups.completions
            rewards_per_func, rewards = groups.rewards_per_func, groups.rewards

        mask = rollout.completion_mask.float()  # [B, T]
        if cfg.mask_truncated_completions:
            mask = mask * (~rollout.truncated).float()[:, None]
        ref_logprobs = None
        if cfg.beta > 0:
            with self.reference_context():
                ref_logprobs = self._frozen_logprobs(rollout, self.reference or self.policy)  # [B, T]
        # With one pass per rollout the sampling policy is the current one: grpo_loss uses logprobs.detach().
        # The KL in the reward needs the sampling policy's log-probs before any update all the same.
        sampling_logprobs_needed = cfg.num_iterations > 1 or cfg.use_kl_in_reward
        old_logprobs = self._frozen_logprobs(rollout, self.policy) if sampling_logprobs_needed else None
        outcome = rewards  # [B] what the reward functions gave, logged as train/reward
        if cfg.use_kl_in_reward:
            outcome = kl_in_reward(
                rewards, old_logprobs, ref_logprobs, rollout.completion_mask, cfg.beta, cfg.kl_estimator
            )  # [B]
            extra["kl_reward_penalty"] = (rewards - outcome).mean()
        advantages = self._advantages(outcome)  # [B]
        token_advantages = advantages  # [B], or [B, T] with step credit
        if cfg.step_credit > 0:
            penalties = step_credit_penalties(
                self.tokenizer, rollout.completion_ids, rollout.completion_mask, cfg.step_credit
            )  # [B, T]
            token_advantages = advantages[:, None] + penalties  # [B, T]
            extra["step_credit/frac_tokens"] = (penalties < 0).sum() / rollout.completion_mask.sum()

        # Normalise over the whole rollout on every rank, not per micro-batch; DDP then averages gradients
        # over ranks, hence the division by the world size.
        world = self.trainer.world_size
        total_tokens = self.trainer.strategy.reduce(mask.sum(), reduce_op="sum") / world
        total_sequences = torch.tensor(float(mask.size(0)), device=self.device)

        optimizer = self.optimizers()
        scheduler = self.lr_schedulers()
        for _ in range(cfg.num_iterations):
            stats, grad_norm = self._optimizer_step(
                optimizer,
                rollout,
                token_advantages,
                mask,
                old_logprobs,
                ref_logprobs,
                total_tokens,
                total_sequences,
            )
            if grad_norm is not None:
                scheduler.step()
        step_seconds = time.perf_counter() - start
        stats = {**stats, **extra, **{name: torch.tensor(v) for name, v in scores.metrics.items()}}
        self._log_step(
            rewards, rewards_per_func, rollout, mask, stats, grad_norm, generate_seconds, step_seconds
        )
        self.last_rollout = RolloutRecord(
            prompts=prompts,
            completions=completions,
            reward_names=[reward_name(fn) for fn in self.reward_funcs],
            rewards_per_func=rewards_per_func.cpu(),
            rewards=rewards.cpu(),
            advantages=advantages.cpu(),
            completion_lengths=rollout.completion_mask.sum(dim=1).cpu(),
            truncated=rollout.truncated.cpu(),
            num_generations=G,
            entropy=float(stats["entropy"]),
            extra=logged_columns,
        )
        return stats["loss"]

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

    def _advantages(self, outcome: Tensor) -> Tensor:
        """Group-relative advantages of this rank's `[B]` rewards. With `scale_rewards="batch"` the std is
        that of the whole batch over all ranks, as TRL computes it."""
        cfg = self.grpo
        args = (cfg.num_generations, cfg.scale_rewards, cfg.baseline, cfg.advantage_clip)
        if cfg.scale_rewards != "batch" or self.trainer.world_size == 1:
            return group_advantages(outcome, *args)  # [B]
        # As lists: B may differ between ranks (dynamic sampling's update at an epoch's short last batch).
        per_rank = gather_per_rank(outcome.tolist())
        everyone = torch.tensor(sum(per_rank, []), dtype=outcome.dtype, device=outcome.device)  # [sum of B]
        start = sum(len(rewards) for rewards in per_rank[: self.global_rank])
        return group_advantages(everyone, *args)[start : start + outcome.numel()]  # [B]

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
        """Warn when a rollout cannot teach anything: every completion empty, or every one cut off."""
        if not any(text.strip() for text in completions):
            lengths = rollout.completion_mask.sum(dim=1)  # [B] tokens, the EOS included
            ended_at_once = int(((lengths == 1) & ~rollout.truncated).sum())
            if ended_at_once == len(completions):
                cause = (
                    "the policy ends at once; check the chat template and the end-of-sequence ids "
                    f"{self.eos_token_ids()}"
                )
            else:
                written, tokens = len(completions) - ended_at_once, int(lengths.sum())
                vocab, known = self.policy.config.vocab_size, len(self.tokenizer)
                cause = (
                    f"{written} have tokens ({tokens} in all) that decode to nothing (whitespace, special "
                    f"tokens, or ids past the tokenizer's {known}: the model's vocabulary has {vocab})"
                    + (f", {ended_at_once} end at once" if ended_at_once else "")
                )
            warnings.warn(f"all {len(completions)} completions of this step are empty: {cause}", stacklevel=2)
        elif bool(rollout.truncated.all()):
            warnings.warn(
                f"all {len(completions)} completions of this step reached max_completion_length="
                f"{self.grpo.max_completion_length} without an end-of-sequence token: answers are cut off "
                "before their final line; raise grpo.max_completion_length",
                stacklevel=2,
            )

    def _optimizer_step(
        self, optimizer, rollout, advantages, mask, old_logprobs, ref_logprobs, total_tokens, total_sequences
    ) -> tuple[dict[str, Tensor], Tensor | None]:
        cfg = self.grpo
        optimizer.zero_grad()
        sums: dict[str, Tensor] = {}
        for rows in self._micro_batches(mask.size(0)):
            logprobs, entropies = self.logprobs(self.policy, rollout, rows, with_entropy=True)
            loss, stats = grpo_loss(
                logprobs,
                advantages[rows],
                mask[rows],
                old_logprobs=None if old_logprobs is None else old_logprobs[rows],
                ref_logprobs=None if ref_logprobs is None else ref_logprobs[rows],
                loss_type=cfg.loss_type,
                importance_sampling_level=cfg.importance_sampling_level,
                epsilon=cfg.epsilon,
                epsilon_high=cfg.epsilon_high,
                delta=cfg.delta,
                beta=0.0 if cfg.use_kl_in_reward else cfg.beta,  # else the KL is in the rewards already
                kl_estimator=cfg.kl_estimator,
                max_completion_length=cfg.max_completion_length,
                entropies=entropies,
                entropy_coef=cfg.entropy_coef,
                total_tokens=total_tokens,
                total_sequences=total_sequences,
            )
            self.manual_backward(loss)
            weight = mask[rows].sum() / mask.sum().clamp(min=1)  # token share of this micro-batch
            sums["loss"] = sums.get("loss", 0.0) + loss.detach()
            for key, value in stats.items():
                # The micro-batch losses are shares of the rollout's (whole-rollout denominators): they add
                # up. The other stats are micro-batch means, weighted by their token share.
                sums[key] = sums.get(key, 0.0) + (value if key == "policy_loss" else value * weight)
        params = [p for p in self.policy.parameters() if p.requires_grad]
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        if scaler is not None:  # 16-mixed: clip the true gradients; fused AdamW would unscale only in step
            scaler.unscale_(optimizer.optimizer)
        max_norm = cfg.max_grad_norm if cfg.max_grad_norm is not None else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if scaler is not None and torch.isfinite(sums["loss"]) and not torch.isfinite(grad_norm):
            optimizer.step()  # the scaler sees the overflow: it skips the update and lowers the loss scale
            warnings.warn(f"step {self.global_step}: fp16 gradients overflowed, update skipped", stacklevel=2)
            return sums, None
        if not (torch.isfinite(sums["loss"]) and torch.isfinite(grad_norm)):
            optimizer.zero_grad()
            self._bad_steps += 1
            warnings.warn(
                f"step {self.global_step}: loss or gradient not finite, update skipped", stacklevel=2
            )
            if self._bad_steps >= cfg.max_bad_steps:
                raise FloatingPointError(
                    f"{self._bad_steps} consecutive steps with a non-finite loss or gradient (max_bad_steps="
                    f"{cfg.max_bad_steps}): lower the learning rate, or check the rewards and the model's "
                    "dtype"
                )
            return sums, None
        self._bad_steps = 0
        optimizer.step()
        if isinstance(self._rollout_engine, StaticEngine):  # the eager engine samples from the policy itself
            with gathered_for_generation(self.policy):
                self._rollout_engine.weights_updated(self.policy)
        return sums, grad_norm

    def _log_step(
        self, rewards, rewards_per_func, rollout, mask, stats, grad_norm, generate_seconds, step_seconds
    ):
        G = self.grpo.num_generations
        lengths = rollout.completion_mask.sum(dim=1).float()  # [B]
        grouped = rewards.view(-1, G)  # [N, G]
        metrics = {
            "train/reward": rewards.mean(),
            "train/reward_std": rewards.std() if rewards.numel() > 1 else torch.zeros(()),
            "train/frac_reward_zero_std": (grouped.std(dim=1) < 1e-6).float().mean(),
            "train/completion_length": lengths.mean(),
            "train/completion_length_min": lengths.min(),
            "train/completion_length_max": lengths.max(),
            "train/frac_truncated": rollout.truncated.float().mean(),
            "train/tokens_per_second": torch.tensor(lengths.sum().item() / step_seconds),
            "train/generate_seconds": torch.tensor(generate_seconds),
            "train/step_seconds": torch.tensor(step_seconds),
            "train/learning_rate": torch.tensor(self.optimizers().param_groups[0]["lr"]),
            "train/skipped_steps": torch.tensor(float(self._bad_steps)),
        }
        if grad_norm is not None:
            metrics["train/grad_norm"] = grad_norm
        for i, fn in enumerate(self.reward_funcs):
            metrics[f"train/rewards/{reward_name(fn)}"] = rewards_per_func[:, i].nanmean()
        for key, value in stats.items():
            metrics[f"train/{key}"] = value
        metrics = {k: v.detach().float().to(self.device) for k, v in metrics.items()}
        self.log_dict(metrics, on_step=True, on_epoch=False, batch_size=rewards.numel())
        self.log("reward", metrics["train/reward"], prog_bar=True, logger=False, batch_size=rewards.numel())

    # ----------------------------------------------------------------------------------------- validation
    def on_validation_epoch_start(self) -> None:
        # Validation sampling must not move the training stream: how often it runs (or whether a resumed
        # run repeats it) then never changes which completions training samples.
        self._rng_outside_validation = capture_rng_states()

    def validation_step(self, batch: dict[str, list], batch_idx: int) -> dict[str, list[str]]:
        k = self.num_generations_eval
        rollout, completions = self.sample(batch["prompt"], k, do_sample=k > 1)
        if self.val_reward is not None:
            scores = call_reward(self.val_reward, self.reward_inputs(batch, rollout, completions, batch_idx))
            self.val_accuracy.update([0.0 if v is None else v for v in scores])
        else:
            self.val_accuracy.update(completions, batch[self._answer_column(batch)])
        self.log(
            "val/completion_length",
            rollout.completion_mask.sum(1).float().mean(),
            batch_size=len(completions),
            sync_dist=True,
        )
        return {"completions": completions}  # for callbacks such as ValidationResultsWriter

    def _answer_column(self, batch: dict[str, list]) -> str:
        """The batch column validation checks completions against: the data module's answer column."""
        column = getattr(self.trainer.datamodule, "answer_column", "answer")
        if column not in batch:
            raise ValueError(
                f"validation checks answers against a reference, but the data has no answer column "
                f"{column!r} (columns: {sorted(batch)}): set data.answer_field to the reference's column, "
                "or model.val_reward to a reward function that judges the completions"
            )
        return column

    def on_validation_epoch_end(self) -> None:
        results = self.val_accuracy.compute()
        # Outside inference mode: states reset inside `trainer.validate` would become inference tensors,
        # which a later validation within `fit` (no_grad only) could not update in place.
        with torch.inference_mode(False):
            self.val_accuracy.reset()
        for key, value in results.items():
            self.log(f"val/{key}", value, prog_bar=key == "accuracy")
        restore_rng_states(self._rng_outside_validation)
        self._rng_outside_validation = None  # back on the training stream


class _EagerRollouts:
    """Rollouts through `generate` on the policy itself with a dynamic KV cache (`generate_completions`), each
    group's prompt prefilled once with `share_prompt`: the reference path behind the rollout seam."""

    def __init__(self, *, share_prompt: bool, eos_token_ids: tuple[int, ...], **sampling) -> None:
        self.share_prompt = share_prompt
        self.sampling = {**sampling, "eos_token_ids": list(eos_token_ids)}

    def generate(
        self,
        model: PreTrainedModel,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        *,
        num_generations: int,
        do_sample: bool = True,
    ) -> Rollout:
        G = num_generations
        prefill = prefill_groups(model, prompt_ids, prompt_mask, G) if self.share_prompt else None
        return generate_completions(
            model,
            prompt_ids,
            prompt_mask,
            num_generations=G,
            do_sample=do_sample,
            prompt_cache=prefill,
            **self.sampling,
        )

    def weights_updated(self, model: PreTrainedModel) -> None:
        """Nothing to do: generation reads the policy's own weights."""
