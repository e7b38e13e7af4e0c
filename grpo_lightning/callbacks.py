"""Deprecated: the callbacks moved to files named after what they do (evaluation, monitoring, audit, export;
`stop_token_ids` to sampling). Their old paths, `grpo_lightning.callbacks.<name>` in Python and as a
`class_path` in YAML, still resolve, with a `FutureWarning` naming the new path, until the next release.
"""

from grpo_lightning.deprecation import moved_names

__getattr__ = moved_names(
    __name__,
    {
        "GSM8KAccuracyCallback": "grpo_lightning.evaluation",
        "ValidationResultsWriter": "grpo_lightning.evaluation",
        "generate_answers": "grpo_lightning.evaluation",
        "CollapseMonitor": "grpo_lightning.monitoring",
        "CompletionsPanel": "grpo_lightning.monitoring",
        "RolloutRecord": "grpo_lightning.monitoring",
        "completions_table": "grpo_lightning.monitoring",
        "logging_step": "grpo_lightning.monitoring",
        "prompt_text": "grpo_lightning.monitoring",
        "AUDIT_CASES": "grpo_lightning.audit",
        "AuditReport": "grpo_lightning.audit",
        "RewardAuditCallback": "grpo_lightning.audit_callback",
        "audit_module_rewards": "grpo_lightning.audit",
        "audit_reward_funcs": "grpo_lightning.audit",
        "auditable": "grpo_lightning.audit",
        "ExportBestCallback": "grpo_lightning.export",
        "stop_token_ids": "grpo_lightning.sampling",
    },
)
