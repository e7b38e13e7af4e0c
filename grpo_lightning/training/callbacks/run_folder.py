"""A run's own folder: its config saved beside its logs and checkpoints, and its latest checkpoint.

- `SaveRunConfig`: LightningCLI's `SaveConfigCallback`, at `fit`, writing `config.yaml` into the run's folder:
  the logger's version folder (`runs/<config>/tensorboard/version_0/config.yaml`, beside `checkpoints/`), or,
  without a logger, the checkpoint folder. `validate`, `export` and a resumed `fit` take it back with
  `--config` and nothing else: reward functions and callbacks are written as their import paths.
- `latest_checkpoint`: what `--ckpt_path last` means here: the newest checkpoint anywhere in the run's
  folders (`ModelCheckpoint`'s, `interrupted.ckpt`, a sharded checkpoint's folder), or a one-line error when
  the run has none, where Lightning would warn and train from scratch;
- `version_checkpoint_folders`: a run without a logger gets a checkpoint folder of its own
  (`checkpoints/version_N`), as a logger gives each run a version.
"""

from __future__ import annotations

import glob
import os

import lightning as L
from jsonargparse import Namespace
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.utilities import rank_zero_info

from grpo_lightning.training.callbacks.interrupt_checkpoint import InterruptCheckpoint
from grpo_lightning.training.callbacks.output_lock import HoldsOutputLock

__all__ = [
    "SaveRunConfig",
    "checkpoint_roots",
    "latest_checkpoint",
    "run_folder",
    "version_checkpoint_folders",
]


def run_folder(trainer: L.Trainer) -> str:
    """Where a run's logs, checkpoints and config go: the first logger's folder (a collective: every rank
    calls it), else the checkpoint folder, else `default_root_dir`."""
    if trainer.loggers:
        return trainer.log_dir
    for callback in trainer.callbacks:
        if isinstance(callback, ModelCheckpoint | InterruptCheckpoint) and callback.dirpath:
            return str(callback.dirpath)
    return trainer.default_root_dir


# Arguments of `Trainer.fit` itself, not of the run: left out, so that every subcommand takes the saved file.
FIT_ARGUMENTS = ("ckpt_path", "weights_only", "new_data")


