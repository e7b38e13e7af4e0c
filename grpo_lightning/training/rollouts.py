"""The policy's rollouts for `GRPOModule`: its prompts encoded, completions sampled by the rollout engine of
`grpo.generation_backend`, and per-token log-probs scored, with the decisions made once (whether groups
share their prompt pass, which engine) and the engine told when the weights change (it refreshes an
inference copy once, before the next rollout).

No Lightning here: the module passes its policy (which LoRA or loading may replace), device and precision.
"""

from __future__ import annotations

import warnings
from contextlib import nullcontext

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.generation.engines import (
    EagerEngine,
    LogProbScorer,
    PromptEncoder,
    PromptSampler,
    RolloutEngine,
    SamplingSettings,
)
from grpo_lightning.core.generation.sampling import stop_token_ids
from grpo_lightning.core.generation.shared_prompt import sharing_unsupported
from grpo_lightning.core.generation.static_engine import StaticEngine, copy_precision, resolve_backend
from grpo_lightning.core.types import Rollout
from grpo_lightning.io.distributed import full_weights_by_unit, gathered_for_generation


class PolicyRollouts:
    """Sampling and log-prob scoring of one policy under `cfg`.

    Args:
        cfg: the algorithm's options (lengths, sampling, `share_prompt`, `generation_backend`).
        tokenizer: the policy's tokenizer, prepared (`io.models.prepare_tokenizer`).
    """

    def __init__(self, cfg: GRPOConfig, tokenizer: PreTrainedTokenizerBase) -> None:
        self.cfg, self.tokenizer = cfg, tokenizer
        self.share_prompt: bool | None = None  # grpo.share_prompt where the policy supports it, decided once
        self.engine: RolloutEngine | None = None  # built on first use, once the policy is loaded
        self.engine_precision: str | None = None  # the trainer's precision the engine was built for

    def shares_prompt(self, policy: PreTrainedModel) -> bool:
        """Whether each group's prompt is encoded once (`grpo.share_prompt`, if the policy can)."""
        if self.share_prompt is None:
            reason = sharing_unsupported(policy) if self.cfg.share_prompt else None
            if reason is not None:
                warnings.warn(f"grpo.share_prompt: {reason}; every prompt is encoded G times", stacklevel=3)
            self.share_prompt = self.cfg.share_prompt and reason is None
        return self.share_prompt

    def build_engine(
        self, policy: PreTrainedModel, device: torch.device, precision: str | None
    ) -> RolloutEngine:
        """The engine that generates the rollouts (`grpo.generation_backend`); `precision` is the trainer's,
        None without one."""
        cfg = self.cfg
        settings = SamplingSettings(
            max_new_tokens=cfg.max_completion_length,
            min_new_tokens=cfg.min_completion_length,
            eos_token_ids=tuple(stop_token_ids(policy, self.tokenizer)),
            pad_token_id=self.tokenizer.pad_token_id,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            share_prompt=self.shares_prompt(policy),
        )
        if resolve_backend(cfg.generation_backend, policy, device) == "eager":
            return EagerEngine(settings)
        return StaticEngine(
            settings,
            precision=copy_precision(precision),  # the copy computes as the scorer does
            compile=device.type == "cuda",
            max_prompt_tokens=cfg.max_prompt_length,
            weights=full_weights_by_unit,  # sharded: one unit gathered at a time
        )

    @property
    def prompt_encoder(self) -> PromptEncoder:
        return PromptEncoder(self.tokenizer, self.cfg.max_prompt_length, self.cfg.truncate_prompts)

    def scorer(self, policy: PreTrainedModel) -> LogProbScorer:
        """The per-token log-probs of rollouts, for the reference, old-policy and policy passes."""
        cfg = self.cfg
        return LogProbScorer(
            cfg.num_generations, cfg.temperature, self.shares_prompt(policy), cfg.entropy_coef != 0
        )

    def sample(
        self,
        engine: RolloutEngine,
        policy: PreTrainedModel,
        prompts: list,
        num_generations: int,
        do_sample: bool,
        device: torch.device,
    ) -> tuple[Rollout, list[str]]:
        """`num_generations` completions per prompt by `engine`, decoded. Sharded, an engine with a copy of
        its own refreshes it one unit at a time, and one on the live weights gets them gathered once for
        the call, so that `generate` needs no collective (ranks may stop at different lengths)."""
        engine.refresh(policy, device)  # a collective under FSDP2, where the copy is stale
        sampler = PromptSampler(self.prompt_encoder, engine)
        with gathered_for_generation(policy) if engine.reads_live_weights else nullcontext():
            return sampler.sample(policy, prompts, num_generations, do_sample=do_sample, device=device)

    def weights_changed(self) -> None:
        """After an optimizer step or a checkpoint load: the engine, if built, takes the new weights before
        its next rollout (and only then: several optimizer steps per rollout refresh it once)."""
        if self.engine is not None:
            self.engine.weights_changed()

    def engine_metrics(self) -> dict[str, float]:
        """The engine's `rollout/...` metrics: its last call's speed, and for the static engine what
        compiling did (`compile_watch.FastPathReport`) and how often the copy was refreshed."""
        return {} if self.engine is None else {f"rollout/{k}": v for k, v in self.engine.metrics().items()}
