"""TRL recipes converted into this library's config: a library over `core` and `io`, beside `training/`
(neither imports the other), with no command line and nothing printed; `cli.py from-trl` is its front door.

`converter`: `convert`, the options always so here or with no counterpart, the table and the config's text;
`conversion`: one conversion's state and its rows; `model_rules`, `run_rules`, `output_rules`: the rules
of TRL's other options; `versions`: TRL's defaults by version; `recipes`: reading a recipe.
"""

from grpo_lightning.from_trl.converter import KNOWN, config_text, convert, table
from grpo_lightning.from_trl.recipes import Recipe, read_recipe

__all__ = ["KNOWN", "Recipe", "config_text", "convert", "read_recipe", "table"]
