"""The policy's rollouts for `GRPOModule`: its prompts encoded, completions sampled by the rollout engine of
`grpo.engine.backend`, per-token log-probs scored, with the decisions made once (whether groups share
their prompt pass, whether the passes pack their rows, which engine, whether the weights are sharded) and
the engine told when the weights change (it refreshes an inference copy once, before the next rollout).
`module.rollouts.sample(prompts, G)` samples as a training step does.

No Lightning here: the module hands over its policy once it is loaded, and the device and precision of the
trainer it runs under (`place`).
"""

from __future__ import annotations

import copy
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from functools import partial

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.generation.backends import BACKENDS, build_engine, check_engine, requested_backend
from grpo_lightning.core.generation.engines import EngineRequest, PolicyOutline, RolloutEngine
from grpo_lightning.core.generation.model_abilities import not_full_attention
from grpo_lightning.core.generation.packing import PackedLogProbScorer, packing_unsupported
from grpo_lightning.core.generation.prompts import PromptEncoder, PromptSampler, warn_if_unteachable
from grpo_lightning.core.generation.sampling import stop_token_ids
from grpo_lightning.core.generation.scorer import LogProbScorer
from grpo_lightning.core.generation.shared_prompt import sharing_unsupported
from grpo_lightning.core.generation.vllm_server import PendingRollout, PinnedServerEngine
from grpo_lightning.core.ranks import failures_agreed
from grpo_lightning.core.stop_requests import reopen
from grpo_lightning.core.tools.calls import ROLLOUT_THREAD
from grpo_lightning.core.types import Rollout
from grpo_lightning.io.distributed import (
    call_in_root_forward,
    full_weights_by_unit,
    gathered_for_generation,
    is_sharded,
)
from grpo_lightning.training.tool_rollouts import SampledTurns, ToolSampling


class SubmittedBatch:
    """A batch in flight on the server engine: its requests (`vllm_server.PendingRollout`), or the one job
    of its multi-turn rollout, finished by `finish` once in; when the last of them arrived, for the share of
    sampling time the trainer did not wait for."""

    def __init__(
        self,
        futures: list[Future],
        start: float,
        finish: Callable[[], tuple[Rollout, list[str], SampledTurns | None]],
        rollouts: PolicyRollouts,
    ) -> None:
        self.futures, self.start, self.finish, self.rollouts = futures, start, finish, rollouts
        self.finished = start
        for future in futures:
            future.add_done_callback(self._arrived)

    def _arrived(self, future: Future) -> None:
        self.finished = max(self.finished, time.perf_counter())

    def wait(self) -> None:
        """Until every request is in (a push must not land in the middle of a batch)."""
        futures.wait(self.futures)

    def result(self) -> tuple[Rollout, list[str], SampledTurns | None]:
        """The rollout, its decoded completions and a multi-turn rollout's turns, once every request is in;
        a request that failed on any rank ends every rank here (`core.ranks.failures_agreed`)."""
        with failures_agreed(self.rollouts.prompt_device):
            sampled = self.finish()
        if sampled[2] is not None:
            self.rollouts.tool_metrics = sampled[2].metrics
        return sampled

    @property
    def sampled_seconds(self) -> float:
        """From submission to the last request's answer."""
        return self.finished - self.start


class PinnedRollouts:
    """What a multi-turn rollout sampled ahead reads of the policy's rollouts (`ToolSampling.sample`), on the
    rollout thread: the server engine pinned to the weights pushed when its batch was submitted
    (`vllm_server.PinnedServerEngine`), and a tokenizer of its own, whose chat template the rollout swaps in
    and out (`tools.turns.rendering_with`) while the trainer's thread encodes with the trainer's."""

    def __init__(
        self, rollouts: PolicyRollouts, engine: PinnedServerEngine, tokenizer: PreTrainedTokenizerBase
    ) -> None:
        self.cfg, self.policy, self.tokenizer = rollouts.cfg, rollouts.policy, tokenizer
        self.device = rollouts.prompt_device
        self.encoder = replace(rollouts.encoder, tokenizer=tokenizer)
        self.engine = engine

    @contextmanager
    def ready_engine(self) -> Iterator[tuple[PinnedServerEngine, torch.device]]:
        yield self.engine, self.device


