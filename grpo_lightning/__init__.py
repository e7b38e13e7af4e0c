"""GRPO with verifiable rewards for Hugging Face causal LMs, the PyTorch Lightning way.

Three layers (README, "Layout"): `grpo_lightning.core` (pure maths, rewards, sampling and scoring; no
Lightning), `grpo_lightning.training` (the Lightning module, data modules and callbacks) and
`grpo_lightning.io` (models, checkpoint files, sharding, export). The names below are the public API; each
is imported on first use, so `import grpo_lightning` stays light.
"""

from __future__ import annotations

import importlib

__version__ = "0.2.0"

# {public name: the module that defines it}
_PUBLIC = {
    # the algorithm and its options
    "GRPOModule": "grpo_lightning.training.module",
    "GRPOConfig": "grpo_lightning.core.config",
    "ModelOptions": "grpo_lightning.io.models",
    "LoraOptions": "grpo_lightning.io.models",
    # data
    "PromptDataModule": "grpo_lightning.training.data",
    "GSM8KDataModule": "grpo_lightning.training.data",
    # rewards
    "accuracy_reward": "grpo_lightning.core.rewards.verifiable",
    "strict_accuracy_reward": "grpo_lightning.core.rewards.verifiable",
    "format_reward": "grpo_lightning.core.rewards.verifiable",
    "LengthPenalty": "grpo_lightning.core.rewards.verifiable",
    "step_reward": "grpo_lightning.core.rewards.steps",
    "audit_reward_funcs": "grpo_lightning.core.rewards.audit",
    # the loss and the trajectory it reads
    "grpo_loss": "grpo_lightning.core.algorithm.loss",
    "group_advantages": "grpo_lightning.core.algorithm.advantages",
    "kl_penalty": "grpo_lightning.core.algorithm.kl",
    "kl_in_reward": "grpo_lightning.core.algorithm.kl",
    "Trajectory": "grpo_lightning.core.types",
    "build_trajectory": "grpo_lightning.core.update",
    # rollouts
    "Rollout": "grpo_lightning.core.types",
    "RolloutEngine": "grpo_lightning.core.generation.engines",
    "EagerEngine": "grpo_lightning.core.generation.engines",
    "SamplingSettings": "grpo_lightning.core.generation.sampling",
    "PromptSampler": "grpo_lightning.core.generation.prompts",
    "LogProbScorer": "grpo_lightning.core.generation.scorer",
    # callbacks
    "GSM8KAccuracyCallback": "grpo_lightning.training.evaluation",
    "ValidationResultsWriter": "grpo_lightning.training.callbacks",
    "generate_answers": "grpo_lightning.training.evaluation",
    "CollapseMonitor": "grpo_lightning.training.callbacks",
    "CompletionsPanel": "grpo_lightning.training.callbacks",
    "Preflight": "grpo_lightning.training.callbacks",
    "RewardAuditCallback": "grpo_lightning.training.callbacks",
    "InterruptCheckpoint": "grpo_lightning.training.callbacks",
    "ExportBestCallback": "grpo_lightning.training.callbacks",
    "export_policy": "grpo_lightning.io.export",
}
__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str) -> object:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'grpo_lightning' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # imported once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