class SaveRunConfig(SaveConfigCallback, HoldsOutputLock):
    """Writes the run's whole config (every default filled in, the seed drawn, options taken from a resumed
    checkpoint) to `config.yaml` in `run_folder` when `fit` starts; nothing for `validate` or `export`, which
    train nothing. `fit`'s own `ckpt_path`, `weights_only` and `new_data` are left out: `validate`,
    `export`, `audit` and `fit` all take the file. A folder that already holds a config (a logger given a
    fixed version), or that another run is writing (its `config.yaml.lock`, held until that run ends), is
    refused, unless this `fit` resumes a checkpoint in that folder: its own run, requeued (a scheduler gives
    the logger the same version again), whose config is written anew."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit" or self.already_saved:
            return
        folder = run_folder(trainer)
        path = os.path.join(folder, self.config_filename)
        refusal = None
        if trainer.is_global_zero:
            # Held until the run ends: two runs starting at once in one folder (both given version 0, or one
            # checkpoint dirpath) cannot both pass the check below and write their checkpoints together.
            try:
                self.hold_lock(path, "the run's config", lambda: self._check_unused(path))
            except ValueError as err:
                refusal = str(err)
        refusal = trainer.strategy.broadcast(refusal)
        if refusal is not None:  # every rank stops, not rank 0 alone
            raise ValueError(refusal)
        if trainer.is_global_zero:
            os.makedirs(folder, exist_ok=True)
            config = self.config.clone()
            for key in FIT_ARGUMENTS:
                config.pop(key, None)
            self.parser.save(
                config, path, skip_none=False, skip_check=True, overwrite=True, multifile=self.multifile
            )
            rank_zero_info(
                f"this run's config: {path} (cli.py validate --config {path} --ckpt_path <checkpoint>)"
            )
        self.already_saved = True

    def _check_unused(self, path: str) -> None:
        if os.path.exists(path) and not self.overwrite and not self._resumes_in(os.path.dirname(path)):
            raise ValueError(
                f"{path} exists: that folder holds another run's config (a logger with a fixed version, "
                "or a checkpoint dirpath shared by two runs); give this run a folder of its own"
            )

    def _resumes_in(self, folder: str) -> bool:
        """Whether this `fit` resumes a checkpoint that lies in `folder` (`--ckpt_path last` as resolved)."""
        ckpt_path = self.config.get("ckpt_path")
        if not ckpt_path:
            return False
        ckpt_path, folder = os.path.realpath(ckpt_path), os.path.realpath(folder)
        return os.path.commonpath([ckpt_path, folder]) == folder


def _as_list(value: object) -> list:
    return value if isinstance(value, list) else [value]


def _init_arg(value: object, key: str) -> object:
    """`init_args.<key>` of a class given in a config (`class_path` + `init_args`), else None."""
    if isinstance(value, dict):
        value = Namespace(value)
    if not isinstance(value, Namespace):
        return getattr(value, key, None)  # already built
    init_args = value.get("init_args")
    return init_args.get(key) if init_args is not None else None


def checkpoint_roots(trainer: Namespace) -> list[str]:
    """The folders that may hold a run's checkpoints, from its parsed `trainer` config: `default_root_dir`
    (without one, the `checkpoints` and `lightning_logs` folders Lightning writes in the working directory),
    each logger's `save_dir`, and each callback's own `dirpath`."""
    root = trainer.get("default_root_dir")
    roots = [str(root)] if root else [os.path.join(os.getcwd(), d) for d in ("checkpoints", "lightning_logs")]
    for logger in _as_list(trainer.get("logger")):
        save_dir = _init_arg(logger, "save_dir")
        if save_dir:
            roots.append(str(save_dir))
    for callback in _as_list(trainer.get("callbacks")):
        dirpath = _init_arg(callback, "dirpath")
        if dirpath:
            roots.append(str(dirpath))
    return list(dict.fromkeys(roots))


def _is_checkpoint(path: str) -> bool:
    return os.path.isfile(path) or os.path.isfile(os.path.join(path, ".metadata"))  # a sharded one's folder


def latest_checkpoint(roots: list[str]) -> str:
    """The most recently written checkpoint (`*.ckpt`, a file or a sharded folder) under any of `roots`;
    ValueError in one line when there is none."""
    found = {
        path
        for root in roots
        for path in glob.glob(os.path.join(glob.escape(root), "**", "*.ckpt"), recursive=True)
        if _is_checkpoint(path)
    }
    if not found:
        raise ValueError(
            f"--ckpt_path last: this run has no checkpoint yet (none under {', '.join(roots)}): start it "
            "without --ckpt_path, or give a checkpoint's path"
        )
    return max(found, key=os.path.getmtime)


def version_checkpoint_folders(trainer: L.Trainer) -> str | None:
    """Give a run without a logger a checkpoint folder of its own, `<default_root_dir>/checkpoints/version_N`
    with the first N not taken, as a logger gives each run a version: else every such run writes
    `<default_root_dir>/checkpoints/` and one run's `last.ckpt` or `interrupted.ckpt` replaces another's.

    Sets the folder on the Trainer's `ModelCheckpoint` and `InterruptCheckpoint` callbacks that name none
    (adding an `InterruptCheckpoint` when it has none) and returns it; None, changing nothing, with a logger.
    """
    if trainer.loggers:
        return None
    root = os.path.join(trainer.default_root_dir, "checkpoints")
    version = 0
    while os.path.exists(os.path.join(root, f"version_{version}")):
        version += 1
    folder = os.path.join(root, f"version_{version}")
    if not any(isinstance(c, InterruptCheckpoint) for c in trainer.callbacks):
        trainer.callbacks.append(InterruptCheckpoint())
    for callback in trainer.callbacks:
        if isinstance(callback, ModelCheckpoint | InterruptCheckpoint) and not callback.dirpath:
            callback.dirpath = folder
    return folder
