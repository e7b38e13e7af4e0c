"""Packed log-prob passes: a micro-batch's rows laid end to end in a few lines, with padding only where a
line ends (`grpo.scoring.packed_sequences`).

A rollout is a padded tensor: prompts left-padded to the longest prompt, completions right-padded to the
longest completion. Its decoder passes (reference, old policy, policy) compute every padding position as if
it were a token. Here each row's real tokens (its prompt, then its completion but the last token, which
predicts nothing that is scored) go end to end into lines, and one attention mask keeps the rows apart;
position ids restart at each row's prompt, as `logprobs.position_ids` numbers the padded row. Every real
token then sees exactly the tokens, at exactly the positions, it sees in its padded row, so its log-prob is
the same up to rounding (tests/test_packing.py checks this in float64).

- Unshared (one prompt pass per row): a line holds whole rows under a block-diagonal causal mask, as
  transformers' padding-free collator (`DataCollatorWithFlattening`) packs them.
- Shared (`scoring.share_prompt`, Prefix Grouper arXiv:2506.05433): a line holds segments, each one copy of a
  group's prompt followed by several of its completions; a completion token sees its prompt and the tokens
  of its own completion before it, never its siblings'.

sdpa and eager attention compute a masked score as dearly as any other, so a line's attention costs its
width squared: lines are as wide as the longest row, twice that, or (shared) a whole group, whichever
computes the fewest FLOPs (`pack_rows`, `scores_per_position`). Wider lines waste less room at their ends
and copy a group's prompt fewer times, but every token attends over the whole line.

The LM head then runs on the scored tokens only (`logprobs.head_logprobs`), not on the padding after each
row's end. The mask is a 4-D tensor in the format of the model's attention implementation (boolean for
sdpa, additive for eager); flash attention takes no such mask, so `packing_unsupported` sends those models
(and models with sliding-window layers, whose masks differ per layer) to the padded passes.

No Lightning here.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from grpo_lightning.core.generation.logprobs import HeadOptions, head_logprobs
from grpo_lightning.core.generation.model_abilities import not_full_attention
from grpo_lightning.core.generation.scorer import LogProbScorer, rows_share_prompts
from grpo_lightning.core.types import Rollout

if TYPE_CHECKING:  # typing.Unpack is Python 3.11's
    from typing_extensions import Unpack

PACKED_ATTENTION = ("sdpa", "eager")  # the attention implementations that take a 4-D mask


@dataclass
class PackedRows:
    """Rows of a rollout packed into `[lines, W]`, and where each scored token's predicting state is.

    `segment` numbers the runs of tokens that may attend to each other (a row, or a prompt with several
    completions; -1 on the padding at the end of a line); `branch` is 0 on prompt tokens and k >= 1 on the
    segment's k-th completion. `source` holds, for every scored token `[b, T]` where `scored`, in row-major
    order, the index in the flattened `[lines * W]` of the position whose hidden state predicts it.
    """

    input_ids: Tensor  # [lines, W]
    position_ids: Tensor  # [lines, W]
    segment: Tensor  # [lines, W]
    branch: Tensor  # [lines, W]
    source: Tensor  # [n] n = scored.sum()
    scored: Tensor  # [b, T] bool: the completion tokens (`completion_mask`)

    def attention_mask(self, implementation: str, dtype: torch.dtype) -> Tensor:
        """`[lines, 1, W, W]`: a token attends to the earlier tokens of its segment that are prompt tokens
        or tokens of its own completion (itself included), as boolean (sdpa) or additive (eager) mask."""
        seg, branch = self.segment, self.branch  # [lines, W] each
        W = seg.size(1)
        causal = torch.ones(W, W, dtype=torch.bool, device=seg.device).tril()  # [W, W] key <= query
        same_segment = seg[:, :, None] == seg[:, None, :]  # [lines, W(query), W(key)]
        key_branch = branch[:, None, :]  # [lines, 1, W]
        visible = (key_branch == 0) | (key_branch == branch[:, :, None])  # [lines, W, W]
        allowed = (causal & same_segment & visible)[:, None]  # [lines, 1, W, W]
        if implementation == "eager":
            blocked = torch.finfo(dtype).min
            return torch.zeros(allowed.shape, dtype=dtype, device=seg.device).masked_fill_(~allowed, blocked)
        return allowed


@dataclass
class _Layout:
    """Where each segment goes: `segments` are (line, its prompt's row, its completions' rows), `loads` the
    tokens of each line, `width` the fullest line's."""

    segments: list[tuple[int, int, list[int]]]
    loads: list[int]

    @property
    def width(self) -> int:
        return max(self.loads)

    def cost(self, scores_per_position: float) -> float:
        """Positions computed, plus the attention scores computed in units of a position's weights."""
        positions = len(self.loads) * self.width
        return positions + positions * self.width / scores_per_position


