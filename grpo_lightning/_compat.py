"""Old import paths, kept working with a `FutureWarning` until release 0.3.0, all from this one file.

- Whole modules (0.1.0's flat layout, before the core / training / io layers): `OLD_MODULES` maps each old
  module path to its new one. `install()` (run by `grpo_lightning/__init__.py`) adds an import hook that
  makes the old path the very same module object as the new one: `import grpo_lightning.data`,
  `from grpo_lightning.module import GRPOModule`, a YAML `class_path: grpo_lightning.data.PromptDataModule`
  and a checkpoint pickled under the old path all work, and the first import says where the module went.
- Single names that moved to another module (`moved_names`): a module-level `__getattr__` for the old
  module.

A `FutureWarning`, not a `DeprecationWarning`: Python hides the latter outside `__main__`, so a user whose
YAML names an old path would never see it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from collections.abc import Callable
from types import ModuleType

REMOVED_IN = "0.3.0"  # the release that drops every old path listed here

_LAYERS = {
    "core": [
        "audit", "config", "credit", "dynamic_sampling", "loss", "metrics", "options", "rewards", "rng",
        "rollout", "sampling", "scoring", "shared_prompt", "step_metrics", "steps", "trajectory", "update",
    ],
    "training": [
        "audit_callback", "data", "evaluation", "module", "monitoring", "preflight", "resume",
        "training_state",
    ],
    "io": ["checkpoints", "distributed", "export", "models", "smollm2", "tiny"],
}  # fmt: skip
OLD_MODULES = {
    f"grpo_lightning.{name}": f"grpo_lightning.{layer}.{name}"
    for layer, names in _LAYERS.items()
    for name in names
}


def _warn_moved(old_path: str, new_path: str, stacklevel: int) -> None:
    warnings.warn(
        f"{old_path} moved to {new_path}; the old path will be removed in {REMOVED_IN}",
        FutureWarning,
        stacklevel=stacklevel + 1,
    )


def moved_names(old_module: str, new_homes: dict[str, str]) -> Callable[[str], object]:
    """A module-level `__getattr__` for `old_module`: each name of `new_homes` (`{name: new module}`) comes
    from its new module, with a `FutureWarning` naming the new path; any other name is missing."""

    def __getattr__(name: str) -> object:
        if name not in new_homes:
            raise AttributeError(f"module {old_module!r} has no attribute {name!r}")
        _warn_moved(f"{old_module}.{name}", f"{new_homes[name]}.{name}", stacklevel=2)
        return getattr(importlib.import_module(new_homes[name]), name)

    return __getattr__


class _ModuleAlias(importlib.abc.Loader):
    """Loads an old module path as the module at its new path (the same object)."""

    def __init__(self, new_path: str) -> None:
        self.new_path = new_path

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        _warn_moved(spec.name, self.new_path, stacklevel=2)
        return importlib.import_module(self.new_path)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the new module ran when it was imported."""


class _OldPathFinder(importlib.abc.MetaPathFinder):
    """Finds the old module paths of `OLD_MODULES`; after the regular finders, so real files always win."""

    def find_spec(
        self, fullname: str, path: object, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        new_path = OLD_MODULES.get(fullname)
        return None if new_path is None else importlib.util.spec_from_loader(fullname, _ModuleAlias(new_path))


def install() -> None:
    """Make the old module paths importable (once per process)."""
    # First: an editable install's finder would otherwise map an old path to a stale copy of its file.
    if not any(isinstance(finder, _OldPathFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _OldPathFinder())
