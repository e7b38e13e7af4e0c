"""One conversion of a TRL recipe into this library's config (`cli.py from-trl`): the recipe's options
beside TRL's defaults for those it leaves unset, the config built so far, and a row per option saying what
became of it. The rules that fill them are in `model_rules` (ModelConfig, ScriptArguments, open-r1's
additions), `run_rules` and `output_rules` (TrainingArguments); `converter` runs them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from grpo_lightning.core.config import FLAT_NAMES
from grpo_lightning.from_trl.versions import version_key

KINDS = ("mapped", "converted", "unsupported")
# Options holding credentials (`hub_token`, an API key): their value is never printed nor written.
SECRET = re.compile(r"(^|_)(hub_token|token_secret|api_key|password|secret)$")
HIDDEN = "<hidden>"


def grpo_key(flat: str) -> str:
    """The config key of `GRPOConfig`'s option `flat` (a flat name of `FLAT_NAMES`)."""
    return "model.grpo." + FLAT_NAMES[flat].key


@dataclass
class Row:
    """One recipe option (or TRL default the recipe leaves unset, `default_from` its source), what became of
    it (`kind`, one of KINDS), the options it set here (`ours`) and how, or what to do instead (`note`)."""

    key: str
    value: object
    kind: str
    ours: str
    note: str
    default_from: str | None = None


@dataclass
class Conversion:
    """A recipe being converted: its options with TRL's defaults beside (`values`), the config built so far
    (nested dicts, as `cli.py fit --config` reads them) and the rows written."""

    recipe: dict[str, object]
    defaults: dict[str, tuple[object, str]]
    version: str
    devices: int | None = None
    config: dict = field(default_factory=dict)
    rows: dict[str, Row] = field(default_factory=dict)
    needs: list[str] = field(default_factory=list)  # what the recipe does not say and a run needs

    @property
    def values(self) -> dict[str, object]:
        return {**{k: v for k, (v, _) in self.defaults.items()}, **self.recipe}

    def has(self, key: str) -> bool:
        return key in self.recipe or key in self.defaults

    def get(self, key: str, default: object = None) -> object:
        return self.values.get(key, default)

    def at_least(self, version: str) -> bool:
        return version_key(self.version) >= version_key(version)

    def put(self, dotted: str, value: object) -> str:
        """Set the config's option `dotted` ("model.grpo.kl.beta"); returns the key."""
        *parents, last = dotted.split(".")
        node = self.config
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
        return dotted

    def read(self, dotted: str, default: object = None) -> object:
        node: object = self.config
        for key in dotted.split("."):
            if not isinstance(node, dict) or key not in node:
                return default
            node = node[key]
        return node

    def row(self, key: str, kind: str, ours: str = "", note: str = "") -> None:
        """The row of `key` (once; a key the recipe and the defaults lack gets none)."""
        if self.has(key) and key not in self.rows:
            source = self.defaults[key][1] if key not in self.recipe else None
            value = HIDDEN if SECRET.search(key) and self.get(key) is not None else self.get(key)
            self.rows[key] = Row(key, value, kind, ours, note, source)


class Unsupported(Exception):
    """A value with no counterpart here; its message says what to do instead."""


Rule = Callable[[Conversion], None]


class Rules(list):
    """A group of rules, each with the options it converts (`keys`), in the order they run."""

    def __call__(self, *keys: str) -> Callable[[Rule], Rule]:
        """Register the decorated rule for the options `keys`: it runs when the recipe or TRL's defaults
        hold any of them, and writes each one's row."""

        def register(function: Rule) -> Rule:
            self.append((keys, function))
            return function

        return register

    @property
    def keys(self) -> set[str]:
        """Every option the rules convert."""
        return {key for keys, _ in self for key in keys}


def ratio_of_run(c: Conversion, value: float) -> int | None:
    """A `*_steps` value below 1, which transformers reads as a share of the run's optimizer steps, as
    steps (rounded up, as transformers does); None when the run's length is not known (no max_steps)."""
    max_steps = c.get("max_steps", -1)
    if not isinstance(max_steps, int) or max_steps <= 0:
        return None
    return max(1, math.ceil(value * max_steps))


def optimizer_steps_per_batch(c: Conversion) -> int:
    """The optimizer steps a training step makes in the config so far: num_iterations x
    steps_per_generation (Lightning's step counts, `val_check_interval`, count training steps)."""
    iterations = c.read(grpo_key("num_iterations")) or c.get("num_iterations", 1)
    return iterations * (c.read(grpo_key("steps_per_generation")) or 1)
