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
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo_lightning.config import GRPOConfig
from grpo_lightning.loss import group_advantages, grpo_loss
from grpo_lightning.metrics import GSM8KAccuracy
from grpo_lightning.models import LoraOptions, ModelOptions, apply_lora, load_model, load_tokenizer, prepare_tokenizer
from grpo_lightning.rewards import accuracy_reward, format_reward, reward_name
from grpo_lightning.sampling import Rollout, completion_logprobs, generate_completions
from grpo_lightning.scoring import score_completions

REFERENCE_PREFIX = "reference."


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
        reward_funcs: TRL-style reward functions, `fn(completions, **columns) -> list[float | None]`.
            Default `[accuracy_reward, format_reward]`.
        reward_weights: one weight per reward function. Default all 1.0.
        grpo: the algorithm's options (`GRPOConfig`, every option documented there).
        model_options: how the policy loads (dtype, attention, GGUF, gradient checkpointing).
        lora: LoRA options; None trains all weights.
        num_generations_eval: samples per problem in validation; 1 means greedy decoding. Default 1.
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
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["policy", "tokenizer", "reward_funcs"])
        self.grpo = grpo
        self.model_options = model_options
        self.lora = lora
        self.reward_funcs = list(reward_funcs) if reward_funcs is not None else [accuracy_reward, format_reward]
        if not self.reward_funcs:
            raise ValueError("reward_funcs is empty: GRPO needs at least one reward function")
        weights = reward_weights if reward_weights is not None else [1.0] * len(self.reward_funcs)
        if len(weights) != len(self.reward_funcs):
            raise ValueError(f"reward_weights has {len(weights)} values for {len(self.reward_funcs)} reward_funcs")
        self.register_buffer("reward_weights", torch.tensor(weights, dtype=torch.float32), persistent=False)
        if num_generations_eval < 1:
            raise ValueError(f"num_generations_eval must be >= 1, got {num_generations_eval}")
        self.num_generations_eval = num_generations_eval

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
        self.val_accuracy = GSM8KAccuracy(k=num_generations_eval)
        self.automatic_optimization = False
        self._bad_steps = 0

    # ----------------------------------------------------------------------------------------- models
    def configure_model(self) -> None:
        # Loading here rather than in __init__ lets the data module check its files before any weights
        # load, and lets sharding strategies wrap the model; the guard makes a second call a no-op.
        if self.policy is None:
            self.policy = load_model(self.policy_source, self.model_options)
            self._prepare_models()

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
        optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
        warmup = max(1, cfg.warmup_steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        return [optimizer], [scheduler]

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # The reference never changes: it is rebuilt from the policy's source, not stored a second time.
        state = checkpoint["state_dict"]
        for key in [k for k in state if k.startswith(REFERENCE_PREFIX)]:
            del state[key]

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if self.reference is not None:
            for key, value in self.reference.state_dict().items():
                checkpoint["state_dict"].setdefault(REFERENCE_PREFIX + key, value)

    # ----------------------------------------------------------------------------------------- rollout
    def encode_prompts(self, prompts: list) -> tuple[Tensor, Tensor]:
        """Apply the chat template to conversational prompts and tokenize, left-padded: `[N, P]` each."""
        tok = self.tokenizer
        conversational = isinstance(prompts[0], list)
        if conversational and not tok.chat_template:
            raise ValueError(
                "the tokenizer has no chat template but the prompts are chat messages: set "
                "`tokenizer.chat_template` (e.g. copy the instruct model's), or use plain-text prompts"
            )
        texts = [tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts] \
            if conversational else list(prompts)
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=not conversational)
        ids, mask = enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device)
        limit = self.grpo.max_prompt_length
        if limit is not None and ids.size(1) > limit:
            longest = int(mask.sum(1).max())
            if self.grpo.truncate_prompts == "error":
                raise ValueError(f"a prompt has {longest} tokens, over max_prompt_length={limit}")
            warnings.warn(f"prompt of {longest} tokens cut from the left to max_prompt_length={limit}", stacklevel=2)
            ids, mask = ids[:, -limit:], mask[:, -limit:]  # left padding: the last `limit` columns hold the ends
        return ids, mask

    def eos_token_ids(self) -> list[int]:
        ids = {self.tokenizer.eos_token_id}
        config_eos = self.policy.generation_config.eos_token_id
        ids.update(config_eos if isinstance(config_eos, list) else [config_eos])
        return sorted(i for i in ids if i is not None)

    def sample(self, prompts: list, num_generations: int, do_sample: bool = True) -> tuple[Rollout, list[str]]:
        """Generate `num_generations` completions per prompt and decode them."""
        cfg = self.grpo
        ids, mask = self.encode_prompts(prompts)
        rollout = generate_completions(
            self.policy,
            ids,
            mask,
            num_generations=num_generations,
            max_new_tokens=cfg.max_completion_length,
            eos_token_ids=self.eos_token_ids(),
            pad_token_id=self.tokenizer.pad_token_id,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            do_sample=do_sample,
        )
        completions = self.tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)
        return rollout, completions

    def logprobs(self, model: PreTrainedModel, rollout: Rollout, rows: slice, with_entropy: bool = False):
        return completion_logprobs(
            model,
            rollout.input_ids[rows],
            rollout.attention_mask[rows],
            rollout.completion_ids.size(1),
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
    def training_step(self, batch: dict[str, list], batch_idx: int) -> Tensor:
        cfg, G = self.grpo, self.grpo.num_generations
        start = time.perf_counter()
        rollout, completions = self.sample(batch["prompt"], G)
        generate_seconds = time.perf_counter() - start

        columns = {key: [v for v in values for _ in range(G)] for key, values in batch.items()}
        completion_ids = [ids[m.bool()].tolist() for ids, m in zip(rollout.completion_ids, rollout.completion_mask)]
        rewards_per_func = score_completions(
            self.reward_funcs, completions, completion_ids=completion_ids, **columns
        ).to(self.device)  # [B, F]
        rewards = (rewards_per_func.nan_to_num(0.0) * self.reward_weights).sum(dim=1)  # [B]
        advantages = group_advantages(rewards, G, cfg.scale_rewards, cfg.baseline, cfg.advantage_clip)  # [B]

        mask = rollout.completion_mask.float()  # [B, T]
        if cfg.mask_truncated_completions:
            mask = mask * (~rollout.truncated).float()[:, None]
        ref_logprobs = None
        if cfg.beta > 0:
            with self.reference_context():
                ref_logprobs = self._frozen_logprobs(rollout, self.reference or self.policy)  # [B, T]
        # With one pass per rollout the sampling policy is the current one: grpo_loss uses logprobs.detach().
        old_logprobs = self._frozen_logprobs(rollout, self.policy) if cfg.num_iterations > 1 else None

        # Normalise over the whole rollout on every rank, not per micro-batch; DDP then averages gradients
        # over ranks, hence the division by the world size.
        world = self.trainer.world_size
        total_tokens = self.trainer.strategy.reduce(mask.sum(), reduce_op="sum") / world
        total_sequences = torch.tensor(float(mask.size(0)), device=self.device)

        optimizer = self.optimizers()
        scheduler = self.lr_schedulers()
        for _ in range(cfg.num_iterations):
            stats, grad_norm = self._optimizer_step(
                optimizer, rollout, advantages, mask, old_logprobs, ref_logprobs, total_tokens, total_sequences
            )
            if grad_norm is not None:
                scheduler.step()
        step_seconds = time.perf_counter() - start
        self._log_step(rewards, rewards_per_func, rollout, mask, stats, grad_norm, generate_seconds, step_seconds)
        return stats["loss"]

    def _optimizer_step(self, optimizer, rollout, advantages, mask, old_logprobs, ref_logprobs, total_tokens,
                        total_sequences) -> tuple[dict[str, Tensor], Tensor | None]:
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
                beta=cfg.beta,
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
                sums[key] = sums.get(key, 0.0) + value * weight
        params = [p for p in self.policy.parameters() if p.requires_grad]
        max_norm = cfg.max_grad_norm if cfg.max_grad_norm is not None else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if not (torch.isfinite(sums["loss"]) and torch.isfinite(grad_norm)):
            optimizer.zero_grad()
            self._bad_steps += 1
            warnings.warn(f"step {self.global_step}: loss or gradient not finite, update skipped", stacklevel=2)
            if self._bad_steps >= cfg.max_bad_steps:
                raise FloatingPointError(
                    f"{self._bad_steps} consecutive steps with a non-finite loss or gradient (max_bad_steps="
                    f"{cfg.max_bad_steps}): lower the learning rate, or check the rewards and the model's dtype"
                )
            return sums, None
        self._bad_steps = 0
        optimizer.step()
        return sums, grad_norm

    def _log_step(self, rewards, rewards_per_func, rollout, mask, stats, grad_norm, generate_seconds, step_seconds):
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
    def validation_step(self, batch: dict[str, list], batch_idx: int) -> None:
        k = self.num_generations_eval
        rollout, completions = self.sample(batch["prompt"], k, do_sample=k > 1)
        self.val_accuracy.update(completions, batch["answer"])
        self.log("val/completion_length", rollout.completion_mask.sum(1).float().mean(),
                 batch_size=len(completions), sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        results = self.val_accuracy.compute()
        self.val_accuracy.reset()
        for key, value in results.items():
            self.log(f"val/{key}", value, prog_bar=key == "accuracy")
