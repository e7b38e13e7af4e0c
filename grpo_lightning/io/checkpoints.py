"""Checkpoint files: what `load_from_checkpoint(ckpt)` needs with no arguments, in plain Python values that
`torch.load(weights_only=True)` reads without importing grpo-lightning (`portable_hparams`); written whole or
not at all (`AtomicCheckpointIO`).

The module's hyper-parameters hold the policy and tokenizer as their paths or hub ids, the reward functions as
import paths ("package.module.function"), and the option dataclasses as dicts. `GRPOModule` accepts each of
these forms back, so `GRPOModule.load_from_checkpoint(ckpt)` rebuilds the run's module; a reward function
without an import path (a lambda, a function defined inside another) is stored as None and must be passed
again (`load_from_checkpoint(ckpt, reward_funcs=[...])`). Loading imports the functions a checkpoint names:
load checkpoints you trust, as for any code you run.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from grpo_lightning.core.config import GRPOConfig, plain_options
from grpo_lightning.core.types import Rollout, ScoredGroups
from grpo_lightning.io.models import LoraOptions, ModelOptions

__all__ = [
    "AtomicCheckpointIO",
    "as_options",
    "comparable_hparams",
    "import_object",
    "import_path",
    "portable_hparams",
    "register_safe_globals",
    "resolve_callable",
]
OPTION_KEYS = ("grpo", "model_options", "lora")  # GRPOModule's option dataclasses, stored as dicts


def import_object(path: str) -> Any:
    """The object a dotted import path names: `"package.module.function"` or `"package.module.Class.attr"`."""
    parts = path.split(".")
    for split in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:split])
        try:
            found = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name is not None and module_name.startswith(err.name):
                continue  # not a module: try a shorter prefix
            raise
        try:
            for attr in parts[split:]:
                found = getattr(found, attr)
        except AttributeError:
            break
        return found
    raise ValueError(f"{path!r} is not an importable name (package.module.name)")


def import_path(obj: object) -> str | None:
    """The dotted path that imports `obj` back, or None where there is none (a lambda, a function defined
    inside another, an object built at run time)."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or "<" in qualname:
        return None
    try:
        found = import_object(f"{module}.{qualname}")
    except (ImportError, ValueError):
        return None
    return f"{module}.{qualname}" if found is obj else None


def resolve_callable(value: Callable | str | None, option: str) -> Callable:
    """A reward function given as itself or as its import path (what a checkpoint stores); None, which a
    checkpoint stores for a function it could not name, is refused naming the option."""
    if value is None:
        raise ValueError(
            f"{option} is None: the checkpoint could not name this function (a lambda, or one defined inside "
            f"another function, has no import path): pass it again, e.g. load_from_checkpoint(ckpt, "
            f"{option.split('[')[0]}=...)"
        )
    if isinstance(value, str):
        try:
            found = import_object(value)
        except ImportError as err:
            raise ValueError(f"{option}={value!r}: cannot import it ({err})") from None
        except ValueError as err:
            raise ValueError(f"{option}={value!r}: {err}") from None
        if not callable(found):
            raise ValueError(f"{option}={value!r} names a {type(found).__name__}, not a function")
        return found
    return value


def _recipe(value: object) -> object:
    """A reward function as the config or checkpoint names it: an import path, a config's `class_path`
    mapping as it is, None for one without a name."""
    if value is None or isinstance(value, str | MutableMapping):
        return value
    return import_path(value)


def _source(value: object) -> str | None:
    """A policy or tokenizer as the path or hub id it loads from (`name_or_path`), None if it has none."""
    if value is None or isinstance(value, str):
        return value
    return getattr(value, "name_or_path", None) or None


def portable_hparams(hparams: MutableMapping, policy: object, tokenizer: object) -> None:
    """Make a `GRPOModule`'s hyper-parameters what `load_from_checkpoint(ckpt)` needs, as plain values:
    the policy and tokenizer as their sources, the reward functions as import paths, the option
    dataclasses as dicts (in place)."""
    hparams["policy"] = _source(policy)
    hparams["tokenizer"] = _source(tokenizer)
    if hparams.get("reward_funcs") is not None:
        hparams["reward_funcs"] = [_recipe(fn) for fn in hparams["reward_funcs"]]
    hparams["val_reward"] = _recipe(hparams.get("val_reward"))
    for key in OPTION_KEYS:
        if key in hparams:
            hparams[key] = plain_options(hparams[key])


def as_options(
    grpo: GRPOConfig | Mapping, model_options: ModelOptions | Mapping, lora: LoraOptions | Mapping | None
) -> tuple[GRPOConfig, ModelOptions, LoraOptions | None]:
    """`GRPOModule`'s option dataclasses, given as themselves or as the dicts a checkpoint stores."""

    def build(cls: type, value: object) -> object:
        return cls(**value) if isinstance(value, Mapping) else value

    return build(GRPOConfig, grpo), build(ModelOptions, model_options), build(LoraOptions, lora)


def comparable_hparams(hparams: MutableMapping) -> dict:
    """`hparams` with reward functions and options in the plain form a checkpoint stores, for comparing a
    checkpoint's options with a module's or a config's."""
    plain = dict(hparams)
    if isinstance(plain.get("reward_funcs"), list):
        plain["reward_funcs"] = [_recipe(fn) for fn in plain["reward_funcs"]]
    if "val_reward" in plain:
        plain["val_reward"] = _recipe(plain["val_reward"])
    return plain


def register_safe_globals() -> None:
    """Allow `torch.load(weights_only=True)` to rebuild the dataclasses that our checkpoints hold: the
    options in `hyper_parameters`, and dynamic sampling's buffered groups.

    `Trainer.fit(ckpt_path=...)` leaves `weights_only` to `torch.load`, whose default became True in
    PyTorch 2.6: without this, our own checkpoints would not load for resuming.
    """
    torch.serialization.add_safe_globals([GRPOConfig, ModelOptions, LoraOptions, ScoredGroups, Rollout])


class AtomicCheckpointIO(TorchCheckpointIO):
    """`TorchCheckpointIO` whose checkpoint files appear complete or not at all.

    The checkpoint is written to a temporary file beside the target, flushed to disk, then renamed over it
    (a rename within one folder is atomic); on any failure the temporary file is removed and the target, if
    it existed, is left as it was. Lightning's own write goes through the system's temporary folder and
    `shutil.move`, which copies when that folder is on another filesystem: a full disk then leaves a
    truncated (or empty) `.ckpt` behind. Remote paths (`s3://...`) keep Lightning's write.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        path = str(path)
        if "://" in path or storage_options is not None:
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        folder = os.path.dirname(path) or "."
        os.makedirs(folder, exist_ok=True)
        temporary = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.tmp")
        # Serialised in memory first (as Lightning does): a failed write is then the file's OSError, not
        # the error torch's zip writer raises when its file stops taking bytes.
        serialised = io.BytesIO()
        torch.save(checkpoint, serialised)
        try:
            with open(temporary, "wb") as f:
                f.write(serialised.getbuffer())
                f.flush()
                os.fsync(f.fileno())
            os.replace(temporary, path)
        except BaseException as err:
            with contextlib.suppress(FileNotFoundError):
                os.remove(temporary)
            if isinstance(err, OSError):
                message = (
                    f"could not write the checkpoint {path} ({err.strerror or err}); no partial file left"
                )
                raise OSError(err.errno, message) from err
            raise
