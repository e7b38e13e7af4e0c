"""Checkpoint files: loadable with `torch.load(weights_only=True)` (`register_safe_globals`), and written
whole or not at all (`AtomicCheckpointIO`)."""

from __future__ import annotations

import contextlib
import io
import os
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.types import Rollout, ScoredGroups
from grpo_lightning.io.models import LoraOptions, ModelOptions

__all__ = ["AtomicCheckpointIO", "register_safe_globals"]


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
