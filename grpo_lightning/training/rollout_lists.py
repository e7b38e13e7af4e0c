"""A `rollout_func`'s per-sample lists (TRL's: `prompt_ids`, `completion_ids`, `logprobs`, `env_mask`) as a
`Rollout`, each value checked first (integer ids within the vocabulary, finite log-probs, a mask of 0 and
1), so that a wrong one is one line naming `rollout_func` before any forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from grpo_lightning.core.types import Rollout


def _padded(rows: Sequence[Sequence], value: float, left: bool, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    width = max(1, max(len(row) for row in rows))
    values = torch.full((len(rows), width), value, dtype=dtype)  # [B, W]
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        if len(row):
            cols = slice(width - len(row), width) if left else slice(0, len(row))
            values[i, cols], mask[i, cols] = torch.tensor(list(row), dtype=dtype), 1
    return values, mask


def _checked_values(
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    logprobs: Sequence[Sequence[float]] | None,
    env_mask: Sequence[Sequence[int]] | None,
    vocab_size: int | None,
) -> None:
    """Refuse, in one line naming `rollout_func`, the field and the sample, what would crash deep in the
    log-prob pass or train on the wrong tokens in silence: an id that is not an integer (a float would be
    truncated), negative or past the vocabulary; a log-prob that is not a finite number; an `env_mask` value
    other than 0 and 1 (2 would count a token twice, -1 negate its loss)."""
    fields = {
        "prompt_ids": prompt_ids,
        "completion_ids": completion_ids,
        "logprobs": logprobs,
        "env_mask": env_mask,
    }
    for name, rows in fields.items():
        for i, row in enumerate(rows or []):
            if not len(row):
                continue
            try:
                values = torch.as_tensor(row if isinstance(row, Tensor) else list(row))
            except (TypeError, ValueError, RuntimeError):
                raise ValueError(
                    f"rollout_func's {name}[{i}] is not a list of numbers: {row!r:.80}"
                ) from None
            where = f"rollout_func's {name}[{i}]"
            if name == "logprobs":
                if (
                    values.dtype == torch.bool
                    or values.is_complex()
                    or not torch.isfinite(values.double()).all()
                ):
                    raise ValueError(f"{where} holds a value that is not a finite number: {row!r:.80}")
                continue
            if values.dtype == torch.bool:
                values = values.long()
            if values.is_floating_point() or values.is_complex():
                raise ValueError(f"{where} holds {values.dtype} values, not integers: {row!r:.80}")
            if name == "env_mask":
                bad = values[(values != 0) & (values != 1)]
                if len(bad):
                    raise ValueError(
                        f"{where} holds {int(bad[0])}: env_mask is 1 on the policy's tokens and 0 on the "
                        "others, nothing else"
                    )
                continue
            low, high = int(values.min()), int(values.max())
            if low < 0:
                raise ValueError(f"{where} holds the id {low}: token ids are not negative")
            if vocab_size is not None and high >= vocab_size:
                raise ValueError(
                    f"{where} holds the id {high}, past the model's vocabulary ({vocab_size} ids: 0 to "
                    f"{vocab_size - 1})"
                )


def rollout_of_lists(
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    logprobs: Sequence[Sequence[float]] | None,
    env_mask: Sequence[Sequence[int]] | None,
    *,
    rows: int,
    pad_token_id: int,
    eos_token_ids: Sequence[int],
    vocab_size: int | None = None,
    device: torch.device | str = "cpu",
) -> Rollout:
    """A `Rollout` of per-sample id lists (a `rollout_func`'s): prompts left-padded, completions
    right-padded; `env_mask` as the `tool_mask` (0: not the policy's token); a completion is truncated when
    it does not end with an end-of-sequence id. Each list must have `rows` entries, each sample's
    `logprobs` and `env_mask` as many as its completion ids; ids must be integers in `[0, vocab_size)`,
    log-probs finite numbers, `env_mask` values 0 or 1 (`_checked_values`), else one line says which."""
    named = {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}
    for name, values in {**named, "env_mask": env_mask}.items():
        if values is not None and len(values) != rows:
            raise ValueError(f"rollout_func returned {len(values)} {name} for {rows} samples")
    for name, values in {"logprobs": logprobs, "env_mask": env_mask}.items():
        for i, (ids, per_token) in enumerate(zip(completion_ids, values or [], strict=False)):
            if len(per_token) != len(ids):
                raise ValueError(
                    f"rollout_func's {name}[{i}] has {len(per_token)} values for {len(ids)} completion ids"
                )
    _checked_values(prompt_ids, completion_ids, logprobs, env_mask, vocab_size)
    prompt, prompt_mask = _padded(prompt_ids, pad_token_id, left=True, dtype=torch.long)  # [B, P]
    completion, completion_mask = _padded(
        completion_ids, pad_token_id, left=False, dtype=torch.long
    )  # [B, T]
    sampler = None if logprobs is None else _padded(logprobs, 0.0, left=False, dtype=torch.float32)[0]
    tool_mask = None if env_mask is None else _padded(env_mask, 0, left=False, dtype=torch.long)[0]
    truncated = torch.tensor([not ids or ids[-1] not in eos_token_ids for ids in completion_ids])
    tensors = (prompt, prompt_mask, completion, completion_mask, truncated, sampler, tool_mask)
    return Rollout(*(None if t is None else t.to(device) for t in tensors))
