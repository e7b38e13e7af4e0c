"""Running reward functions over a rollout, with checks that name the function at fault."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from grpo_lightning.rewards import reward_name


def score_completions(reward_funcs: Sequence[Callable], completions: list[str], **columns: list) -> Tensor:
    """Call each reward function TRL-style, `fn(completions=..., **columns)`, and stack the results.

    Returns `[B, F]` float32 with NaN where a function answered `None` (not applicable). Raises
    `RuntimeError` naming the function when it raises, returns the wrong number of values, or returns NaN
    or inf, and when some completion gets `None` from every function (it would have no reward at all).
    A function that answers `None` for a whole batch only warns: in a mixed data set it may not apply.
    """
    columns_out = []
    for fn in reward_funcs:
        name = reward_name(fn)
        try:
            values = fn(completions=completions, **columns)
        except Exception as err:
            raise RuntimeError(
                f"reward function {name!r} raised {type(err).__name__}: {err}; "
                f"first completion: {completions[0][:200]!r}"
            ) from err
        values = list(values)
        if len(values) != len(completions):
            raise RuntimeError(
                f"reward function {name!r} returned {len(values)} values for {len(completions)} completions"
            )
        for i, v in enumerate(values):
            if v is not None and not math.isfinite(v):
                raise RuntimeError(
                    f"reward function {name!r} returned {v} for completion {i}: {completions[i][:200]!r}"
                )
        if all(v is None for v in values):
            warnings.warn(
                f"reward function {name!r} returned None for every completion of this batch", stacklevel=2
            )
        columns_out.append([math.nan if v is None else float(v) for v in values])
    rewards = torch.tensor(columns_out, dtype=torch.float32).T  # [B, F]
    unscored = rewards.isnan().all(dim=1)  # [B]
    if unscored.any():
        i = int(unscored.nonzero()[0])
        names = [reward_name(fn) for fn in reward_funcs]
        raise RuntimeError(
            f"no reward function {names} scored completion {i} (all returned None): {completions[i][:200]!r}"
        )
    return rewards
