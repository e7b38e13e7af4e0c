"""The callbacks of a GRPO run, one per file as in `lightning.pytorch.callbacks`: the monitors of each step
(`CompletionsPanel`, `CollapseMonitor`), the pre-flight block (`Preflight`), the checks before a fit
(`FitChecks`), the reward audit (`RewardAuditCallback`), the checkpoint of an interrupted run
(`InterruptCheckpoint`), the export of the best checkpoint (`ExportBestCallback`), the results of a
validation, test or predict run (`ValidationResultsWriter`), the run's own folder (`SaveRunConfig`), and
the lock a callback holds on its output (`HoldsOutputLock`).
"""

from grpo_lightning.training.callbacks.collapse_monitor import CollapseMonitor
from grpo_lightning.training.callbacks.completions_panel import CompletionsPanel
from grpo_lightning.training.callbacks.export_best import ExportBestCallback
from grpo_lightning.training.callbacks.fit_checks import FitChecks
from grpo_lightning.training.callbacks.interrupt_checkpoint import InterruptCheckpoint
from grpo_lightning.training.callbacks.output_lock import HoldsOutputLock
from grpo_lightning.training.callbacks.preflight import Preflight
from grpo_lightning.training.callbacks.results_writer import ValidationResultsWriter
from grpo_lightning.training.callbacks.reward_audit import RewardAuditCallback
from grpo_lightning.training.callbacks.run_folder import SaveRunConfig

__all__ = [
    "CollapseMonitor",
    "CompletionsPanel",
    "ExportBestCallback",
    "FitChecks",
    "HoldsOutputLock",
    "InterruptCheckpoint",
    "Preflight",
    "RewardAuditCallback",
    "SaveRunConfig",
    "ValidationResultsWriter",
]
