"""Deprecated: the callbacks moved to files named after what they do (evaluation, monitoring, audit, export;
`stop_token_ids` to sampling). Their old paths, `grpo_lightning.callbacks.<name>` in Python and as a
`class_path` in YAML, still resolve, with a `FutureWarning` naming the new path, until 0.3.0.
"""

from grpo_lightning._compat import moved_names

__getattr__ = moved_names(
    __name__,
    {
        "GSM8KAccuracyCallback": "grpo_lightning.training.evaluation",
        "ValidationResultsWriter": "grpo_lightning.training.evaluation",
        "generate_answers": "grpo_lightning.training.evaluation",
        "CollapseMonitor": "grpo_lightning.training.monitoring",
        "CompletionsPanel": "grpo_lightning.training.monitoring",
        "RolloutRecord": "grpo_lightning.training.monitoring",
        "completions_table": "grpo_lightning.training.monitoring",
        "logging_step": "grpo_lightning.training.monitoring",
        "prompt_text": "grpo_lightning.training.monitoring",
        "AUDIT_CASES": "grpo_lightning.core.audit",
        "AuditReport": "grpo_lightning.core.audit",
        "RewardAuditCallback": "grpo_lightning.training.audit_callback",
        "audit_module_rewards": "grpo_lightning.core.audit",
        "audit_reward_funcs": "grpo_lightning.core.audit",
        "auditable": "grpo_lightning.core.audit",
        "ExportBestCallback": "grpo_lightning.io.export",
        "stop_token_ids": "grpo_lightning.core.sampling",
    },
)
