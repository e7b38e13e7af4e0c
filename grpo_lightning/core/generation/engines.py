"""The rollout seam: prompt ids in, sampled completions and their log-probs out.

- `SamplingSettings` (`sampling.py`): what every sampled token obeys (length bounds, stop ids,
  temperature, top-p/k).
- `RolloutEngine`: how completions are generated from token ids (`EagerEngine`: Hugging Face `generate`
  with a dynamic KV cache). The trainer tells it when the weights change (`weights_changed`: an optimizer
  step, a checkpoint load); an engine that keeps its own inference copy of them (a static cache compiled
  for a GPU, vLLM's) takes the new ones once, before its next rollout (`refresh`), and frees what it holds
  in `close`. Every sampled rollout carries the log-prob of each drawn token under the distribution it
  was drawn from (`Rollout.sampler_logprobs`), and the engine reports its speed (`metrics`).

- `Backend`: an engine's entry in the registry (`backends.BACKENDS`): how it is built from an
  `EngineRequest` and its own options, what it refuses before any weights load (from a `PolicyOutline`),
  which models it cannot serve, what it holds in memory for a rollout (`EngineMemory`, for the pre-flight's
  estimate), and whether it needs full attention in every layer.

Text prompts reach an engine through `prompts.PromptSampler`; the training scorer is `scorer.LogProbScorer`.
No Lightning here: these take a `PreTrainedModel` (or a PEFT wrapper of one) and tensors.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor
from transformers import PretrainedConfig, PreTrainedModel

from grpo_lightning.core.generation.inference_copy import WeightSource
from grpo_lightning.core.generation.sampling import (
    COMPACT_ABOVE_ROWS,
    SamplingOptions,
    SamplingSettings,
    generate_completions,
    prefill_groups,
)
from grpo_lightning.core.types import Rollout


class RolloutEngine(Protocol):
    """Generates completion groups from left-padded prompt ids; the trainer tells it when weights change."""

    settings: SamplingSettings

    def generate(
        self,
        model: PreTrainedModel,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        *,
        num_generations: int,
        do_sample: bool = True,
        settings: SamplingSettings | None = None,
    ) -> Rollout:
        """`num_generations` completions for each prompt of `prompt_ids` `[N, P]` (left-padded): a `Rollout`
        of `N * num_generations` rows, prompt i's group in rows i*G .. i*G+G-1; greedy unless `do_sample`.
        `settings`: this call's, instead of the engine's (an evaluation's length or temperature)."""
        ...

    def weights_changed(self) -> None:
        """The policy's weights changed (an optimizer step, a checkpoint load): the next rollout samples the
        new ones. Cheap: an engine with a copy of its own takes them in `refresh`, once."""
        ...

    def refresh(self, model: PreTrainedModel, device: torch.device) -> None:
        """Make the next `generate` sample from `model`'s current weights, if it keeps a copy of its own (a
        collective under FSDP2: every rank calls it at the same point). `generate` calls it too."""
        ...

    def metrics(self) -> dict[str, float]:
        """The last call's `tokens_per_second` and `ms_per_decoding_step`, and what else the engine counts."""
        ...

    @property
    def reads_live_weights(self) -> bool:
        """Whether `generate` reads `model`'s own weights (the caller gathers sharded weights around it), or a
        copy of the engine's own, which `refresh` fills."""
        return True

    def close(self) -> None:
        """Free what the engine holds outside Python's reach (vLLM's engine); nothing by default."""


def rollout_speed(rollout: Rollout, decoding_steps: int, seconds: float) -> dict[str, float]:
    """Completion tokens per second of one `generate` call that ran `decoding_steps` steps (one per column)
    in `seconds`, and milliseconds per step. Reading the mask waits for the device."""
    tokens = int(rollout.completion_mask.sum())
    seconds = max(seconds, 1e-9)
    return {
        "tokens_per_second": tokens / seconds,
        "ms_per_decoding_step": 1000 * seconds / max(decoding_steps, 1),
    }


class EagerEngine(RolloutEngine):
    """`generate` with a dynamic KV cache on the live model: nothing to refresh when the weights change.

    Samples the raw policy (`sampling.generate_completions`) under the caller's autocast; with
    `settings.share_prompt` each distinct prompt is prefilled once and its cache repeated to the group
    (`sampling.prefill_groups`). `compact_above_rows`: a call of more rows than this stops decoding its
    finished rows once half have ended (`sampling.generate_completions`); None decodes every row until the
    longest ends.
    """

    def __init__(
        self, settings: SamplingSettings, compact_above_rows: int | None = COMPACT_ABOVE_ROWS
    ) -> None:
        self.settings = settings
        self.compact_above_rows = compact_above_rows
        self.last_speed: dict[str, float] = {}

    @torch.no_grad()
    def generate(self, model, prompt_ids, prompt_mask, *, num_generations, do_sample=True, settings=None):
        # The argument types are RolloutEngine.generate's.
        s = settings or self.settings
        start = time.perf_counter()
        prefill = prefill_groups(model, prompt_ids, prompt_mask, num_generations) if s.share_prompt else None
        rollout = generate_completions(
            model,
            prompt_ids,  # [N, P]
            prompt_mask,  # [N, P]
            s,
            num_generations=num_generations,
            do_sample=do_sample,
            prompt_cache=prefill,
            compact_above_rows=self.compact_above_rows,
        )
        self.last_speed = rollout_speed(rollout, rollout.completion_ids.size(1), time.perf_counter() - start)
        return rollout

    def weights_changed(self) -> None:
        """Nothing to do: `generate` reads the live weights."""

    def refresh(self, model: PreTrainedModel, device: torch.device) -> None:
        """Nothing to do: `generate` reads the live weights."""

    def metrics(self) -> dict[str, float]:
        return dict(self.last_speed)


# ------------------------------------------------------------------------------- an engine's registry entry


@dataclass(frozen=True)
class EngineRequest:
    """What building an engine takes, besides its own options.

    Args:
        sampling: the run's sampling options (lengths, for an engine that sizes its buffers by them).
        settings: what every sampled token obeys.
        policy: the policy, loaded (with LoRA, sharded).
        device: where its prompts go.
        precision: the trainer's precision flag (None without a trainer: the policy as it is).
        weights: the policy's full weights for an engine with a copy of its own (unit by unit under FSDP2).
        checked: what the engine's `Backend.check` found before the weights loaded; None where it did not run
            (the engine checks when it starts, if it checks anything).
    """

    sampling: SamplingOptions
    settings: SamplingSettings
    policy: PreTrainedModel
    device: torch.device
    precision: str | None
    weights: WeightSource
    checked: Any = None


@dataclass(frozen=True)
class PolicyOutline:
    """What an engine can check of the policy before any of its weights load: its config (read from the
    checkpoint's folder alone), the rank of the LoRA adapter it trains (None: no adapter), and the run's
    sampling options (its lengths)."""

    config: PretrainedConfig
    lora_rank: int | None
    sampling: SamplingOptions


@dataclass(frozen=True)
class EngineMemory:
    """What a rollout of `sequences` rows of `tokens` tokens costs an engine: its KV cache's shape, the copy
    of the weights it holds (None: it reads the policy's) and its KV pool when of a fixed size of its own
    (None: `sequences` x `tokens`)."""

    sequences: int
    tokens: int
    copy_bytes: int | None = None
    kv_pool_bytes: int | None = None


@dataclass(frozen=True)
class MemoryRequest:
    """The rollout the pre-flight estimates: `sequences` rows of `prompt_tokens` prompt and `new_tokens`
    completion tokens, the policy `sharded` (FSDP2), under Lightning's `precision`."""

    sequences: int
    prompt_tokens: int
    new_tokens: int
    sharded: bool
    precision: str


@dataclass(frozen=True)
class Backend:
    """One engine in the registry: `build` it from a request and its own options (the `EngineOptions` field
    of its name, None for an engine without one), why it cannot serve a model (`unsupported`: None when it
    can; the run then falls back to eager decoding with a warning), its `memory` for a rollout, whether it
    needs full attention in every layer (`model_abilities.not_full_attention`: without, eager decoding), why
    it cannot run here at all (`unavailable`: a missing package, in one line; None when it can), and what it
    refuses before any weights load (`check`, given the policy's outline and its own options: it raises in
    one line, and what it returns reaches `build` as `EngineRequest.checked`; None: nothing to check)."""

    build: Callable[[EngineRequest, Any], RolloutEngine]
    unsupported: Callable[[PreTrainedModel], str | None]
    memory: Callable[[RolloutEngine, PreTrainedModel, MemoryRequest], EngineMemory]
    needs_full_attention: bool = False
    unavailable: Callable[[], str | None] = lambda: None
    check: Callable[[PolicyOutline, Any], Any] | None = None


def _eager_memory(engine: RolloutEngine, policy: PreTrainedModel, rollout: MemoryRequest) -> EngineMemory:
    return EngineMemory(rollout.sequences, rollout.prompt_tokens + rollout.new_tokens)


EAGER_BACKEND = Backend(
    build=lambda request, options: EagerEngine(request.settings),
    unsupported=lambda model: None,
    memory=_eager_memory,
)