class PolicyRollouts:
    """Sampling and log-prob scoring of one policy under `cfg`.

    Args:
        cfg: the algorithm's options (lengths, sampling, `share_prompt`, `generation_backend`).
        tokenizer: the policy's tokenizer, prepared (`io.models.prepare_tokenizer`).
    """

    def __init__(self, cfg: GRPOConfig, tokenizer: PreTrainedTokenizerBase) -> None:
        self.cfg, self.tokenizer = cfg, tokenizer
        self.policy: PreTrainedModel | None = None  # the module's, once loaded (with LoRA, sharded)
        self.device: torch.device | None = None  # where prompts go; None: where the policy's weights are
        self.precision: str | None = None  # the trainer's precision flag; None without a trainer
        self.engine: RolloutEngine | None = None  # built on first use, again when the precision changes
        self.engine_precision: str | None = None  # the precision the engine was built for
        self.backend: str | None = None  # the engine's name in `core.generation.backends.BACKENDS`
        self.engine_checked: object | None = None  # what the engine's checks before the weights found
        self._share_prompt: bool | None = (
            None  # grpo.scoring.share_prompt where the policy supports it, decided once
        )
        self._packs: bool | None = None  # grpo.scoring.packed_sequences where the policy can, decided once
        self._full_attention: bool | None = None  # whether the policy attends to every token, decided once
        self._gathered = nullcontext  # with the engine: `gathered_for_generation` for a sharded policy
        self.multi_turn: ToolSampling | None = None  # tools, environments or a rollout function: the module's
        self.tool_metrics: dict[str, float] = {}  # the last multi-turn rollout's `tools/...`
        self._rollout_thread: ThreadPoolExecutor | None = None  # multi-turn rollouts sampled ahead
        self._thread_tokenizer: PreTrainedTokenizerBase | None = None  # that thread's tokenizer

    def check_engine(self, outline: PolicyOutline, device: torch.device) -> None:
        """The engine's checks before any weights load (`backends.check_engine`: the server engine's
        servers refused in one line where they cannot serve the policy), what they found kept for its
        build."""
        self.engine_checked = check_engine(self.cfg.engine, outline, device)

    def place(self, device: torch.device, precision: str | None) -> None:
        """Where the trainer runs the policy: prompts go to `device`; the engine follows `precision`."""
        self.device, self.precision = device, precision

    @property
    def full_attention(self) -> bool:
        """Whether every layer of the policy attends to every earlier token
        (`model_abilities.not_full_attention`), decided once. Where not, the shared prompt, packed passes and
        the static engine are off, and one warning names those the options asked for."""
        if self._full_attention is None:
            reason = not_full_attention(self.policy.config)
            self._full_attention = reason is None
            turned_off = self._needing_full_attention() if reason is not None else {}
            if turned_off:
                options, consequences = ", ".join(turned_off), "; ".join(turned_off.values())
                warnings.warn(f"{options}: {reason}; {consequences}", stacklevel=4)
        return self._full_attention

    def _needing_full_attention(self) -> dict[str, str]:
        """The options asked for that need full attention, and what happens without each."""
        cfg = self.cfg
        device = self.device or next(self.policy.parameters()).device
        asked = {
            "grpo.scoring.share_prompt": (cfg.scoring.share_prompt, "every prompt is encoded G times"),
            "grpo.scoring.packed_sequences": (cfg.scoring.packed_sequences, "the passes run padded rows"),
            f"grpo.engine.backend={cfg.engine.backend!r}": (
                BACKENDS[requested_backend(cfg.engine.backend, device)].needs_full_attention,
                "rollouts use eager decoding",
            ),
        }
        return {option: without for option, (on, without) in asked.items() if on}

    @property
    def shares_prompt(self) -> bool:
        """Whether each group's prompt is encoded once (`grpo.scoring.share_prompt`, if the policy can)."""
        if self._share_prompt is None:
            wanted = self.cfg.scoring.share_prompt and self.full_attention
            reason = sharing_unsupported(self.policy) if wanted else None
            if reason is not None:
                warnings.warn(
                    f"grpo.scoring.share_prompt: {reason}; every prompt is encoded G times", stacklevel=3
                )
            self._share_prompt = wanted and reason is None
        return self._share_prompt

    @property
    def packs_sequences(self) -> bool:
        """Whether the log-prob passes pack their rows (`grpo.scoring.packed_sequences`, if the policy
        can)."""
        if self._packs is None:
            wanted = self.cfg.scoring.packed_sequences and self.full_attention
            reason = packing_unsupported(self.policy) if wanted else None
            if reason is not None:
                warnings.warn(
                    f"grpo.scoring.packed_sequences: {reason}; the passes run padded rows", stacklevel=3
                )
            self._packs = wanted and reason is None
        return self._packs

    @property
    def encoder(self) -> PromptEncoder:
        sampling = self.cfg.sampling
        return PromptEncoder(
            self.tokenizer,
            sampling.max_prompt_length,
            sampling.truncate_prompts,
            self.cfg.prompts,
        )

    @property
    def scorer(self) -> LogProbScorer:
        """The per-token log-probs of rollouts, for the reference, old-policy and policy passes: on packed
        rows where the policy can (`packing.PackedLogProbScorer`), inside the root's FSDP hooks if sharded."""
        cfg = self.cfg
        in_root_forward = call_in_root_forward if is_sharded(self.policy) else None
        scorer = PackedLogProbScorer if self.packs_sequences else LogProbScorer
        return scorer(
            cfg.sampling.num_generations,
            cfg.sampling.temperature,
            self.shares_prompt,
            cfg.loss.entropy_coef != 0,
            in_root_forward,
        )

    def build_engine(self) -> RolloutEngine:
        """The engine that generates the rollouts (`grpo.engine.backend`), in the trainer's precision."""
        cfg, policy = self.cfg, self.policy
        device = self.prompt_device
        eos, pad = stop_token_ids(policy, self.tokenizer), self.tokenizer.pad_token_id
        settings = cfg.sampling.settings(eos, pad, self.shares_prompt)
        self.engine_precision = self.precision
        # Sharded: full weights once around `generate` for an engine that reads the live weights, so that no
        # collective runs per token; one unit at a time for an engine with a copy of its own.
        self._gathered = gathered_for_generation if is_sharded(policy) else nullcontext
        requested = cfg.engine.backend
        if not self.full_attention and BACKENDS[requested_backend(requested, device)].needs_full_attention:
            requested = "eager"  # said once, by `full_attention`
        request = EngineRequest(
            cfg.sampling, settings, policy, device, self.precision, full_weights_by_unit, self.engine_checked
        )
        self.backend, engine = build_engine(request, cfg.engine, requested)
        return engine

    def current_engine(self) -> RolloutEngine:
        """The engine, built on first use and again for a trainer whose precision is not the one it was built
        for: a module that sampled before `fit` must not keep a float32 inference copy under `bf16-mixed`."""
        if self.engine is None or self.engine_precision != self.precision:
            if self.engine is not None:
                self.engine.close()
            self.engine = self.build_engine()
        return self.engine

    def sample(
        self, prompts: list, num_generations: int, do_sample: bool = True
    ) -> tuple[Rollout, list[str]]:
        """`num_generations` completions per prompt (greedy unless `do_sample`) by the `current_engine`,
        decoded. Sharded, an engine with a copy of its own refreshes it one unit at a time, and one on the
        live weights gets them gathered once for the call, so that `generate` needs no collective (ranks may
        stop at different lengths)."""
        with self.ready_engine() as (engine, device):
            sampler = PromptSampler(self.encoder, engine)
            return sampler.sample(self.policy, prompts, num_generations, do_sample=do_sample, device=device)

    @property
    def prompt_device(self) -> torch.device:
        """Where the prompts go: the trainer's device, else where the policy's weights are."""
        return self.device or next(self.policy.parameters()).device

    @contextmanager
    def ready_engine(self) -> Iterator[tuple[RolloutEngine, torch.device]]:
        """The `current_engine`, refreshed, and the device of the prompts, for one rollout: under FSDP2 its
        copy refreshed one unit at a time, or the live weights gathered around the rollout. Every rank runs
        each rollout at the same point: one that fails on a rank (a vLLM server that stops answering) ends
        every rank when it ends (`core.ranks.failures_agreed`), none left waiting in a collective."""
        device = self.prompt_device
        with failures_agreed(device):
            engine = self.current_engine()
            engine.refresh(self.policy, device)  # a collective under FSDP2, where the copy is stale
            with self._gathered(self.policy) if engine.reads_live_weights else nullcontext():
                # The refresh's and the gathers' collectives are done: up to the block's end (where the
                # ranks meet in `failures_agreed`), the rollout is each rank's own, a stop leaves it at once.
                reopen()
                yield engine, device

    def sample_batch(
        self, batch: dict[str, list], num_generations: int, do_sample: bool = True
    ) -> tuple[Rollout, list[str], SampledTurns | None]:
        """`sample` of `batch`'s prompts, or with tools, environments or a rollout function, their multi-turn
        rollout (`multi_turn`) and what its reward functions read beyond the completions (the group source,
        `core.group_source`, hands it to them)."""
        if self.multi_turn is None:
            return (*self.sample(batch["prompt"], num_generations, do_sample), None)
        rollout, completions, turns = self.multi_turn.sample(self, batch, num_generations, do_sample)
        self.tool_metrics = turns.metrics
        return rollout, completions, turns

    def submit_batch(self, batch: dict[str, list], num_generations: int) -> SubmittedBatch:
        """`batch`'s prompts sent to the server engine under the weights as they are now (pushed first if
        they changed), returning at once: the asynchronous group source samples ahead with it
        (`core.async_group_source`). A multi-turn rollout runs whole on the rollout thread, every turn on
        the engine pinned to those weights, the next push waiting for its end (`PinnedRollouts`); a
        `rollout_func` was refused when the module was built (`ToolSampling`)."""
        with self.ready_engine() as (engine, device):  # the weights pushed here, if they changed
            if self.multi_turn is None:
                ids, mask = self.encoder.encode(batch["prompt"], device)  # [N, P] each
                pending = engine.submit(self.policy, ids, mask, num_generations=num_generations)
                finish = partial(self._decoded, pending)
                return SubmittedBatch(pending.futures, pending.start, finish, self)
            start = time.perf_counter()
            pinned = PinnedRollouts(self, PinnedServerEngine(engine), self._rollout_tokenizer())
            if self._rollout_thread is None:
                self._rollout_thread = ThreadPoolExecutor(1, thread_name_prefix=ROLLOUT_THREAD)
            job = self._rollout_thread.submit(self.multi_turn.sample, pinned, batch, num_generations)
            engine.hold([job])
            return SubmittedBatch([job], start, job.result, self)

    def _decoded(self, pending: PendingRollout) -> tuple[Rollout, list[str], None]:
        """A single-turn batch's rollout and its decoded completions, once its requests are in."""
        rollout = pending.result()
        return rollout, self.encoder.decode(rollout), None

    def _rollout_tokenizer(self) -> PreTrainedTokenizerBase:
        """The rollout thread's copy of the tokenizer, made once (one batch rolls out at a time there)."""
        if self._thread_tokenizer is None:
            self._thread_tokenizer = copy.deepcopy(self.tokenizer)
        return self._thread_tokenizer

    @staticmethod
    def weights_loaded(module: object, incompatible_keys: object) -> None:
        """A `load_state_dict` post-hook of the module that holds the rollouts (Lightning restoring, or a
        user): the next rollout samples the loaded weights."""
        module.rollouts.weights_changed()

    def weights_changed(self) -> None:
        """After an optimizer step or a checkpoint load: the engine, if built, takes the new weights before
        its next rollout (and only then: several optimizer steps per rollout refresh it once)."""
        if self.engine is not None:
            self.engine.weights_changed()

    def close(self) -> None:
        """Free what the engine holds (vLLM's engine); the next rollout builds another."""
        if self._rollout_thread is not None:
            self._rollout_thread.shutdown(wait=True, cancel_futures=True)
            self._rollout_thread = None
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def engine_metrics(self) -> dict[str, float]:
        """The engine's `rollout/...` metrics: its last call's speed, and for the static engine what
        compiling did (`compile_watch.FastPathReport`) and how often the copy was refreshed; a multi-turn
        rollout's `tools/call_frequency` and `tools/failure_frequency`."""
        engine = {} if self.engine is None else {f"rollout/{k}": v for k, v in self.engine.metrics().items()}
        return {**engine, **self.tool_metrics}

    def check(self, rollout: Rollout, completions: list[str]) -> None:
        """Warn when a training step's rollout cannot teach anything (`prompts.warn_if_unteachable`)."""
        warn_if_unteachable(
            rollout,
            completions,
            stop_token_ids(self.policy, self.tokenizer),
            self.cfg.sampling.max_completion_length,
            tokenizer_size=len(self.tokenizer),
            vocab_size=self.policy.config.vocab_size,
        )
