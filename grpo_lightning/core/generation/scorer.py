"""The training scorer: the per-token log-probs (and entropies) of a rollout's completions under a model
(`LogProbScorer`, for the reference, old-policy and policy passes), each group's prompt encoded once when
the policy can share it (`shared_prompt`), inside the root's FSDP hooks when the caller says how (sharded
models: `io.distributed.call_in_root_forward`); its options (`ScoringOptions`, `GRPOConfig.scoring`). The
packed variant is `packing.PackedLogProbScorer`.

No Lightning here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import PreTrainedModel

from grpo_lightning.core.generation.logprobs import completion_logprobs
from grpo_lightning.core.generation.shared_prompt import group_completion_logprobs
from grpo_lightning.core.options import check_fields
from grpo_lightning.core.types import Rollout


def rows_share_prompts(rollout: Rollout, num_generations: int) -> bool:
    """Whether every run of `num_generations` rows of `rollout` holds one prompt, as sampled groups do."""
    ids, G = rollout.prompt_ids, num_generations  # [B, P]
    if ids.size(0) % G:
        return False
    groups = ids.view(-1, G, ids.size(1))  # [N, G, P]
    return torch.equal(groups, groups[:, :1].expand_as(groups))


@dataclass
class LogProbScorer:
    """Per-token log-probs (and entropies) of a rollout's completions under a model, float32 `[b, T]`.

    Args:
        num_generations: the group size G of the rollouts it scores.
        temperature: scales the logits as the sampler saw them.
        share_prompt: encode each group's prompt once (`shared_prompt.group_completion_logprobs`) when the
            scored rows hold whole groups of one prompt.
        entropy_grad: let the gradient flow through the entropies (an entropy bonus in the loss).
        in_root_forward: runs `(model, fn, *args)` as the model's forward; for a sharded model, so that the
            root's FSDP hooks gather the embeddings and LM head (`io.distributed.call_in_root_forward`).
            None calls `fn` directly.
    """

    num_generations: int
    temperature: float = 1.0
    share_prompt: bool = False
    entropy_grad: bool = False
    in_root_forward: Callable | None = None

    def __call__(
        self, model: PreTrainedModel, rollout: Rollout, rows: slice, with_entropy: bool = False
    ) -> tuple[Tensor, Tensor]:
        """`(logprobs, entropies)` of `rollout`'s `rows`, each `[b, T]`; entropies are zeros unless asked."""
        G = self.num_generations
        if self.share_prompt and rows_share_prompts(rollout, G):
            scorer, inputs = group_completion_logprobs, (rollout, rows, G)
        else:
            inputs = (rollout.input_ids[rows], rollout.attention_mask[rows], rollout.completion_ids.size(1))
            scorer = completion_logprobs
        options = dict(with_entropy=with_entropy, entropy_grad=with_entropy and self.entropy_grad)
        if self.in_root_forward is not None:
            return self.in_root_forward(
                model, scorer, model, *inputs, temperature=self.temperature, **options
            )
        return scorer(model, *inputs, temperature=self.temperature, **options)


@dataclass(frozen=True)
class ScoringOptions:
    """How the reference, old-policy and policy passes lay out their rows (`GRPOConfig.scoring`)."""

    share_prompt: bool = True
    """Encode each prompt once per group instead of once per completion, in generation (one prefill per
    prompt, its KV cache repeated to the G rows) and in the reference, old-policy and policy passes (the G
    completions attend to one prompt pass, whose gradient sums theirs); Prefix Grouper, arXiv:2506.05433.
    Same log-probs and gradients up to rounding (tests/test_share_prompt.py). A model that cannot share
    (attention without a KV cache, a sliding window in any layer, gradient checkpointing in transformers < 5)
    keeps the unshared path, with a warning.
    """
    packed_sequences: bool = True
    """Pack the reference, old-policy and policy passes: each micro-batch's rows laid end to end in a few
    lines (their prompts and completions, padding only where a line ends), kept apart by one attention
    mask, with position ids restarting at each row; with `share_prompt` a line holds a group's prompt once
    and several of its completions. The LM head runs on the completion tokens only. Same log-probs and
    gradients up to rounding (tests/test_packing.py). On MATH-like rollouts with `share_prompt` and the
    token budget the decoder computes 0.99 positions per token of the rows instead of 1.58
    (`benchmarks/token_budget.py --group`). Needs sdpa or eager attention and full attention in every layer:
    another model (flash attention, a sliding window in any layer) keeps the padded passes, with a warning
    (`grpo_lightning.core.generation.packing`). TRL: `padding_free`; verl: `use_remove_padding`.
    """

    def __post_init__(self) -> None:
        check_fields(self)
