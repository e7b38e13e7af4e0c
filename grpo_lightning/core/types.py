"""The types that flow from generation to the loss, in the order they are made.

1. `Rollout`: G sampled completions per prompt (the generation engines, `core/generation/`).
2. `ScoredGroups`: a rollout with its rewards and the policy version that sampled it (`core/group_source.py`);
   dynamic sampling stacks several.
3. `Trajectory`: a scored rollout with everything the loss reads (`core/update.py`).

Pure torch: nothing here knows about Lightning.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass
class Rollout:
    """G sampled completions for each of N prompts, prompt i's group in rows i*G .. i*G+G-1."""

    prompt_ids: Tensor  # [N*G, P] left-padded
    prompt_mask: Tensor  # [N*G, P]
    completion_ids: Tensor  # [N*G, T] right-padded with the pad token
    completion_mask: Tensor  # [N*G, T] 1 up to and including the first EOS (multi-turn: the last turn's)
    truncated: Tensor  # [N*G] bool: no EOS within max_new_tokens
    # [N*G, T] float32: each drawn token's log-prob under the distribution the engine drew it from (after
    # the repetition penalty, temperature, min-p, top-k, top-p and min_new_tokens), 0 after the end; None for
    # greedy or scripted rollouts.
    sampler_logprobs: Tensor | None = None
    # [N*G, T] 1 on the model's own tokens, 0 on tool-result tokens (multi-turn rollouts with tools, TRL's
    # `tool_mask`); the loss counts completion_mask * tool_mask. None: every completion token is the model's.
    tool_mask: Tensor | None = None

    @property
    def model_mask(self) -> Tensor:  # [N*G, T]
        """1 on the completion tokens the model drew (`completion_mask` without the tool turns): what the
        loss, the KL, the lengths and the monitoring count."""
        return self.completion_mask if self.tool_mask is None else self.completion_mask * self.tool_mask

    @property
    def input_ids(self) -> Tensor:  # [N*G, P+T]
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    @property
    def attention_mask(self) -> Tensor:  # [N*G, P+T]
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1)

    def select(self, rows: Tensor, trim: bool = False) -> Rollout:
        """`rows` alone. `trim`: padded only to their own longest prompt and completion, the prompt columns
        that are padding in every one of them (left) and the completion columns after their longest
        completion (right) dropped. Positions come from the attention mask and attention is causal, so
        every kept token's log-prob is the one it has in the whole rollout."""
        rows = rows.to(self.completion_ids.device)
        prompt_mask, completion_mask = self.prompt_mask[rows], self.completion_mask[rows]  # [b, P], [b, T]
        P, T = prompt_mask.size(1), completion_mask.size(1)
        if trim:
            P = max(1, int(prompt_mask.sum(1).max()))  # left-padded: the last P columns hold every prompt
            T = max(1, int(completion_mask.sum(1).max()))  # right-padded: the first T hold every completion
        return Rollout(
            prompt_ids=self.prompt_ids[rows, -P:],  # [b, P']
            prompt_mask=prompt_mask[:, -P:],
            completion_ids=self.completion_ids[rows, :T],  # [b, T']
            completion_mask=completion_mask[:, :T],
            truncated=self.truncated[rows],
            sampler_logprobs=None if self.sampler_logprobs is None else self.sampler_logprobs[rows, :T],
            tool_mask=None if self.tool_mask is None else self.tool_mask[rows, :T],
        )


def _pad_columns(x: Tensor, width: int, value: int, left: bool) -> Tensor:
    missing = width - x.size(1)
    return F.pad(x, (missing, 0) if left else (0, missing), value=value)


def cat_rollouts(rollouts: list[Rollout], pad_token_id: int) -> Rollout:
    """Stack rollouts of different widths: prompts left-padded, completions right-padded, masked out.

    Padding changes no log-prob of a real token (the attention mask hides it and RoPE only sees relative
    positions), so groups of different generation rounds can share one update.
    """
    P = max(r.prompt_ids.size(1) for r in rollouts)
    T = max(r.completion_ids.size(1) for r in rollouts)

    def stacked(name: str, width: int, value: int, left: bool) -> Tensor:
        return torch.cat([_pad_columns(getattr(r, name), width, value, left) for r in rollouts])

    sampled = all(r.sampler_logprobs is not None for r in rollouts)
    with_tools = any(r.tool_mask is not None for r in rollouts)

    def tool_mask(r: Rollout) -> Tensor:  # [n, T_r]: a rollout without tools is the model's throughout
        return r.completion_mask if r.tool_mask is None else r.tool_mask

    return Rollout(
        prompt_ids=stacked("prompt_ids", P, pad_token_id, left=True),  # [sum N*G, P]
        prompt_mask=stacked("prompt_mask", P, 0, left=True),
        completion_ids=stacked("completion_ids", T, pad_token_id, left=False),  # [sum N*G, T]
        completion_mask=stacked("completion_mask", T, 0, left=False),
        truncated=torch.cat([r.truncated for r in rollouts]),
        sampler_logprobs=stacked("sampler_logprobs", T, 0, left=False) if sampled else None,
        tool_mask=torch.cat([_pad_columns(tool_mask(r), T, 0, False) for r in rollouts])
        if with_tools
        else None,
    )


