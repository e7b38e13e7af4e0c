"""Exporting a trained policy as a plain Hugging Face folder: `save_pretrained` model plus tokenizer.

The folder loads with `AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained`. A LoRA policy
is either merged into its base weights (a plain model) or saved as the adapter alone, which transformers
loads on top of the base model named in `adapter_config.json`. Any module works: it is only an object
holding the model and the tokenizer as attributes (`resolve_attr` follows a dotted path to one).
`ExportBestCallback` exports the best checkpoint's policy this way at the end of `fit`.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import pickle
import shutil
import tempfile
from collections.abc import Callable, Mapping

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from peft import PeftModel
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo_lightning.io.checkpoints import register_safe_globals
from grpo_lightning.io.distributed import is_sharded

__all__ = [
    "EXPORT_MARKER",
    "ExportBestCallback",
    "check_export_folder",
    "export_policy",
    "load_policy_weights",
    "read_checkpoint",
    "resolve_attr",
]


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


def export_policy(
    source: object,
    out_dir: str,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    ckpt_path: str | None = None,
    merge_lora: bool = True,
    model_attr: str = "policy",
    tokenizer_attr: str = "tokenizer",
    overwrite: bool = False,
    protected: Mapping[str, str | None] | None = None,
) -> str:
    """Write the policy and its tokenizer to `out_dir` with `save_pretrained`; returns `out_dir`.

    The folder is written whole beside `out_dir` and then put in its place: it never holds a mix of two
    exports (a stale adapter beside new weights), and a failed export leaves what was there. It is marked
    as an export (`EXPORT_MARKER`, listing what it wrote), so that `overwrite` can tell it from anything else.

    Args:
        source: a `PreTrainedModel` / `PeftModel` (then pass `tokenizer`), or a module holding them at
            `model_attr` and `tokenizer_attr` (a `GRPOModule` whose policy has not loaded yet is loaded
            through its `configure_model`).
        out_dir: the folder to write; created if missing.
        tokenizer: the tokenizer to save; default the module's.
        ckpt_path: a Lightning checkpoint whose `<model_attr>.*` weights are loaded into the policy first
            (in place: the module then holds the checkpoint's weights).
        merge_lora: for a LoRA policy, save the merged weights (True) or only the adapter (False).
        overwrite: replace an earlier export in `out_dir` (whole). Default False: a non-empty `out_dir` is
            refused. Either way only an export's own folder is replaced (`check_export_folder`).
        protected: more paths `out_dir` must not hold or be, by what they are (e.g. a run's checkpoints);
            the folders the policy and the tokenizer were loaded from, `ckpt_path` and the working directory
            always are.
    """
    guarded = {**(protected or {}), "the checkpoint exported": ckpt_path}
    if isinstance(source, PreTrainedModel | PeftModel):
        model = source
    else:
        guarded |= sources_of(source, model_attr, tokenizer_attr)  # before the policy loads
        check_export_folder(out_dir, overwrite, guarded)
        if getattr(source, model_attr, None) is None and hasattr(source, "configure_model"):
            source.configure_model()
        model = getattr(source, model_attr)
        tokenizer = tokenizer or getattr(source, tokenizer_attr)
    if tokenizer is None:
        raise ValueError("pass the tokenizer along with a bare model: the export must be loadable on its own")
    guarded |= loaded_from(model, tokenizer)
    check_export_folder(out_dir, overwrite, guarded)
    if ckpt_path is not None:
        load_policy_weights(model, ckpt_path, prefix=model_attr + ".")
    if isinstance(model, PeftModel) and merge_lora:
        # merge_and_unload rewrites the modules in place: merge a copy, so the live policy keeps its adapter.
        model = copy.deepcopy(model).merge_and_unload()

    def write(folder: str) -> None:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        _mark_export(folder, ckpt_path, merge_lora)

    _write_folder(out_dir, write)
    return out_dir


# An export's folder holds this file: what the export wrote, so that `overwrite` replaces only such a folder,
# and only while it holds nothing else (a user's notes, a checkpoint moved there, another model).
EXPORT_MARKER = "grpo_lightning_export.json"


def loaded_from(model: object, tokenizer: object) -> dict[str, str | None]:
    """The folders the policy and its tokenizer were loaded from (`name_or_path`), by what they are."""
    return {
        "the folder the policy was loaded from": getattr(model, "name_or_path", None),
        "the folder the tokenizer was loaded from": getattr(tokenizer, "name_or_path", None),
    }


def sources_of(module: object, model_attr: str, tokenizer_attr: str) -> dict[str, str | None]:
    """`loaded_from` for a module's model and tokenizer; for a policy not loaded yet (`GRPOModule` loads in
    `configure_model`), the folder it will be loaded from (`policy_source`)."""
    model = getattr(module, model_attr, None)
    sources = loaded_from(model, getattr(module, tokenizer_attr, None))
    if model is None:
        sources["the folder the policy was loaded from"] = getattr(module, "policy_source", None)
    return sources


def _inside(path: str, folder: str) -> bool:
    """Whether `path` is `folder` or lies under it (real paths: links and `..` resolved)."""
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return os.path.commonpath([path, folder]) == folder


def _entries(folder: str) -> set[str]:
    """Every file and sub-folder under `folder`, as paths relative to it."""
    found = set()
    for parent, dirs, files in os.walk(folder):
        found.update(os.path.relpath(os.path.join(parent, name), folder) for name in dirs + files)
    return found


def _mark_export(folder: str, ckpt_path: str | None, merge_lora: bool) -> None:
    record = {
        "written_by": "grpo-lightning export",
        "checkpoint": ckpt_path,
        "merge_lora": merge_lora,
        "files": sorted(_entries(folder)),
    }
    with open(os.path.join(folder, EXPORT_MARKER), "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2)


def _not_written_by_export(folder: str) -> list[str]:
    """What `folder` holds that an earlier export did not write there: everything, without the marker."""
    entries = _entries(folder) - {EXPORT_MARKER}
    try:
        with open(os.path.join(folder, EXPORT_MARKER), encoding="utf-8") as f:
            written = set(json.load(f)["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return sorted(entries)
    return sorted(entries - written)


def check_export_folder(
    out_dir: str, overwrite: bool, protected: Mapping[str, str | None] | None = None
) -> None:
    """Refuse an export folder whose replacement would destroy anything that is not an earlier export.

    Refused whatever `overwrite` says: a file; the working directory or a folder above it; a folder that is,
    or holds, one of the `protected` paths (the folders the policy and tokenizer were loaded from, a
    checkpoint, a run's logs); a non-empty folder that no export wrote, or that holds anything an export
    did not write. A non-empty earlier export is replaced only with `overwrite`.
    """
    guarded = {"the working directory": os.getcwd(), **(protected or {})}
    for what, path in guarded.items():
        if path and _inside(path, out_dir):  # also a path not made yet: a run's checkpoints to come
            where = "is" if _inside(out_dir, path) else "holds"
            raise ValueError(
                f"export folder {out_dir!r} {where} {what} ({path}): an export replaces its folder whole; "
                "choose another folder"
            )
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"export folder {out_dir!r} is a file: choose a folder")
    if not os.path.isdir(out_dir) or not os.listdir(out_dir):
        return
    foreign = _not_written_by_export(out_dir)
    if foreign and not os.path.isfile(os.path.join(out_dir, EXPORT_MARKER)):
        raise ValueError(
            f"export folder {out_dir!r} holds {_some(foreign)} and no earlier export wrote it (it has no "
            f"{EXPORT_MARKER}): choose another folder; --overwrite replaces only an earlier export"
        )
    if foreign:
        raise ValueError(
            f"export folder {out_dir!r} holds {_some(foreign)}, which its earlier export did not write: move "
            "them out, or choose another folder"
        )
    if not overwrite:
        raise ValueError(
            f"export folder {out_dir!r} holds an earlier export: choose another folder, or replace it with "
            "--overwrite true (ExportBestCallback: overwrite: true)"
        )


def _some(names: list[str], shown: int = 3) -> str:
    """The first few of `names`, and how many more."""
    names = sorted(names)
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f"{names[:shown]}{more}"


def _write_folder(out_dir: str, write: Callable[[str], object]) -> None:
    """`write` into a new folder beside `out_dir`, then put it in `out_dir`'s place (the old one is removed
    after the swap); a failed write leaves `out_dir` as it was."""
    out_dir = os.path.abspath(out_dir)
    parent, name = os.path.split(out_dir)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{name}.partial-", dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)  # a folder as `mkdir` makes it (0755), not mkdtemp's private 0700
    try:
        write(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    retired = staging + ".replaced"
    if os.path.exists(out_dir):
        os.rename(out_dir, retired)
    os.rename(staging, out_dir)
    shutil.rmtree(retired, ignore_errors=True)


def resolve_attr(obj: object, path: str) -> object:
    """`getattr` along a dotted path: `"model.backbone"` -> `obj.model.backbone`."""
    for name in path.split("."):
        obj = getattr(obj, name)
    return obj


class ExportBestCallback(L.Callback):
    """At the end of `fit`, loads the best checkpoint's policy weights into the module (as
    `trainer.test(ckpt_path="best")` would) and exports them with `export_policy`: `save_pretrained` model and
    tokenizer in `out_dir`, loadable with `AutoModelForCausalLM.from_pretrained`.

    The best checkpoint is the `best_model_path` of the first `ModelCheckpoint` that monitors a metric (a
    run may also keep the latest weights with an unmonitored one); without one, or when no validation ran,
    the final weights are exported, with a warning. A sharded (FSDP) policy is not exported here: the
    warning gives the `grpo-lightning export` command that reads the checkpoint folder in one process.

    Args:
        out_dir: where to write. Default `<trainer.log_dir or default_root_dir>/export`.
        merge_lora: merge a LoRA adapter into the weights (a plain model) or save the adapter alone.
        model_attr / tokenizer_attr: where the module keeps the model and the tokenizer.
        overwrite: replace an earlier export in `out_dir` whole at the end. Default False: a non-empty
            folder is refused when `fit` starts, before any training. Either way a folder that is not an
            earlier export, or that is or holds the policy's folder, this run's logs or checkpoints, or the
            working directory, is refused then (`check_export_folder`).
    """

    def __init__(
        self,
        out_dir: str | None = None,
        merge_lora: bool = True,
        model_attr: str = "policy",
        tokenizer_attr: str = "tokenizer",
        overwrite: bool = False,
    ) -> None:
        self.out_dir = out_dir
        self.overwrite = overwrite
        self.merge_lora = merge_lora
        self.model_attr = model_attr
        self.tokenizer_attr = tokenizer_attr
        self.exported_from: str | None = None  # the checkpoint exported, None for the final weights

    def _out_dir(self, trainer: L.Trainer) -> str:
        return self.out_dir or os.path.join(trainer.log_dir or trainer.default_root_dir, "export")

    def _protected(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, str | None]:
        """What the export folder must not be or hold: where the model came from and this run's files."""
        protected = sources_of(pl_module, self.model_attr, self.tokenizer_attr)
        protected["the checkpoint this run resumes from"] = trainer.ckpt_path
        protected["this run's logs"] = trainer.log_dir if trainer.loggers else None
        if not trainer.loggers:
            protected["this run's checkpoints"] = os.path.join(trainer.default_root_dir, "checkpoints")
        for i, callback in enumerate(trainer.checkpoint_callbacks):
            protected[f"this run's checkpoints ({type(callback).__name__} {i})"] = callback.dirpath
        return protected

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":  # refused now rather than after training
            check_export_folder(self._out_dir(trainer), self.overwrite, self._protected(trainer, pl_module))

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        monitored = [c for c in trainer.checkpoint_callbacks if getattr(c, "monitor", None)]
        best = (monitored[0].best_model_path if monitored else "") or None
        if best is None:
            rank_zero_warn(
                "ExportBestCallback: no best checkpoint (no monitor, or no validation ran): "
                "exporting the final weights"
            )
        out_dir = self._out_dir(trainer)
        if is_sharded(resolve_attr(pl_module, self.model_attr)):
            # Each rank holds a shard: the export reads the checkpoint folder in one process instead.
            rank_zero_warn(
                "ExportBestCallback: the policy is sharded (FSDP), so nothing was exported; export in one "
                f"process: grpo-lightning export --config <this run's config> --ckpt_path "
                f"{best or '<a checkpoint>'} --out {out_dir}"
            )
            return
        if trainer.is_global_zero:
            export_policy(
                pl_module,
                out_dir,
                ckpt_path=best,
                merge_lora=self.merge_lora,
                model_attr=self.model_attr,
                tokenizer_attr=self.tokenizer_attr,
                overwrite=self.overwrite,
                protected=self._protected(trainer, pl_module),
            )
            rank_zero_info(f"exported {'the final weights' if best is None else best} to {out_dir}")
        self.exported_from = best
