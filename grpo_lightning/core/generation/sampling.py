"""Batched generation of completion groups from Hugging Face causal LMs, and what every sampled token obeys.

No Lightning here: these functions take a `PreTrainedModel` (or a PEFT wrapper of one) and tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Annotated, Literal

import torch
from torch import Tensor
from transformers import (
    Cache,
    CompileConfig,
    DynamicCache,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    MinPLogitsWarper,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    StoppingCriteria,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from grpo_lightning.core.generation.logprobs import position_ids
from grpo_lightning.core.generation.model_abilities import cache_argument, not_full_attention
from grpo_lightning.core.options import (
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Range,
    TRLValues,
    check_fields,
    option_error,
)
from grpo_lightning.core.stop_requests import StopCheck
from grpo_lightning.core.types import Rollout


@dataclass(frozen=True, kw_only=True)
class SamplingSettings:
    """What every sampled completion obeys, one object from the options to the draw:
    `SamplingOptions.settings` builds the training rollouts', `generate_completions` and
    `sampling_processors` apply them."""

    max_new_tokens: int  # completion budget, `GRPOConfig.max_completion_length`
    min_new_tokens: int = 0  # EOS suppressed until this many new tokens
    eos_token_ids: tuple[int, ...]  # any of them ends a completion (`stop_token_ids`)
    pad_token_id: int  # fills the completions after their end
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off
    share_prompt: bool = False  # one prefill per prompt, its KV cache repeated to the group's rows

    def vllm_knobs(self) -> dict[str, float | int]:
        """The knobs that shape the sampled distribution, under vLLM's names (its `SamplingParams` and its
        server's `/v1/completions` take the same)."""
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
        }

    def for_evaluation(self, max_new_tokens: int, temperature: float = 1.0) -> SamplingSettings:
        """Settings built from scratch for an evaluation: the raw policy at `temperature` (greedy decoding
        ignores it) up to `max_new_tokens`. Only what belongs to the model and the engine carries over (the
        stop and pad ids, the shared prefill); no training knob does, whatever knobs these settings gain."""
        return SamplingSettings(
            max_new_tokens=max_new_tokens,
            eos_token_ids=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            temperature=temperature,
            share_prompt=self.share_prompt,
        )


@dataclass(frozen=True)
class SamplingOptions:
    """How the training rollouts are drawn: the group, the lengths, temperature, top-p, top-k, min-p and the
    repetition penalty (`GRPOConfig.sampling`). Every engine draws each token as vLLM does: the repetition
    penalty on the logits, then the temperature, min-p, top-k, top-p; its log-prob under that distribution
    is the sampler's (`Rollout.sampler_logprobs`, vLLM's processed log-probs), while the loss scores the
    policy at `temperature` alone, as TRL's: where the other knobs change the distribution, the gap shows in
    `rollout/logp_gap_*` and `sampler_correction` can weigh it."""

    num_generations: Annotated[int, Range(">= 2", why="advantages compare a group")] = 8
    """Completions sampled per prompt, the group size G (DeepSeekMath, arXiv:2402.03300, sec. 4.1.2). Must be
    >= 2: advantages are relative to the group.
    """
    max_completion_length: PositiveInt = 256
    """New tokens per completion."""
    min_completion_length: NonNegativeInt = 0
    """EOS is suppressed until this many new tokens (`generate`'s `min_new_tokens`); equal to
    `max_completion_length` it fixes the length, as benchmarks need. Above 0 the first tokens are drawn
    without EOS while the loss scores them under the raw policy, so the importance ratio there is
    off-policy by the EOS probability: keep 0 for training runs.
    """
    max_prompt_length: PositiveInt | None = None
    """Prompt tokens kept; longer prompts are cut as `truncate_prompts` says. Default None: every prompt
    whole, as TRL 1.x (which has no prompt cut; TRL up to 0.27: 512, cut from the left).
    """
    truncate_prompts: Literal["left", "error"] = "left"
    """What to do with a prompt over `max_prompt_length`: "left" (cut its start, with a warning) or "error".
    A chat prompt that opens with a system turn, or that shows tools, is never cut: it is refused naming
    its length (a left cut would drop the instructions or the tools' descriptions first).
    """
    temperature: PositiveFloat = 1.0
    """Sampling temperature, > 0. The same temperature scales the logits of the log-probs, as the sampler saw
    them.
    """
    top_p: Annotated[float, Range("> 0, <= 1")] = 1.0
    """Nucleus sampling: draw from the most likely tokens whose probabilities sum to top_p, in (0, 1]; 1.0
    disables it.
    """
    top_k: Annotated[int, Range(">= 0", why="0 disables it"), TRLValues((None, 0), (-1, 0))] = 0
    """Draw from the k most likely tokens only; 0 disables it."""
    min_p: Annotated[float, Range(">= 0, <= 1", why="0 disables it"), TRLValues((None, 0.0))] = 0.0
    """Min-p sampling (Nguyen et al., arXiv:2407.01082): draw only from the tokens whose probability (after
    the temperature) is at least `min_p` times the most likely token's, in [0, 1]; 0 disables it. TRL's
    default None is 0 here.
    """
    repetition_penalty: Annotated[float, Range("> 0")] = 1.0
    """CTRL's repetition penalty (Keskar et al., arXiv:1909.05858), as vLLM applies it: the logit of every
    token already in the prompt or the completion is divided by it where positive and multiplied by it
    where negative, before the temperature; above 1 repeats are less likely, below 1 more; 1.0 disables
    it.
    """

    def __post_init__(self) -> None:
        check_fields(self)
        if self.min_completion_length > self.max_completion_length:
            raise option_error(
                self, "min_completion_length", self.min_completion_length, "must be <= max_completion_length"
            )

    def settings(
        self, eos_token_ids: Sequence[int], pad_token_id: int, share_prompt: bool
    ) -> SamplingSettings:
        """The settings of the training rollouts: their lengths and every knob of the draw."""
        return SamplingSettings(
            max_new_tokens=self.max_completion_length,
            min_new_tokens=self.min_completion_length,
            eos_token_ids=tuple(eos_token_ids),
            pad_token_id=pad_token_id,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            share_prompt=share_prompt,
        )


