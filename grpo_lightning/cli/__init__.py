"""The command line: `grpo-lightning fit|validate|test|predict|audit|export|from-trl|prepare-smollm2`.

`commands`: the LightningCLI and `main`; `trainer`: the Trainer whose methods are its subcommands;
`config_checks`: what it checks before jsonargparse reads a config; `sections`: the flat (TRL) option
names filed into sections; `resume`: what a resumed run takes from its checkpoint. Above the layers: it
builds the module and the callbacks, and nothing below the module imports it.

`grpo_lightning.cli:main` is the `grpo-lightning` script, and `cli.py` at the root calls it.
"""

from grpo_lightning.cli.commands import EXIT_CTRL_C, EXIT_SIGTERM, GRPOCLI, build_cli, main
from grpo_lightning.cli.trainer import GRPOTrainer

__all__ = ["EXIT_CTRL_C", "EXIT_SIGTERM", "GRPOCLI", "GRPOTrainer", "build_cli", "main"]
