"""Token-level step credit: which tokens went wrong, and not only that the answer did.

`step_credit_penalties` maps the wrong arithmetic steps of each completion
(`grpo_lightning.core.rewards.steps`)
onto the generated tokens that wrote them (`token_char_spans`), as `[B, T]` penalties that are added to the
outcome advantage, so the policy learns which step went wrong.

Pure torch and tokenizer calls: nothing here knows about Lightning.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from grpo_lightning.core.rewards.steps import wrong_step_spans

__all__ = ["step_credit_penalties", "step_token_penalties", "token_char_spans"]


def step_token_penalties(text_offsets: list[tuple[int, int]], text: str, penalty: float) -> list[float]:
    """Token-level credit: ``-penalty`` for each token that overlaps a wrong step, ``0.0`` elsewhere.

    ``text_offsets`` are the completion tokens' character offsets into ``text``, as returned by a Hugging
    Face fast tokenizer with ``return_offsets_mapping=True``. A token overlaps a span when they share at
    least one character, so a number split over several tokens is penalised as a whole; empty offsets
    (special tokens, ``(0, 0)``) never overlap. The result can be added to per-token advantages.
    """
    spans = wrong_step_spans(text)
    return [
        -penalty if any(start < span_end and span_start < end for span_start, span_end in spans) else 0.0
        for start, end in text_offsets
    ]


def token_char_spans(tokenizer: PreTrainedTokenizerBase, ids: list[int], text: str) -> list[tuple[int, int]]:
    """Each token's `(start, end)` character span in `text`, the decoding of `ids` (special tokens skipped).

    Found by decoding every prefix of `ids`: the characters a prefix shares with `text` are the ones its
    tokens have fully written. A byte-level token that ends inside a multi-byte character decodes it as
    U+FFFD, which is not in `text`: that character is in progress, and both the token that starts it and the
    one that completes it span it. Special tokens span nothing. Works for any tokenizer whose `decode` is
    deterministic, whatever its pre-tokenizer does with spaces.
    """
    prefixes = tokenizer.batch_decode([ids[: k + 1] for k in range(len(ids))], skip_special_tokens=True)
    spans, written = [], 0
    for prefix in prefixes:
        done = len(os.path.commonprefix([prefix, text]))
        end = done + (len(prefix) > done)  # a partly written character belongs to this token too
        spans.append((written, max(written, end)))
        written = done
    return spans


def step_credit_penalties(
    tokenizer: PreTrainedTokenizerBase, completion_ids: Tensor, completion_mask: Tensor, penalty: float
) -> Tensor:
    """`[B, T]` float32: `-penalty` on every generated token that writes part of a wrong arithmetic step.

    Each row's text is its masked ids decoded as the reward functions see them (special tokens skipped);
    `wrong_step_spans` finds the claims that do not verify and `step_token_penalties` marks the tokens that
    overlap them. Only rows with a wrong step pay for the per-token decoding.
    """
    penalties = torch.zeros(completion_ids.shape, dtype=torch.float32)  # [B, T]
    lengths = completion_mask.sum(dim=1).tolist()  # [B] the mask runs from the first token to EOS
    for row, ids in enumerate(completion_ids.tolist()):
        ids = ids[: lengths[row]]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        if not wrong_step_spans(text):
            continue
        spans = token_char_spans(tokenizer, ids, text)
        penalties[row, : len(ids)] = torch.tensor(step_token_penalties(spans, text, penalty))
    return penalties.to(completion_ids.device)
