"""Exporting a trained policy as a plain Hugging Face folder: `save_pretrained` model plus tokenizer.

The folder loads with `AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained`. A LoRA policy
is either merged into its base weights (a plain model) or saved as the adapter alone, which transformers
loads on top of the base model named in `adapter_config.json`. Any module works: it is only an object
holding the model and the tokenizer as attributes. `training.callbacks.ExportBestCallback` exports the best
checkpoint's policy this way at the end of `fit`.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping

from peft import PeftModel
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo_lightning.io.checkpoints import load_policy_weights
from grpo_lightning.io.files import OutputLock, replace_folder

__all__ = [
    "EXPORT_MARKER",
    "check_export_folder",
    "export_policy",
]


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

    The folder is written whole beside `out_dir` and then put in its place (`files.replace_folder`): it
    never holds a mix of two exports (a stale adapter beside new weights), and a kill or a failed export (a
    full disk: one `OSError` naming the folder) leaves what was there. While it is written, `<out_dir>.lock`
    names this process: a second export to the same folder meanwhile is refused (`files.OutputLock`). It is
    marked as an export (`EXPORT_MARKER`, listing what it wrote), so that `overwrite` can tell it from
    anything else.

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
    with OutputLock(out_dir, "export folder"):  # a second export to this folder meanwhile is refused
        return _export(
            source,
            out_dir,
            tokenizer,
            ckpt_path,
            merge_lora,
            model_attr,
            tokenizer_attr,
            overwrite,
            protected,
        )


def _export(
    source: object,
    out_dir: str,
    tokenizer: PreTrainedTokenizerBase | None,
    ckpt_path: str | None,
    merge_lora: bool,
    model_attr: str,
    tokenizer_attr: str,
    overwrite: bool,
    protected: Mapping[str, str | None] | None,
) -> str:
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

    replace_folder(out_dir, write, "the export")
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
