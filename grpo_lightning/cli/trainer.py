"""`GRPOTrainer`: the command line's Trainer, whose methods LightningCLI maps to its subcommands:
Lightning's four, refusing data that gives them no batch, and `audit` and `export`.
"""

from __future__ import annotations

import os

from lightning.pytorch import Trainer

from grpo_lightning.core.rewards.audit import AuditReport, audit_module_rewards
from grpo_lightning.io.export import export_policy
from grpo_lightning.io.hub_push import check_repo_id, push_folder
from grpo_lightning.training.callbacks.run_folder import version_checkpoint_folders
from grpo_lightning.training.data import PromptDataModule
from grpo_lightning.training.module import GRPOModule


class GRPOTrainer(Trainer):
    """A `Trainer` with `audit` and `export` methods: LightningCLI maps subcommands to Trainer methods.

    `fit`, `validate`, `test` and `predict` refuse data that gives them no batch, which Lightning only warns
    about before returning as if it had run.
    """

    def fit(self, model: GRPOModule, *args, new_data: bool = False, **kwargs) -> None:
        """Train with GRPO; `--ckpt_path last` resumes the run's newest checkpoint.

        Args:
            new_data: resuming (`ckpt_path`), train on this data from its beginning, whatever the
                checkpoint's data was; without it a resumed run continues the checkpoint's data where it
                stopped, and `cli.py fit` refuses data options that differ from the checkpoint's.
        """
        if new_data and kwargs.get("ckpt_path") is None:
            raise ValueError(
                "--new_data true continues a checkpoint's weights on this data, but no --ckpt_path is given: "
                "give the checkpoint, or drop --new_data to train from the policy's own weights"
            )
        kwargs.setdefault("weights_only", True)  # a checkpoint to resume from runs no code (Lightning: False)
        version_checkpoint_folders(self)  # without a logger: never another run's checkpoint folder
        self.new_data = new_data  # read by GRPOModule.on_load_checkpoint
        super().fit(model, *args, **kwargs)
        if self.fit_loop.max_batches == 0:
            raise ValueError(
                "fit: the training data gives no batch (an empty training split): nothing trained"
            )

    def validate(self, *args, **kwargs) -> list:
        """Score the validation rows (a checkpoint with `--ckpt_path`, else the untrained policy)."""
        kwargs.setdefault("weights_only", True)
        results = super().validate(*args, **kwargs)
        if sum(self.validate_loop.max_batches) == 0:
            raise ValueError(
                "validate: the validation data gives no batch (an empty validation split, or "
                "limit_val_batches 0): nothing evaluated"
            )
        return results

    def test(self, *args, **kwargs) -> list:
        """The validation's metrics on the test split and sets, as `test/...` (a checkpoint with
        `--ckpt_path`, else the untrained policy)."""
        kwargs.setdefault("weights_only", True)
        results = super().test(*args, **kwargs)
        if sum(self.test_loop.max_batches) == 0:
            raise ValueError(
                "test: the test data gives no batch (an empty test split, or limit_test_batches 0): nothing "
                "evaluated"
            )
        return results

    def predict(self, *args, **kwargs) -> list | None:
        """The policy's answers to the test split's prompts (`--results.path` writes them)."""
        kwargs.setdefault("weights_only", True)
        predictions = super().predict(*args, **kwargs)
        if sum(self.predict_loop.max_batches) == 0:
            raise ValueError("predict: the data gives no batch (an empty test split): nothing answered")
        return predictions

    def audit(self, model: GRPOModule, datamodule: PromptDataModule, num_rows: int = 300) -> AuditReport:
        """Audit the reward functions on reference solutions and corrupted copies of them.

        Args:
            num_rows: training rows audited. Default 300.
        """
        datamodule.setup("fit")
        report = audit_module_rewards(model, datamodule.train_rows[:num_rows])
        print(report.table())
        if not report.perfect:
            raise SystemExit(1)
        return report

    def export(
        self,
        model: GRPOModule,
        ckpt_path: str,
        out: str | None = None,
        merge_lora: bool = True,
        overwrite: bool = False,
        push_to_hub: str | None = None,
        private: bool = False,
        datamodule: object = None,
    ) -> str:
        """Export a checkpoint's policy and tokenizer with `save_pretrained`.

        Args:
            ckpt_path: the Lightning checkpoint (e.g. ModelCheckpoint's best), or "last": the run's newest.
            out: the folder to write; not the policy's own. Default: beside the checkpoint, its name with
                `-hf` (`checkpoints/last.ckpt` -> `checkpoints/last-hf`).
            merge_lora: merge a LoRA adapter into the weights (True) or save the adapter alone (False).
            overwrite: replace an earlier export in `out` whole (True); default False refuses a non-empty
                `out`. A folder that is not an earlier export is refused either way.
            push_to_hub: a Hub model repo ("org/name") to upload the exported folder to, created if
                missing; the token is huggingface_hub's (HF_TOKEN, or `hf auth login`). A failed push leaves
                the folder. Also spelled `--push-to-hub`.
            private: create the repo private (a repo that exists keeps its visibility).
            datamodule: unused; LightningCLI hands every subcommand the config's data module.
        """
        out = out or os.path.splitext(os.path.normpath(ckpt_path))[0] + "-hf"
        if push_to_hub is not None:
            check_repo_id(push_to_hub)  # before the export
        export_policy(model, out, ckpt_path=ckpt_path, merge_lora=merge_lora, overwrite=overwrite)
        print(
            f"exported {ckpt_path} to {out} ({', '.join(sorted(os.listdir(out)))}); load it with "
            f"AutoModelForCausalLM.from_pretrained({out!r}), or train from it with --model.policy {out}"
        )
        if push_to_hub is not None:
            print(f"pushed {out} to {push_to_hub}: {push_folder(out, push_to_hub, private)}")
        return out