def _lay_out(groups: list[list[int]], prompt_lengths: list[int], sizes: list[int], width: int) -> _Layout:
    """Segments of at most `width` tokens in lines of at most `width` tokens: groups by their longest row
    first, each group's completions longest first; a completion joins its group's latest segment while the
    line has room, else starts a segment (a copy of the prompt) in the first line with room for both."""
    layout = _Layout([], [])
    for members in sorted(groups, key=lambda rows: -max(prompt_lengths[r] + sizes[r] for r in rows)):
        current = None  # the group's latest segment
        for r in sorted(members, key=lambda r: -sizes[r]):
            if current is not None and layout.loads[layout.segments[current][0]] + sizes[r] <= width:
                layout.segments[current][2].append(r)
                layout.loads[layout.segments[current][0]] += sizes[r]
                continue
            need = prompt_lengths[r] + sizes[r]
            line = next((i for i, load in enumerate(layout.loads) if load + need <= width), len(layout.loads))
            if line == len(layout.loads):
                layout.loads.append(0)
            layout.loads[line] += need
            layout.segments.append((line, r, [r]))
            current = len(layout.segments) - 1
    return layout


def scores_per_position(model: nn.Module) -> float:
    """How many attention scores cost the FLOPs of one position through a decoder layer's weights: a layer
    of W weights costs 2 W per position, an attention score (query . key, then its share of the value)
    4 x hidden size. About 640 for a 2-layer Llama of hidden 64, 3,000 for SmolLM2-135M, 24,000 for a 7B."""
    decoder = model.get_decoder()
    config = decoder.config
    weights = sum(p.numel() for p in decoder.parameters()) - model.get_input_embeddings().weight.numel()
    return weights / config.num_hidden_layers / (2 * config.hidden_size)


def pack_rows(
    rollout: Rollout, rows: slice, group_size: int | None = None, scores_per_position: float = 3000.0
) -> PackedRows:
    """Pack `rollout`'s `rows` (a contiguous slice) into lines.

    `group_size`: None packs each row on its own (its prompt, then its completion); G shares each group's
    prompt (rows `[i * G, (i + 1) * G)` of the rollout, which the caller checked share it) among several of
    its completions in one segment. Lines are the longest row wide, or twice that, or (shared) a whole
    group's prompt and completions wide, whichever computes the fewest FLOPs: positions, plus attention
    scores counted at `scores_per_position` (`scores_per_position(model)`) each. Wider lines leave less
    room unused at their ends and copy a group's prompt fewer times, but every token of a line attends
    over all of it (sdpa and eager attention compute the masked scores too).
    """
    start, stop, step = rows.indices(rollout.completion_ids.size(0))
    if step != 1 or stop <= start:
        raise ValueError(f"rows must be a non-empty contiguous slice, got {rows}")
    prompt_ids, completion_ids = rollout.prompt_ids[rows], rollout.completion_ids[rows]  # [b, P], [b, T]
    completion_mask = rollout.completion_mask[rows].bool()  # [b, T]
    b, P, T = prompt_ids.size(0), prompt_ids.size(1), completion_ids.size(1)
    prompt_lengths = rollout.prompt_mask[rows].sum(1).tolist()  # [b] left-padded: the last ones
    completion_lengths = completion_mask.sum(1).tolist()  # [b] right-padded: the first ones
    if 0 in prompt_lengths:
        row = start + prompt_lengths.index(0)
        raise ValueError(f"row {row} has an empty prompt: nothing predicts its first completion token")
    sizes = [max(c - 1, 0) for c in completion_lengths]  # a completion's last token predicts nothing scored
    if group_size is None:
        groups = [[r] for r in range(b)]
    else:
        first = start - start % group_size
        groups = [
            list(range(max(g, start) - start, min(g + group_size, stop) - start))
            for g in range(first, stop, group_size)
        ]
    longest = max(p + size for p, size in zip(prompt_lengths, sizes, strict=True))
    widths = {longest, 2 * longest}
    if group_size is not None:
        widths.add(max(prompt_lengths[rows[0]] + sum(sizes[r] for r in rows) for rows in groups))
    layout = min(
        (_lay_out(groups, prompt_lengths, sizes, width) for width in sorted(widths)),
        key=lambda layout: layout.cost(scores_per_position),
    )

    # Flat indices into [prompt_ids, completion_ids, one padding token] for every position of every line.
    W, lines = layout.width, len(layout.loads)
    pad = b * (P + T)
    tokens, positions = [pad] * (lines * W), [0] * (lines * W)
    segment, branch = [-1] * (lines * W), [0] * (lines * W)  # padding: a segment of its own
    source: list[list[int]] = [[] for _ in range(b)]  # each row's predicting positions
    filled = [line * W for line in range(lines)]
    for index, (line, prompt_row, members) in enumerate(layout.segments):
        at, p = filled[line], prompt_lengths[prompt_row]
        tokens[at : at + p] = range(prompt_row * P + P - p, prompt_row * P + P)
        positions[at : at + p] = range(p)
        segment[at : at + p] = [index] * p
        prompt_end, at = at + p - 1, at + p
        for k, r in enumerate(members, start=1):
            n = sizes[r]
            tokens[at : at + n] = range(b * P + r * T, b * P + r * T + n)
            positions[at : at + n] = range(p, p + n)
            segment[at : at + n], branch[at : at + n] = [index] * n, [k] * n
            # Token 0 is predicted by the prompt's last position, token t by the completion's token t - 1.
            source[r] = [prompt_end, *range(at, at + n)][: completion_lengths[r]]
            at += n
        filled[line] = at

    device = rollout.completion_ids.device
    flat = torch.cat([prompt_ids.reshape(-1), completion_ids.reshape(-1), prompt_ids.new_zeros(1)])
    shape = (lines, W)
    scored = torch.arange(T, device=device) < completion_mask.sum(1, keepdim=True)  # [b, T]
    if not torch.equal(scored, completion_mask):
        raise ValueError("completion_mask must be 1 on a prefix of each row (up to its end) and 0 after")
    return PackedRows(
        input_ids=flat[torch.tensor(tokens, device=device)].view(shape),
        position_ids=torch.tensor(positions, device=device).view(shape),
        segment=torch.tensor(segment, device=device).view(shape),
        branch=torch.tensor(branch, device=device).view(shape),
        source=torch.tensor([i for row in source for i in row], dtype=torch.long, device=device),
        scored=scored,
    )


