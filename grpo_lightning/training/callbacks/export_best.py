"""`ExportBestCallback`: at the end of `fit`, the best checkpoint's policy exported as a plain Hugging Face
folder (`io.export.export_policy`)."""

from __future__ import annotations

import os
from operator import attrgetter

import lightning as L
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from grpo_lightning.io.distributed import is_sharded
from grpo_lightning.io.export import check_export_folder, export_policy, sources_of
from grpo_lightning.training.callbacks.output_lock import HoldsOutputLock


class ExportBestCallback(HoldsOutputLock):
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
            folder is refused when `fit` starts, before any training, and so is a folder that another run
            is to export to (`<out_dir>.lock` names it; this run's is held until it ends). Either way a
            folder that is not an earlier export, or that is or holds the policy's folder, this run's logs
            or checkpoints, or the working directory, is refused then (`check_export_folder`).
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
        if stage != "fit":
            return
        out_dir = self._out_dir(trainer)

        def check() -> None:  # before training, never after it
            check_export_folder(out_dir, self.overwrite, self._protected(trainer, pl_module))

        if trainer.is_global_zero:  # held until the run ends: another run exporting here is refused now
            self.hold_lock(out_dir, "export folder", check)
        else:
            check()

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        monitored = [c for c in trainer.checkpoint_callbacks if getattr(c, "monitor", None)]
        best = (monitored[0].best_model_path if monitored else "") or None
        if best is None:
            rank_zero_warn(
                "ExportBestCallback: no best checkpoint (no monitor, or no validation ran): "
                "exporting the final weights"
            )
        out_dir = self._out_dir(trainer)
        if is_sharded(attrgetter(self.model_attr)(pl_module)):
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
