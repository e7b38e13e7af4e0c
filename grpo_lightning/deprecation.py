"""Old import paths of names that moved to another file, kept working with a `FutureWarning` for one
release: class paths in YAML configs are public API. A `FutureWarning`, not a `DeprecationWarning`: Python
hides the latter outside `__main__`, so a user whose YAML names an old path would never see it."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable


def moved_names(old_module: str, new_homes: dict[str, str]) -> Callable[[str], object]:
    """A module-level `__getattr__` for `old_module`: each name of `new_homes` (`{name: new module}`) comes
    from its new module, with a `FutureWarning` naming the new path; any other name is missing."""

    def __getattr__(name: str) -> object:
        if name not in new_homes:
            raise AttributeError(f"module {old_module!r} has no attribute {name!r}")
        new_path = f"{new_homes[name]}.{name}"
        warnings.warn(
            f"{old_module}.{name} moved to {new_path}; the old path will be removed in the next release",
            FutureWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(new_homes[name]), name)

    return __getattr__
