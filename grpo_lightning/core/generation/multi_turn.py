"""Multi-turn rollouts with tools over any `RolloutEngine`: the model writes a turn, its tool calls run, the
results' ids are appended, and the model goes on, each sample's ids growing token by token.

For all the group's rows at once: the engine samples the first turn of every row, then each round takes
the rows whose last turn ended (an end-of-sequence token) with tool calls, runs the calls
(`tools.calls.ToolRunner`), appends the ids of the tool turn (`tools.turns.tool_suffix_ids`: the results
and the next assistant header, never a re-tokenised transcript) and samples the next turn of those rows
alone, each from its own context; a row whose turn calls nothing, or that ran out of budget, leaves the
batch. `settings.max_new_tokens` (`max_completion_length`) covers all turns together, tool tokens
included: a tool turn that would pass it, or would fill the context (the least of the engine's own ceiling
where it has one, vLLM's `max_model_len`, and the model's `config.max_position_embeddings`, as TRL checks),
is not appended and its sample ends there; a turn is cut to what is left, and a tool turn that leaves
nothing ends its sample, cut, after the results.
`ToolOptions.max_calling_iterations` bounds the rounds (`ToolRunner.may_call`).

Each turn is read once, by the chat template's tool-call format (`tools.formats`, `ToolOptions.call_format`),
into the assistant message TRL builds from it: its calls, with arguments typed by the tools' schemas, and its
content. A turn whose calls cannot be read (broken JSON) calls nothing, as TRL's: the sample ends there.
Reading a turn, running its calls, turning their results into content and rendering the tool turn are one
guarded unit: whatever the model wrote and whatever the tools returned, the sample goes on with an error
result or ends as a plain turn (`ToolRunner.parse`, `ToolRunner.__call__`), and a tool turn the chat template
cannot render is rendered again with each result replaced by an error naming its tool; only a template that
cannot render even that ends the sample after the model's turn.

The `Rollout`'s completion holds every turn: `completion_mask` is 1 on all of it (model and tool tokens,
what the scorer attends to), `tool_mask` 0 on the tool turns (what the loss must not count),
`sampler_logprobs` 0 there too. Each row's turns come back as the messages TRL's reward functions read
(`ToolTurns.messages`): the assistant turns with their calls, the tool results.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo_lightning.core.chat_template import PromptOptions
from grpo_lightning.core.generation.engines import RolloutEngine
from grpo_lightning.core.generation.sampling import SamplingSettings
from grpo_lightning.core.tools.calls import (
    Content,
    ToolCall,
    ToolCallCounts,
    ToolRunner,
    describe,
    error_text,
    is_error,
)
from grpo_lightning.core.tools.formats import ParsedTurn, choose_format, result_message
from grpo_lightning.core.tools.schemas import template_renders_tools
from grpo_lightning.core.tools.turns import check_prefix_preserving, tool_messages, tool_suffix_ids
from grpo_lightning.core.types import Rollout


@dataclass
class _Sample:
    """One row's growing completion."""

    context: list[int]  # the prompt's ids, unpadded
    ids: list[int]
    own: list[int]  # 1: the model's token, 0: a tool turn's
    logprobs: list[float]
    truncated: bool
    calls: list[ToolCall] = field(default_factory=list)  # the last turn's calls
    messages: list[dict] = field(default_factory=list)  # the turns as chat messages, for the rewards


def _context_limit(engine: RolloutEngine, model: PreTrainedModel) -> int | None:
    """What a turn's context must stay under: the least of the engine's own ceiling (vLLM refuses a prompt
    of `max_model_len` tokens or more) and the model's positions; None: no bound known."""
    limits = (
        getattr(engine, "max_model_len", None),
        getattr(getattr(model, "config", None), "max_position_embeddings", None),
    )
    return min((limit for limit in limits if limit is not None), default=None)


@dataclass
class ToolTurns:
    """What a multi-turn rollout did beyond its ids: the calls made and failed, and each row's completion as
    chat messages (assistant turns with their `tool_calls`, a `tool` message per result), as TRL's reward
    functions get them."""

    counts: ToolCallCounts
    messages: list[list[dict]]


