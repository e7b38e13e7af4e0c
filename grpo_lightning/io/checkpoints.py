"""Checkpoint files: written whole or not at all (`AtomicCheckpointIO`); read back: a checkpoint file or
sharded folder checked and loaded onto the CPU (`read_checkpoint`, `check_checkpoint_folder`, the
dataclasses it holds allowed by `register_safe_globals`), its policy weights checked against the model
(`check_fits`) and loaded (`load_policy_weights`). What its hyper-parameters hold: `io.hparams`.
"""

from __future__ import annotations

import io
import itertools
import os
import pickle
from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.types import Rollout, ScoredGroups
from grpo_lightning.io.files import write_atomically
from grpo_lightning.io.models import LoraOptions, ModelOptions

__all__ = [
    "AtomicCheckpointIO",
    "check_module_checkpoint",
    "load_policy_weights",
    "read_checkpoint",
    "register_safe_globals",
    "upgrade_scheduler_states",
]


def upgrade_scheduler_states(checkpoint: dict) -> None:
    """Schedulers' states written while the warm-up was torch's `LinearLR` (inside the `SequentialLR`), made
    the states of today's warm-up, transformers' `LambdaLR`: the same step counters, without `LinearLR`'s
    factors. The resumed run goes on from the same step, on today's rates."""
    for state in checkpoint.get("lr_schedulers", []):
        for part in state.get("_schedulers", []):
            if "lr_lambdas" not in part and "start_factor" in part:
                for factor in ("start_factor", "end_factor", "total_iters"):
                    part.pop(factor, None)
                part["lr_lambdas"] = [None]  # a plain function's: nothing to restore


def register_safe_globals() -> None:
    """Allow `torch.load(weights_only=True)` to rebuild the dataclasses that our checkpoints hold: the
    options in `hyper_parameters`, and dynamic sampling's buffered groups.

    `Trainer.fit(ckpt_path=...)` leaves `weights_only` to `torch.load`, whose default became True in
    PyTorch 2.6: without this, our own checkpoints would not load for resuming.
    """
    torch.serialization.add_safe_globals([GRPOConfig, ModelOptions, LoraOptions, ScoredGroups, Rollout])


class AtomicCheckpointIO(TorchCheckpointIO):
    """`TorchCheckpointIO` whose checkpoint files appear complete or not at all (`files.write_atomically`).

    The checkpoint is written to a temporary file beside the target, flushed to disk, then renamed over it
    (a rename within one folder is atomic): a kill leaves the earlier file of that name whole; on a failure
    the temporary file is removed and the target, if it existed, is left as it was. Lightning's own write
    goes through the system's temporary folder and `shutil.move`, which copies when that folder is on
    another filesystem: a full disk then leaves a truncated (or empty) `.ckpt` behind. Remote paths
    (`s3://...`) keep Lightning's write.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        path = str(path)
        if "://" in path or storage_options is not None:
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        # Serialised in memory first (as Lightning does): a failed write is then the file's OSError, not
        # the error torch's zip writer raises when its file stops taking bytes.
        serialised = io.BytesIO()
        torch.save(checkpoint, serialised)
        write_atomically(path, serialised.getbuffer(), "the checkpoint")


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


# What Lightning reads of every checkpoint it loads, and what resuming a `fit` reads besides (a
# `ModelCheckpoint(save_weights_only=True)` file holds neither optimizer nor scheduler states).
LOADED_KEYS = ("pytorch-lightning_version",)
RESUMED_KEYS = ("optimizer_states", "lr_schedulers")


def check_module_checkpoint(checkpoint: Mapping, path: str, resume: bool, prefix: str = "policy.") -> None:
    """Refuse, in one line naming what it lacks, a checkpoint that Lightning cannot load into a module whose
    weights are under `prefix` (`torch.save({"state_dict": {}})`), or, to `resume`, one without the
    optimizer and scheduler states; Lightning would stop with a `KeyError` traceback."""
    state = checkpoint.get("state_dict")
    foreign = [repr(key) for key in LOADED_KEYS if key not in checkpoint]
    if not isinstance(state, Mapping) or not any(str(key).startswith(prefix) for key in state):
        foreign.append(f"any weights under {prefix!r} in its state_dict")
    if foreign:
        raise ValueError(
            f"checkpoint {path!r} lacks {' and '.join(foreign)}: it is not a checkpoint of a GRPOModule's "
            "run; give a checkpoint that fit wrote (a ModelCheckpoint's .ckpt, interrupted.ckpt)"
        )
    weights_alone = [repr(key) for key in RESUMED_KEYS if key not in checkpoint]
    if resume and weights_alone:
        raise ValueError(
            f"checkpoint {path!r} lacks {' and '.join(weights_alone)}: it holds the weights alone "
            "(ModelCheckpoint's save_weights_only) and cannot resume a run; to train on from them, export "
            f"them (cli.py export --ckpt_path {path}) and start a new run with --model.policy <that folder>"
        )


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