def packing_unsupported(model: nn.Module) -> str | None:
    """Why `model`'s decoder cannot take packed rows, or None when it can."""
    decoder = model.get_decoder()
    config = decoder.config
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in PACKED_ATTENTION:
        return f"its attention implementation {implementation!r} takes no 4-D mask (sdpa and eager do)"
    if (reason := not_full_attention(model.config)) is not None:
        return reason
    if "position_ids" not in inspect.signature(decoder.forward).parameters:
        return f"{type(decoder).__name__}.forward takes no position ids"
    return None


def packed_completion_logprobs(
    model: PreTrainedModel,
    rollout: Rollout,
    rows: slice,
    group_size: int | None = None,
    **head: Unpack[HeadOptions],
) -> tuple[Tensor, Tensor]:
    """`logprobs.completion_logprobs` of `rollout`'s `rows`, packed (`pack_rows`; `group_size`: each
    group's prompt shared by its completions; `head`: `head_logprobs`' options). Returns
    `(logprobs, entropies)`, each `[b, T]` float32, 0 after each row's end."""
    packed = pack_rows(rollout, rows, group_size, scores_per_position(model))
    decoder = model.get_decoder()
    dtype = model.get_input_embeddings().weight.dtype
    hidden = decoder(
        input_ids=packed.input_ids,
        attention_mask=packed.attention_mask(decoder.config._attn_implementation, dtype),
        position_ids=packed.position_ids,
        use_cache=False,
    ).last_hidden_state  # [lines, W, H]
    hidden = hidden.reshape(-1, hidden.size(-1))[packed.source]  # [n, H] the states predicting each token
    targets = rollout.completion_ids[rows][packed.scored]  # [n]
    logprobs, entropies = head_logprobs(model, hidden[None], targets[None], **head)  # [1, n] each
    zeros = torch.zeros(packed.scored.shape, dtype=logprobs.dtype, device=logprobs.device)  # [b, T]
    return zeros.masked_scatter(packed.scored, logprobs[0]), zeros.masked_scatter(packed.scored, entropies[0])


class PackedLogProbScorer(LogProbScorer):
    """`LogProbScorer` on packed rows (`packed_completion_logprobs`): the same log-probs and entropies
    where `completion_mask` is 1, and 0 after each row's end."""

    def __call__(
        self, model: PreTrainedModel, rollout: Rollout, rows: slice, with_entropy: bool = False
    ) -> tuple[Tensor, Tensor]:
        G = self.num_generations
        group_size = G if self.share_prompt and rows_share_prompts(rollout, G) else None
        inputs = (rollout, rows, group_size)
        options = dict(with_entropy=with_entropy, entropy_grad=with_entropy and self.entropy_grad)
        if self.in_root_forward is not None:  # sharded: the root's FSDP hooks gather the embeddings, LM head
            return self.in_root_forward(
                model, packed_completion_logprobs, model, *inputs, temperature=self.temperature, **options
            )
        return packed_completion_logprobs(model, *inputs, temperature=self.temperature, **options)
