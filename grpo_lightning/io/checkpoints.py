"""Checkpoint files: what `load_from_checkpoint(ckpt)` needs with no arguments, in plain Python values that
`torch.load(weights_only=True)` reads without importing grpo-lightning (`portable_hparams`); written whole or
not at all (`AtomicCheckpointIO`); and read back: a checkpoint file or sharded folder checked and loaded onto
the CPU (`read_checkpoint`, `check_checkpoint_folder`), its policy weights checked against the model
(`check_fits`) and loaded (`load_policy_weights`).

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
import itertools
import os
import pickle
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.options import plain_options
from grpo_lightning.core.types import Rollout, ScoredGroups
from grpo_lightning.io.models import LoraOptions, ModelOptions

__all__ = [
    "AtomicCheckpointIO",
    "as_options",
    "comparable_hparams",
    "import_object",
    "import_path",
    "load_policy_weights",
    "portable_hparams",
    "read_checkpoint",
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


def resolve_rewards(
    reward_funcs: list[Callable | str] | None, val_reward: Callable | str | None
) -> tuple[list[Callable] | None, Callable | None]:
    """A module's `reward_funcs` and `val_reward` as functions (`resolve_callable`); None stays None (the
    defaults)."""
    if reward_funcs is not None:
        reward_funcs = [resolve_callable(fn, f"reward_funcs[{i}]") for i, fn in enumerate(reward_funcs)]
    return reward_funcs, None if val_reward is None else resolve_callable(val_reward, "val_reward")


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


def read_checkpoint(path: str, **load_kwargs) -> dict:
    """`torch.load` a Lightning checkpoint file onto the CPU; anything else raises one `ValueError` naming it.

    What `torch.load` raises for a truncated or foreign file (a zip or unpickling error, whose text may
    advise loading with `weights_only=False`) is replaced: never advise unsafe loading of an unknown file.
    """
    try:
        checkpoint = torch.load(path, map_location="cpu", **load_kwargs)
    except FileNotFoundError:
        raise  # its message names the file already
    except Exception as err:  # on damaged bytes torch.load raises zip, pickle, OS, index, ... errors
        # The library's own text is left out: it may advise weights_only=False, or describe zip internals.
        if isinstance(err, pickle.UnpicklingError) and "unsupported global" in str(err).lower():
            why = "it holds Python objects that safe loading refuses (not a checkpoint grpo-lightning wrote)"
        else:
            why = "truncated, corrupt or not a PyTorch checkpoint"
        raise ValueError(
            f"checkpoint {path!r} cannot be read: {why} ({type(err).__name__} in torch.load)"
        ) from err
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise ValueError(f"checkpoint {path!r} is not a Lightning checkpoint: it has no state_dict")
    return checkpoint


def load_policy_weights(model: torch.nn.Module, ckpt_path: str, prefix: str = "policy.") -> None:
    """Copy the weights under `prefix` in a Lightning checkpoint's `state_dict` into `model`, in place.

    `ckpt_path` is a checkpoint file, or the folder that a sharded strategy (FSDP2 through
    `ModelParallelStrategy`) writes: from a folder only the policy's tensors are read, in this one process,
    with no process group (no consolidated copy of the whole checkpoint, optimizer states included).
    Strict: the checkpoint must hold every weight of `model` and nothing else under `prefix`.
    """
    if os.path.isdir(ckpt_path):
        check_checkpoint_folder(ckpt_path)
        state = _sharded_checkpoint_weights(ckpt_path, prefix)
    else:
        # weights_only=True: a checkpoint handed to `export` cannot run code. Our option dataclasses in its
        # hyper-parameters are allow-listed, as for resuming.
        register_safe_globals()
        full = read_checkpoint(ckpt_path, weights_only=True)["state_dict"]
        state = {k.removeprefix(prefix): v for k, v in full.items() if k.startswith(prefix)}
    if not state:
        raise ValueError(f"checkpoint {ckpt_path!r}: no weights under {prefix!r} in its state_dict")
    named = {
        prefix + key: tensor for key, tensor in model.state_dict().items()
    }  # as the checkpoint names them
    check_fits(named, {prefix + key: tensor for key, tensor in state.items()}, ckpt_path)
    model.load_state_dict(state, strict=True)


def check_fits(
    expected: Mapping[str, torch.Tensor], given: Mapping[str, torch.Tensor], ckpt_path: str
) -> None:
    """Refuse a checkpoint whose weights do not fit the model, naming the first tensor of another shape (or
    the first one missing or extra) in one line, instead of `load_state_dict`'s dump of every mismatch."""
    shapes = (
        f"{key} has shape {list(tensor.shape)} in the checkpoint but {list(expected[key].shape)} here"
        for key, tensor in given.items()
        if key in expected and tuple(tensor.shape) != tuple(expected[key].shape)
    )
    missing = (f"it has no {key}" for key in expected if key not in given)
    extra = (f"it holds {key}, which this model lacks" for key in given if key not in expected)
    wrong = next(itertools.chain(shapes, missing, extra), None)
    if wrong is not None:
        raise ValueError(
            f"checkpoint {ckpt_path!r} does not fit this model: {wrong}; it was trained from another model "
            "or with other LoRA options: set model.policy and model.lora to the run's own"
        )


def check_checkpoint_folder(path: str) -> None:
    """A folder given as a checkpoint must be a sharded (distributed) checkpoint; an exported model folder is
    named as what it is."""
    if os.path.isfile(os.path.join(path, ".metadata")):
        return
    if any(os.path.isfile(os.path.join(path, name)) for name in ("config.json", "adapter_config.json")):
        raise ValueError(
            f"checkpoint {path!r} is a model folder (save_pretrained, as export writes), not a Lightning "
            f"checkpoint: use it as the policy (--model.policy {path}); a checkpoint is a .ckpt file or a "
            "sharded checkpoint's folder"
        )
    raise ValueError(
        f"checkpoint {path!r} is a folder without .metadata: not a sharded checkpoint; give a .ckpt file"
    )


def _sharded_checkpoint_weights(path: str, prefix: str) -> dict[str, torch.Tensor]:
    """The full tensors under `state_dict.<prefix>` of a distributed (DCP) checkpoint folder, on CPU."""
    from torch.distributed.checkpoint import FileSystemReader, TensorStorageMetadata, load

    reader = FileSystemReader(path)
    # DCP flattens the nested checkpoint dict: a weight is stored as "state_dict.policy.model.norm.weight".
    stored = reader.read_metadata().state_dict_metadata
    flat_prefix = "state_dict." + prefix
    weights = {
        key.removeprefix(flat_prefix): torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in stored.items()
        if key.startswith(flat_prefix) and isinstance(meta, TensorStorageMetadata)
    }
    load({"state_dict": {prefix + k: v for k, v in weights.items()}}, storage_reader=reader, no_dist=True)
    return weights
