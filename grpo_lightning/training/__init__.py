"""The Lightning layer: `GRPOModule`, the data modules and the callbacks (`training.callbacks`), on top of
the core."""

from __future__ import annotations

import importlib
from types import ModuleType

# The callbacks' modules before they had a package of their own: a config's class path through one of them
# (`grpo_lightning.training.export_best.ExportBestCallback`) resolves in the package, which jsonargparse
# reads as this attribute once the module is not found.
_CALLBACK_MODULES = frozenset(
    {"audit_callback", "export_best", "monitors", "output_lock", "preflight", "run_folder"}
)


def __getattr__(name: str) -> ModuleType:
    if name not in _CALLBACK_MODULES:
        raise AttributeError(f"module 'grpo_lightning.training' has no attribute {name!r}")
    return importlib.import_module("grpo_lightning.training.callbacks")