class ToolRollouts:
    """Multi-turn rollouts of `runner`'s tools through `engine`, the chat template of `tokenizer` rendering
    the tool turns with `prompt_options` (the run's `GRPOConfig.prompts`, as its prompts), bounded by the
    runner's `ToolOptions`, the turns read in the template's tool-call format (`format`). Checks once that
    the template renders conversations as prefixes of the next (`tools.turns.check_prefix_preserving`),
    refusing it otherwise: a run swaps in TRL's training template first where one exists
    (`tools.turns.training_template`)."""

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer: PreTrainedTokenizerBase,
        runner: ToolRunner,
        prompt_options: PromptOptions = PromptOptions(),
    ) -> None:
        self.engine, self.tokenizer, self.runner = engine, tokenizer, runner
        self.prompt_options = prompt_options
        schemas = list(runner.schemas.values())
        self.template_has_tools = template_renders_tools(tokenizer, schemas, prompt_options)
        check_prefix_preserving(tokenizer, self.template_has_tools, prompt_options)
        self.format = choose_format(
            tokenizer.chat_template, self.template_has_tools, runner.options.call_format
        )

    def generate(
        self,
        model: PreTrainedModel,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        *,
        num_generations: int,
        do_sample: bool = True,
        settings: SamplingSettings | None = None,
    ) -> tuple[Rollout, ToolTurns]:
        """`num_generations` multi-turn completions for each prompt of `prompt_ids` `[N, P]` (left-padded),
        prompt i's group in rows i*G .. i*G+G-1, and their turns (`ToolTurns`)."""
        s = settings or self.engine.settings
        first = self.engine.generate(
            model, prompt_ids, prompt_mask, num_generations=num_generations, do_sample=do_sample, settings=s
        )
        sampled = first.sampler_logprobs is not None
        samples = [
            _Sample(
                context=prompt[mask.bool()].tolist(),
                ids=ids[keep.bool()].tolist(),
                own=[1] * int(keep.sum()),
                logprobs=logprobs[keep.bool()].tolist() if sampled else [],
                truncated=bool(truncated),
            )
            for prompt, mask, ids, keep, truncated, logprobs in zip(
                first.prompt_ids,  # [B, P]
                first.prompt_mask,
                first.completion_ids,  # [B, T]
                first.completion_mask,
                first.truncated,  # [B]
                first.sampler_logprobs if sampled else first.completion_mask,
                strict=True,
            )
        ]
        for row, sample in enumerate(samples):
            self._read_turn(row, sample, sample.ids, before=[])
        calls_before, failures_before = self.runner.counts.calls, self.runner.counts.failures
        later = replace(s, min_new_tokens=0, share_prompt=False)  # each row's context is its own
        live = [i for i, sample in enumerate(samples) if not sample.truncated]
        rounds = 0
        context_limit = _context_limit(self.engine, model)
        while live and self.runner.may_call(rounds):
            live = [i for i in live if samples[i].calls]
            if not live:
                break
            results = self.runner([samples[i].calls for i in live], rows=live)
            going = []
            for i, row_results in zip(live, results, strict=True):
                row_results, suffix = self._tool_turn(row_results)
                length = len(samples[i].ids) + len(suffix) if suffix is not None else None
                if (
                    length is None
                    or length > s.max_new_tokens
                    or (context_limit is not None and len(samples[i].context) + length >= context_limit)
                ):
                    continue  # the tool turn would not fit: the sample ends with the model's turn
                samples[i].ids += suffix
                samples[i].own += [0] * len(suffix)
                samples[i].logprobs += [0.0] * len(suffix) if sampled else []
                samples[i].messages += [result_message(name, content) for name, content in row_results]
                if length == s.max_new_tokens:  # no token left for a next turn: cut after the results, as TRL
                    samples[i].truncated = True
                    continue
                going.append(i)
            if not going:
                break
            rollout = self._next_turns(model, [samples[i] for i in going], later, do_sample)
            for row, i in enumerate(going):
                sample = samples[i]
                left = s.max_new_tokens - len(sample.ids)
                keep = rollout.completion_mask[row].bool()  # [T]
                turn = rollout.completion_ids[row][keep].tolist()[:left]
                sample.truncated = bool(rollout.truncated[row]) or len(turn) < int(keep.sum())
                before = sample.ids
                sample.ids = sample.ids + turn
                sample.own += [1] * len(turn)
                if sampled:
                    sample.logprobs += rollout.sampler_logprobs[row][keep].tolist()[:left]
                self._read_turn(i, sample, turn, before)
            live = [i for i in going if not samples[i].truncated]
            rounds += 1
        counts = ToolCallCounts(
            self.runner.counts.calls - calls_before, self.runner.counts.failures - failures_before
        )
        turns = ToolTurns(counts, [sample.messages for sample in samples])
        return self._rollout(first, samples, sampled, s.pad_token_id), turns

    def _read_turn(self, row: int, sample: _Sample, turn: list[int], before: list[int]) -> None:
        """Read the model's `turn` of rollout row `row` (sampled after `before`, the completion's ids so far)
        as TRL reads it: its message joins the sample's, its calls are the next round's. The format starts
        reading at the prompt's last assistant header (the template may open the turn: a `<think>`); with
        the Hermes calls a system prompt teaches, at the turn itself."""
        parsed: ParsedTurn = self.runner.parse(
            self.format,
            self._text(turn),
            prompt=self._text(sample.context + before) if self.template_has_tools else "",
            schemas=list(self.runner.tools_of(row)[1].values()),
            plain_text=self._text(turn, skip_special=True),
            eos_token=self.tokenizer.eos_token,
        )
        sample.messages.append(parsed.message)
        sample.calls = [ToolCall(call.name, call.arguments) for call in parsed.calls]

    def _tool_turn(
        self, results: list[tuple[str, Content]]
    ) -> tuple[list[tuple[str, Content]], list[int] | None]:
        """The results of one row's calls and the ids of their tool turn; where the chat template raises on
        them, each result replaced by an error naming its tool, and None for the ids where it raises on those
        too (the sample ends with the model's turn)."""
        try:
            turn = tool_messages(results, self.template_has_tools)
            return results, tool_suffix_ids(self.tokenizer, turn, self.prompt_options)
        except Exception as error:  # a template's raise_exception, or an error on what a result holds
            why = describe(error)
        self.runner.counts.failures += sum(not is_error(content) for _, content in results)
        results = [
            (name, error_text(f"the chat template cannot render the result of {name}: {why}"))
            for name, _ in results
        ]
        try:
            return results, tool_suffix_ids(
                self.tokenizer, tool_messages(results, self.template_has_tools), self.prompt_options
            )
        except Exception:  # the template refuses any tool turn here
            return results, None

    def _text(self, ids: list[int], skip_special: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special)

    def _next_turns(
        self, model: PreTrainedModel, samples: list[_Sample], settings: SamplingSettings, do_sample: bool
    ) -> Rollout:
        """One turn for each of `samples`, from its prompt and completion so far, left-padded into one batch,
        up to the most budget any of them has left (each is cut to its own)."""
        contexts = [sample.context + sample.ids for sample in samples]
        width = max(len(ids) for ids in contexts)
        device = self._device(model)
        ids = torch.full((len(contexts), width), settings.pad_token_id, dtype=torch.long)  # [b, L]
        mask = torch.zeros(len(contexts), width, dtype=torch.long)  # [b, L]
        for row, context in enumerate(contexts):
            ids[row, width - len(context) :] = torch.tensor(context)
            mask[row, width - len(context) :] = 1
        budget = max(settings.max_new_tokens - len(sample.ids) for sample in samples)
        return self.engine.generate(
            model,
            ids.to(device),
            mask.to(device),
            num_generations=1,
            do_sample=do_sample,
            settings=replace(settings, max_new_tokens=budget),
        )

    @staticmethod
    def _device(model: PreTrainedModel) -> torch.device:
        parameter = next(model.parameters(), None)
        return parameter.device if parameter is not None else torch.device("cpu")

    @staticmethod
    def _rollout(first: Rollout, samples: list[_Sample], sampled: bool, pad_token_id: int) -> Rollout:
        T = max(1, max(len(sample.ids) for sample in samples))
        B, device = len(samples), first.completion_ids.device
        ids = torch.full((B, T), pad_token_id, dtype=torch.long)  # [B, T]
        completion_mask = torch.zeros(B, T, dtype=torch.long)  # [B, T] every token of every turn
        tool_mask = torch.zeros(B, T, dtype=torch.long)  # [B, T] the model's own tokens
        logprobs = torch.zeros(B, T, dtype=torch.float32)  # [B, T]
        for row, sample in enumerate(samples):
            n = len(sample.ids)
            ids[row, :n] = torch.tensor(sample.ids, dtype=torch.long)
            completion_mask[row, :n] = 1
            tool_mask[row, :n] = torch.tensor(sample.own, dtype=torch.long)
            if sampled:
                logprobs[row, :n] = torch.tensor(sample.logprobs, dtype=torch.float32)
        return Rollout(
            prompt_ids=first.prompt_ids,  # [B, P]
            prompt_mask=first.prompt_mask,
            completion_ids=ids.to(device),
            completion_mask=completion_mask.to(device),
            truncated=torch.tensor([sample.truncated for sample in samples], device=device),
            sampler_logprobs=logprobs.to(device) if sampled else None,
            tool_mask=tool_mask.to(device),
        )
