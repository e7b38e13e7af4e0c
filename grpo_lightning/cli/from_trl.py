"""`cli.py from-trl RECIPE [--trl-version V] [--devices N] [--out config.yaml]`: the command line around the
converter (`grpo_lightning.from_trl`): its arguments, the TRL version whose defaults apply, and where the
config and the table of what became of each option go.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

from grpo_lightning.from_trl.converter import config_text, convert, table
from grpo_lightning.from_trl.recipes import Recipe, read_recipe
from grpo_lightning.from_trl.versions import NEWEST_VERSION, checked_version, recipe_version, version_key
from grpo_lightning.io.files import write_atomically

USAGE = "cli.py from-trl RECIPE [--trl-version V] [--devices N] [--out config.yaml] [--overwrite]"
HELP = (
    "Convert a TRL recipe (a YAML of GRPOConfig, ModelConfig and ScriptArguments options, or a TRL script's "
    "command line) into a config for `cli.py fit --config`, with a table of what became of each option."
)


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ValueError(f"from-trl: {message} (usage: {USAGE})")


def _parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="cli.py from-trl", usage=USAGE, description=HELP)
    parser.add_argument("recipe", help="the TRL recipe: a YAML file, or a file holding a TRL command line")
    parser.add_argument(
        "--trl-version",
        help="the TRL version the recipe was written for, whose defaults fill what it leaves unset "
        f"(default: the version a `# trl==X.Y` comment in it names, else {NEWEST_VERSION}, the newest known)",
    )
    parser.add_argument(
        "--devices",
        type=int,
        help="the processes the recipe ran on (TRL's num_processes), also trainer.devices",
    )
    parser.add_argument("--out", help="write the config here (default: print it)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    return parser


def chosen_version(given: str | None, recipe: Recipe) -> tuple[str, str]:
    """The TRL version whose defaults apply, and a line saying where it came from."""
    if given:
        version, how = checked_version(given), "--trl-version"
    elif recipe_version(recipe.text):
        version, how = checked_version(recipe_version(recipe.text)), "named in the recipe"
    else:
        return NEWEST_VERSION, (
            f"TRL {NEWEST_VERSION}'s defaults (the newest known; give --trl-version for a recipe written for "
            "another, e.g. 0.18 for open-r1's)"
        )
    if version_key(version) > version_key(NEWEST_VERSION):
        how += f"; its defaults as of {NEWEST_VERSION}, the newest known"
    return version, f"TRL {version}'s defaults ({how})"


def main(argv: list[str]) -> None:
    """Run `from-trl`: the config to `--out` (or standard output) and the table to standard output (or
    standard error). Bad input raises ValueError with the one line `cli.main` prints."""
    args = _parser().parse_args(argv)
    if args.devices is not None and args.devices < 1:
        raise ValueError(f"from-trl --devices={args.devices}: must be >= 1")
    if args.out and os.path.exists(args.out) and os.path.exists(args.recipe):
        if os.path.samefile(args.out, args.recipe):  # also through a link or another spelling of the path
            raise ValueError(
                f"from-trl --out {args.out} is the recipe itself: give the converted config another file"
            )
    if args.out and os.path.exists(args.out) and not args.overwrite:
        raise ValueError(f"from-trl --out {args.out}: the file exists; add --overwrite to replace it")
    recipe = read_recipe(args.recipe)
    version, version_line = chosen_version(args.trl_version, recipe)
    conversion = convert(recipe, version, args.devices)
    if args.devices is not None:
        conversion.put("trainer.devices", args.devices)
    text = config_text(conversion, recipe, version)
    report = table(conversion, recipe, version_line)
    if args.out:
        write_atomically(args.out, text, "the converted config")
        print(report)
        print(f"wrote {args.out}: python cli.py fit --config {args.out}")
    else:
        print(report, file=sys.stderr)
        print(text, end="")