def completion_mask_from_ids(completion_ids: Tensor, eos_token_ids: list[int]) -> tuple[Tensor, Tensor]:
    """Mask of the tokens up to and including each row's first EOS, and which rows never emitted one."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos_token_ids, device=completion_ids.device))  # [B, T]
    has_eos = is_eos.any(dim=1)  # [B]
    first_eos = torch.where(has_eos, is_eos.int().argmax(dim=1), completion_ids.size(1))  # [B]
    positions = torch.arange(completion_ids.size(1), device=completion_ids.device)  # [T]
    mask = (positions[None, :] <= first_eos[:, None]).long()  # [B, T]
    return mask, ~has_eos


class InverseCDFSampler(LogitsProcessor):
    """Draws the next token from softmax(scores) by inverse-CDF sampling and returns scores that are 0 at the
    draw and -inf elsewhere, so that `generate`'s greedy argmax emits exactly that draw.

    The same distribution as `torch.multinomial`, but one uniform number per row and a cumulative sum: on CPU
    `multinomial` over a 150k vocabulary costs several times the LM head of a small model at every step.
    Put it last, after the repetition penalty and the temperature / min-p / top-k / top-p warpers (and
    `generate`'s own `min_new_tokens` processor, which runs first), which it then samples through.
    `drawn_logprobs`: where each step's `[B]` log-probs of the drawn tokens under that distribution are
    appended (the sampler's side of the sampler/scorer gap, `Rollout.sampler_logprobs`).
    """

    def __init__(self, drawn_logprobs: list[Tensor] | None = None) -> None:
        self.drawn_logprobs = drawn_logprobs

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        probs = torch.softmax(scores.float(), dim=-1)  # [B, V]
        cdf = probs.double().cumsum(dim=-1)  # [B, V] float64: tokens of probability ~1e-8 keep their share
        u = torch.rand(cdf.size(0), 1, dtype=cdf.dtype, device=cdf.device) * cdf[:, -1:]  # [B, 1], [0, total)
        # right=True returns the first index whose cdf exceeds u, never a zero-probability token.
        tokens = torch.searchsorted(cdf, u, right=True).clamp_(max=scores.size(-1) - 1)  # [B, 1]
        if self.drawn_logprobs is not None:  # the draw's log-prob under the distribution it came from
            log_z = scores.float().logsumexp(dim=-1, keepdim=True)  # [B, 1]
            self.drawn_logprobs.append((scores.gather(-1, tokens).float() - log_z).squeeze(-1))  # [B]
        return torch.full_like(scores, -math.inf).scatter_(-1, tokens, 0.0)


class RepetitionPenalty(LogitsProcessor):
    """CTRL's repetition penalty as vLLM applies it: the logit of every token present in the prompt or the
    completion so far is divided by `penalty` where positive, multiplied by it elsewhere. The prompts'
    padding (`prompt_mask` `[b, L]` 0, over the first L columns of the ids) is no token of theirs:
    transformers' `RepetitionPenaltyLogitsProcessor` would penalise the pad id of every left-padded row."""

    def __init__(self, penalty: float, prompt_mask: Tensor) -> None:
        self.penalty = penalty
        self.prompt_mask = prompt_mask  # [b, L]

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        counted = torch.ones_like(input_ids, dtype=scores.dtype)  # [b, L + t]
        counted[:, : self.prompt_mask.size(1)] = self.prompt_mask.to(scores.dtype)
        present = torch.zeros_like(scores).scatter_add_(-1, input_ids, counted) > 0  # [b, V]
        penalised = torch.where(scores > 0, scores / self.penalty, scores * self.penalty)  # [b, V]
        return torch.where(present, penalised, scores)


def sampling_processors(
    settings: SamplingSettings, prompt_mask: Tensor, drawn_logprobs: list[Tensor] | None = None
) -> LogitsProcessorList:
    """The processors of `settings` that change anything, in vLLM's order (the repetition penalty over the
    tokens of the prompts, unpadded by `prompt_mask` `[b, L]`, and of the completions; the temperature,
    min-p, top-k, top-p), followed by `InverseCDFSampler` (which appends the drawn tokens' log-probs to
    `drawn_logprobs`, if given)."""
    processors = LogitsProcessorList()
    if settings.repetition_penalty != 1.0:
        processors.append(RepetitionPenalty(settings.repetition_penalty, prompt_mask))
    if settings.temperature != 1.0:
        processors.append(TemperatureLogitsWarper(settings.temperature))
    if settings.min_p > 0:
        processors.append(MinPLogitsWarper(settings.min_p))
    if settings.top_k > 0:
        processors.append(TopKLogitsWarper(settings.top_k))
    if settings.top_p < 1.0:
        processors.append(TopPLogitsWarper(settings.top_p))
    processors.append(InverseCDFSampler(drawn_logprobs))
    return processors


@contextmanager
def raw_policy_generation(
    model: PreTrainedModel, eos_token_ids: list[int], pad_token_id: int
) -> Iterator[None]:
    """Inside, `generate` sees a generation config that holds only the EOS and pad ids.

    `generate` fills every option that the passed `GenerationConfig` leaves at None from the checkpoint's
    `model.generation_config`: Qwen2.5-Instruct's `repetition_penalty` 1.1, any `suppress_tokens`,
    `bad_words_ids`, `no_repeat_ngram_size`, `min_length`... would then shape what is sampled, while
    `completion_logprobs` scores the raw policy: off-policy data under an importance ratio of 1.
    """
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT: the HF model
    saved = inner.generation_config
    inner.generation_config = GenerationConfig(eos_token_id=eos_token_ids, pad_token_id=pad_token_id)
    try:
        yield
    finally:
        inner.generation_config = saved


def stop_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The tokenizer's EOS plus every EOS of the model's generation config (chat models often have two)."""
    ids = {tokenizer.eos_token_id}
    config_eos = model.generation_config.eos_token_id
    ids.update(config_eos if isinstance(config_eos, list) else [config_eos])
    return sorted(i for i in ids if i is not None)


COMPACT_ABOVE_ROWS = 8
"""`generate_completions` drops the finished rows of a batch of more rows than this. On CPU a decoding step of
SmolLM2-135M costs about the same for 2 to 8 rows and 40% more for 16 (BENCHMARKS.md, "Decoding"): below 8
rows, dropping rows would save nothing that pays for restarting `generate`."""

COMPACT_LIVE_SHARE = 0.5
"""... and does so once at most this share of the batch is live (`RowsEnded`): each restart costs less than
one decoding step, and halving the batch saves a good part of every later step."""

CacheRowSelect = Callable[[Cache, Tensor], Cache]  # (cache, rows to keep [b']) -> a cache of those rows


def select_cache_rows(cache: Cache, rows: Tensor) -> Cache:
    """`cache` with only its batch rows `rows` `[b']`, in that order (a dynamic cache, selected in place)."""
    cache.batch_select_indices(rows)
    return cache


class RowsEnded(StoppingCriteria):
    """Ends a `generate` call of `rows` rows once at most `max_live` of them are still live (no end token
    yet), so that `generate_completions` goes on with the live rows only. Its decision stays on the device:
    no host sync."""

    def __init__(self, eos_token_ids: Tensor, max_live: int) -> None:
        self.eos_token_ids = eos_token_ids  # [E]
        self.max_live = max_live
        self.ended: Tensor | None = None  # [b] rows that emitted an end token in this call

    def __call__(self, input_ids: Tensor, scores: Tensor | None, **kwargs) -> Tensor:
        ended = torch.isin(input_ids[:, -1], self.eos_token_ids)  # [b] finished rows then get pad tokens
        self.ended = ended if self.ended is None else self.ended | ended
        live = (~self.ended).sum()
        return ((live <= self.max_live) & (live > 0)).expand_as(ended)  # [b] all rows alike


def _returned_cache(output) -> tuple[str, Cache]:
    """`generate`'s cache keyword and the cache it returned (`cache` in recent transformers,
    `past_key_values` before)."""
    name = "cache" if output.get("cache") is not None else "past_key_values"
    return name, output[name]


@torch.no_grad()
def prefill_groups(
    model: PreTrainedModel, prompt_ids: Tensor, prompt_mask: Tensor, num_generations: int
) -> dict[str, Cache] | None:
    """`generate`'s cache keyword argument for the prompts `[N, P]` repeated `num_generations` times each:
    the keys and values of every prompt but its last token, computed once per prompt and then repeated.

    `generate` runs the last prompt token itself (it needs at least one uncached token) and samples on
    from there, the same logits as from a prefill of every row. None when the prompts are one token long.
    """
    if prompt_ids.size(1) < 2:
        return None
    cache = DynamicCache(config=model.config)
    was_training = model.training
    model.eval()  # as generate_completions: no dropout
    try:
        model(
            input_ids=prompt_ids[:, :-1],
            attention_mask=prompt_mask[:, :-1],
            position_ids=position_ids(prompt_mask[:, :-1]),
            use_cache=True,
            logits_to_keep=1,
            **{cache_argument(model): cache},
        )
    finally:
        model.train(was_training)
    cache.batch_repeat_interleave(num_generations)
    return {cache_argument(model): cache}


@torch.no_grad()
def generate_completions(
    model: PreTrainedModel,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    settings: SamplingSettings,
    *,
    num_generations: int,
    do_sample: bool = True,
    prompt_cache: dict[str, Cache] | None = None,
    compile_config: CompileConfig | None = None,
    compact_above_rows: int | None = COMPACT_ABOVE_ROWS,
    keep_cache_rows: CacheRowSelect = select_cache_rows,
) -> Rollout:
    """Sample `num_generations` completions per prompt with batched `generate` calls and a KV cache, as
    `settings` say (the lengths, stop and pad ids, and the draw's repetition penalty, temperature, min-p,
    top-k and top-p).

    Sampling runs through `generate`'s greedy path with `sampling_processors` doing the draw (see
    `InverseCDFSampler`); `min_new_tokens` (EOS suppressed until then) applies before the draw. Nothing else
    changes the policy's distribution: the checkpoint's generation config contributes its EOS and pad ids
    only (`raw_policy_generation`), so the tokens are drawn from what `completion_logprobs` scores.

    Finished rows stop costing: a batch of more than `compact_above_rows` rows decodes until at most
    `COMPACT_LIVE_SHARE` (half) of them are live (`RowsEnded`), then the live rows go on alone, from
    `keep_cache_rows` of the cache (a dynamic cache: `select_cache_rows`), with the length bounds less what
    they decoded; `generate` runs their last token and continues, so no token is decoded twice or skipped,
    and each is drawn from the same distribution as in one call. Each round's tokens and log-probs go back
    to their rows. None: one `generate` call, every row decoded until the longest ends.

    `prompt_cache`: `generate`'s cache keyword argument with every prompt row's keys and values but its last
    token's, computed once per distinct prompt (`prefill_groups`), so that `generate` decodes;
    or a `StaticCache` (`static_engine.StaticEngine`). `compile_config`: how `generate` compiles the decoding
    step over a static cache; None never compiles. Sampled rollouts carry `sampler_logprobs`, each drawn
    token's log-prob under the distribution it was drawn from; greedy ones None.
    """
    prompt_ids = prompt_ids.repeat_interleave(num_generations, dim=0)  # [B, P] B = N*G
    prompt_mask = prompt_mask.repeat_interleave(num_generations, dim=0)  # [B, P]
    eos_token_ids, pad_token_id = list(settings.eos_token_ids), settings.pad_token_id
    eos = torch.tensor(eos_token_ids, device=prompt_ids.device)  # [E]
    B, budget = prompt_ids.size(0), settings.max_new_tokens
    tokens = prompt_ids.new_full((B, budget), pad_token_id)  # [B, T_max] each row's tokens, by column
    drawn_logprobs = torch.zeros(B, budget, dtype=torch.float32, device=prompt_ids.device)  # [B, T_max]
    all_drawn = do_sample  # every column has its draws' log-probs
    # Rows are dropped from a decoder's cache of keys and values per row: a model without a transformers
    # config (a scripted or wrapped LM) decodes in one call.
    config = getattr(model, "config", None)
    compacting = compact_above_rows is not None and config is not None and not config.is_encoder_decoder
    compacting = compacting and not_full_attention(config) is None
    rows = torch.arange(B, device=prompt_ids.device)  # [b] the row of each row of this round's batch
    ids, mask, cache = prompt_ids, prompt_mask, prompt_cache or {}  # [b, L] the batch's sequences so far
    decoded = 0  # columns decoded so far
    was_training = model.training
    model.eval()  # no dropout while sampling, and gradient checkpointing would switch the KV cache off
    try:
        with raw_policy_generation(model, eos_token_ids, pad_token_id):
            while True:
                drawn: list[Tensor] = []  # [b] per decoding step of this round
                b = ids.size(0)
                rows_ended = (
                    RowsEnded(eos, int(COMPACT_LIVE_SHARE * b))
                    if compacting and b > compact_above_rows
                    else None
                )
                output = model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    generation_config=GenerationConfig(
                        max_new_tokens=budget - decoded,
                        min_new_tokens=max(0, settings.min_new_tokens - decoded),
                        do_sample=False,
                        eos_token_id=eos_token_ids,
                        pad_token_id=pad_token_id,
                        use_cache=True,
                        return_dict_in_generate=True,
                        compile_config=compile_config,
                        disable_compile=compile_config is None,
                    ),
                    logits_processor=sampling_processors(settings, mask, drawn) if do_sample else None,
                    # A stop request (SIGTERM) is answered between decoding steps (`core.stop_requests`).
                    stopping_criteria=StoppingCriteriaList(
                        [StopCheck(), *([rows_ended] if rows_ended else [])]
                    ),
                    # transformers would otherwise step an FSDP-managed model in lockstep with every rank (one
                    # all-reduce per token, and a hang when ranks make different numbers of calls); our
                    # callers gather sharded weights first (`distributed.gathered_for_generation`).
                    synced_gpus=False,
                    **cache,
                )
                # A stand-in LM's `generate` may return the sequences alone (no dict).
                sequences = getattr(output, "sequences", output)  # [b, L + k]
                new = sequences[:, ids.size(1) :]  # [b, k]
                k = new.size(1)
                tokens[rows, decoded : decoded + k] = new
                all_drawn = all_drawn and len(drawn) >= k  # one draw per generated column, in order
                if all_drawn:
                    drawn_logprobs[rows, decoded : decoded + k] = torch.stack(drawn[:k], dim=1)
                decoded += k
                live = ~torch.isin(new, eos).any(dim=1)  # [b] no end token yet
                if rows_ended is None or decoded >= budget or not bool(live.any()):
                    break
                keep = live.nonzero().squeeze(1)  # [b']
                cache_name, returned = _returned_cache(output)
                cache = {cache_name: keep_cache_rows(returned, keep)}
                rows, ids = rows[keep], sequences[keep]  # [b'], [b', L + k]
                mask = torch.cat([mask[keep], mask.new_ones(keep.size(0), k)], dim=1)  # [b', L + k]
    finally:
        model.train(was_training)
    completion_ids = tokens[:, :decoded]  # [B, T]
    completion_mask, truncated = completion_mask_from_ids(completion_ids, eos_token_ids)
    completion_ids = completion_ids.masked_fill(completion_mask == 0, pad_token_id)
    sampler_logprobs = (
        drawn_logprobs[:, :decoded].masked_fill(completion_mask == 0, 0.0) if all_drawn else None
    )
    return Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, truncated, sampler_logprobs)
