"""Reference-model sync: the KL penalty's reference follows the policy slowly.

Every `every` optimizer steps the reference becomes `alpha * policy + (1 - alpha) * reference`, weight by
weight (the "soft update" of TR-DPO, Gorbatovski et al. 2024, arXiv:2404.09656; TRL's `sync_ref_model`).
After syncs with the policy snapshots p_1 .. p_k the reference is

    ref_k = (1 - alpha)^k ref_0 + sum_j alpha (1 - alpha)^(k - j) p_j.

Sharded with FSDP2, the reference and the policy are sharded alike (`distributed.shard_model` on the same
mesh), so each rank mixes its own shards: no collective, the same numbers as the whole tensors mixed.
Nothing here imports Lightning: the module says how many optimizer steps it has taken.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import torch
from torch import Tensor, nn

from grpo_lightning.core.options import Alias, AtLeastOne, Range, check_fields


def _local(tensor: Tensor) -> Tensor:
    """A DTensor's shard on this rank (FSDP2), any other tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


@torch.no_grad()
def mix_into_reference(reference: nn.Module, policy: nn.Module, alpha: float) -> None:
    """reference <- alpha * policy + (1 - alpha) * reference, in place, parameter by parameter."""
    policy_weights = dict(policy.named_parameters())
    reference_weights = dict(reference.named_parameters())
    if policy_weights.keys() != reference_weights.keys():
        missing = sorted(policy_weights.keys() ^ reference_weights.keys())
        raise ValueError(f"the reference and the policy have different weights, e.g. {missing[0]!r}")
    for name, weight in reference_weights.items():
        _local(weight).lerp_(_local(policy_weights[name]), alpha)  # w + alpha * (p - w)


class ReferenceSync:
    """Applies the syncs due after a number of optimizer steps, one per multiple of `every` passed.

    A sync is applied before the rollout that follows its step (the module calls `apply_due` at the start of
    each training step), so a checkpoint saved after that step holds the reference before the sync and
    `syncs_done`, and the resumed run applies it as the uninterrupted one does. Several multiples passed in
    one training step (`num_iterations` > `every`) are as many mixes with the same policy.
    """

    def __init__(self, every: int, alpha: float) -> None:
        self.every = every
        self.alpha = alpha
        self.syncs_done = 0

    def apply_due(self, reference: nn.Module, policy: nn.Module, optimizer_steps: int) -> int:
        """Mix `policy` into `reference` once per sync due after `optimizer_steps`; returns how many."""
        due = optimizer_steps // self.every - self.syncs_done
        for _ in range(due):
            mix_into_reference(reference, policy, self.alpha)
        self.syncs_done += max(due, 0)
        return max(due, 0)


@dataclass(frozen=True)
class ReferenceSyncOptions:
    """Reference sync (`GRPOConfig.reference_sync`, None: off; the flat switch `sync_ref_model: true` turns it
    on): move the reference towards the policy every `sync_steps` optimizer steps, reference <- alpha x
    policy + (1 - alpha) x reference (TR-DPO, Gorbatovski et al., arXiv:2404.09656). Needs beta > 0 (a
    reference to sync) and full fine-tuning (with LoRA the reference is the policy's own base weights). The
    reference is then stored in checkpoints. TRL: `sync_ref_model`.
    """

    mixup_alpha: Annotated[
        float, Range(">= 0, <= 1", why="the policy's share"), Alias("ref_model_mixup_alpha")
    ] = 0.6
    """The policy's weight alpha in each sync, in [0, 1]; 1 copies the policy. 0.6 is TRL's default. TRL:
    `ref_model_mixup_alpha`.
    """
    sync_steps: Annotated[AtLeastOne, Alias("ref_model_sync_steps")] = 512
    """Optimizer steps between syncs; each sync is applied before the next rollout. 512 is TRL's default.
    TRL: `ref_model_sync_steps`.
    """

    def __post_init__(self) -> None:
        check_fields(self)