@dataclass
class ScoredGroups:
    """The groups of one generation round (or several, stacked) with their rewards: what an update needs."""

    prompts: list  # N prompts
    rollout: Rollout  # N*G rows, prompt i's group in rows i*G .. i*G+G-1
    completions: list[str]  # N*G decoded completions
    rewards_per_func: Tensor  # [N*G, F]
    rewards: Tensor  # [N*G] weighted total
    num_generations: int
    # The policy that sampled them: the optimizer steps taken before. The update compares it with its own to
    # know whether the policy it starts from is the one that sampled (`core/update.py`).
    policy_version: int = 0

    def __len__(self) -> int:
        return len(self.prompts)

    def select(self, groups: Tensor) -> ScoredGroups:
        """The groups at the indices `groups` (1-D), in that order."""
        G = self.num_generations
        groups = groups.to(self.rewards.device)
        rows = (groups[:, None] * G + torch.arange(G, device=groups.device)).reshape(-1)  # [n*G]
        return ScoredGroups(
            prompts=[self.prompts[i] for i in groups.tolist()],
            rollout=self.rollout.select(rows),
            completions=[self.completions[i] for i in rows.tolist()],
            rewards_per_func=self.rewards_per_func[rows],
            rewards=self.rewards[rows],
            num_generations=G,
            policy_version=self.policy_version,
        )

    @staticmethod
    def cat(parts: list[ScoredGroups], pad_token_id: int) -> ScoredGroups:
        """The groups of `parts`, in order; their policy version the oldest of theirs, so that an update
        never takes groups of an older policy for the current one's."""
        parts = [p for p in parts if len(p)] or parts[:1]
        return ScoredGroups(
            prompts=[prompt for p in parts for prompt in p.prompts],
            rollout=cat_rollouts([p.rollout for p in parts], pad_token_id),
            completions=[text for p in parts for text in p.completions],
            rewards_per_func=torch.cat([p.rewards_per_func for p in parts]),
            rewards=torch.cat([p.rewards for p in parts]),
            num_generations=parts[0].num_generations,
            policy_version=min(p.policy_version for p in parts),
        )


@dataclass
class Trajectory:
    """A rollout with everything the GRPO loss and the logs need, rows as in the rollout (`[B]` = N*G)."""

    prompts: list  # N prompts
    rollout: Rollout  # prompt and completion ids and masks, [B, P] / [B, T]
    completions: list[str]  # B decoded completions
    loss_mask: Tensor  # [B, T] float: the completion tokens the loss counts
    old_logprobs: Tensor | None  # [B, T] the ratio's anchor, where the update needs one (`core/update.py`)
    ref_logprobs: Tensor | None  # [B, T] reference's, when beta > 0
    rewards_per_func: Tensor  # [B, F] what each reward function gave (NaN: no opinion)
    rewards: Tensor  # [B] weighted total of the reward functions
    advantages: Tensor  # [B] group-relative advantages of the outcome
    token_advantages: Tensor  # [B], or [B, T] with step credit
    num_generations: int
    policy_version: int = 0  # the groups' (`ScoredGroups.policy_version`)
    stats: dict[str, Tensor] = field(default_factory=dict)  # logged with the loss's

    @property
    def completion_ids(self) -> Tensor:  # [B, T]
        return self.rollout.completion_ids

    @property
    def completion_mask(self) -> Tensor:  # [B, T]
        return self.rollout.completion_mask

    def select(self, rows: Tensor, trim: bool = False) -> Trajectory:
        """The trajectory of `rows` alone (e.g. a mini-batch's groups, `update.group_rows`), advantages
        as computed over the whole rollout. `trim`: padded only to the rows' own longest prompt and
        completion (`Rollout.select`), the `[b, T]` tensors cut to the same columns; the loss is the same,
        as the columns dropped are padding in every row."""
        rows = rows.to(self.rewards.device)
        rollout = self.rollout.select(rows, trim)
        T = rollout.completion_ids.size(1)

        def cut(tensor: Tensor | None) -> Tensor | None:  # [B, T] or [B] -> [b, T'] or [b]
            if tensor is None:
                return None
            return tensor[rows, :T] if tensor.dim() == 2 else tensor[rows]

        G = self.num_generations
        groups = dict.fromkeys(int(r) // G for r in rows)  # in the rows' order
        return Trajectory(
            prompts=[self.prompts[g] for g in groups],
            rollout=rollout,
            completions=[self.completions[int(r)] for r in rows],
            loss_mask=cut(self.loss_mask),
            old_logprobs=cut(self.old_logprobs),
            ref_logprobs=cut(self.ref_logprobs),
            rewards_per_func=self.rewards_per_func[rows],
            rewards=self.rewards[rows],
            advantages=self.advantages[rows],
            token_advantages=cut(self.token_advantages),
            num_generations=G,
            policy_version=self.policy_version,
            stats=self.stats,
        )
