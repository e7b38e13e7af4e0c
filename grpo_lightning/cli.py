"""`grpo-lightning fit|validate --config configs/....yaml`: LightningCLI over GRPOModule and GSM8KDataModule."""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI

from grpo_lightning.data import GSM8KDataModule
from grpo_lightning.module import GRPOModule


def build_cli(args: list[str] | None = None, run: bool = True) -> LightningCLI:
    # save_config_callback=None: the YAML already is the record, and reward callables do not round-trip.
    return LightningCLI(
        GRPOModule,
        GSM8KDataModule,
        args=args,
        run=run,
        save_config_callback=None,
        auto_configure_optimizers=False,
    )


def main() -> None:
    build_cli()


if __name__ == "__main__":
    main()
