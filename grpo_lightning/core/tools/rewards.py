"""A shaping reward for calling tools: a small bonus for a well-formed call, which a policy that has not yet
found its tools needs to try them.

Without it a small model tends to learn to skip the tool and do no better than without one (verl's GSM8K
multi-turn example, Qwen2.5-0.5B, until a +0.1 reward for calling a tool was added, verl PR #4998). Give it a
small weight beside the accuracy reward (0.1 in `configs/gsm8k_calculator_smollm2.yaml`), so that a right
answer always outweighs a call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from grpo_lightning.core.tools.calls import is_error


def answered_tool_calls(completion: str | Sequence[dict]) -> int:
    """The tool calls of a multi-turn completion (its chat messages) that the tool answered without an
    error: its `tool` messages whose content is not an `{'error': ...}` result. A text completion has none."""
    if isinstance(completion, str):
        return 0
    return sum(
        1
        for message in completion
        if message.get("role") == "tool" and not is_error(message.get("content", ""))
    )


def tool_call_reward(completions: Sequence[str | Sequence[dict]], **kwargs: Any) -> list[float]:
    """1.0 for a completion with at least one well-formed tool call (read, of a known tool, answered without
    an error), else 0.0; one bonus per completion, however many calls
    it makes, so that calling more is not worth more."""
    return [float(answered_tool_calls(completion) > 0) for completion in completions]
