"""The flat option names on the command line and in config files, filed into `GRPOConfig`'s sections before
jsonargparse reads them (`core.config.FLAT_NAMES`, derived from the sections' declarations).

`--model.grpo.beta 0.04` becomes `--model.grpo.kl.beta 0.04`, a switch such as
`--model.grpo.dynamic_sampling true` its section on (`{}`) or off (`null`), and a flat name takes TRL's
spellings of its values (`--model.grpo.scale_rewards false` is "none": the option's `TRLValues`). A
`--config` file whose `model.grpo` holds flat names (a TRL-style config, or a run's `config.yaml` written
before the options had sections) is passed on as its YAML text with the names filed
(`core.flat_names.sectioned`: a name given both ways is refused in one line, on the command line too).
Everything else is passed on as it is.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import yaml

from grpo_lightning.cli.config_checks import config_files
from grpo_lightning.core.config import FLAT_NAMES, GRPOConfig
from grpo_lightning.core.flat_names import FlatName, section_at, sectioned
from grpo_lightning.core.options import trl_value

PREFIX = "--model.grpo."
_TRUE, _FALSE = ("true", "True", "yes", "1"), ("false", "False", "no", "0")


def sectioned_argv(argv: Sequence[str]) -> list[str]:
    """`argv` with every flat `model.grpo` name, on the command line or in a `--config` file, by its section's
    key."""
    files = set(config_files(argv))
    result: list[str] = []
    args = list(argv)
    spelled: dict[str, str] = {}  # each section key given, by the name it was given as
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in ("--config", "-c") and i + 1 < len(args) and args[i + 1] in files:
            result += [arg, _sectioned_config(args[i + 1])]
            i += 2
            continue
        if arg.startswith("--config=") and arg.removeprefix("--config=") in files:
            result.append("--config=" + _sectioned_config(arg.removeprefix("--config=")))
            i += 1
            continue
        name, equals, value = arg.removeprefix(PREFIX).partition("=")
        entry = FLAT_NAMES.get(name) if arg.startswith(PREFIX) else None
        if entry is None or (entry.path == (name,) and not entry.switch):
            if arg.startswith(PREFIX) and name in _SECTION_KEYS:
                _given_once(spelled, _SECTION_KEYS[name], name)
            result.append(arg)
            i += 1
            continue
        _given_once(spelled, entry.key, name)
        if not equals:  # the value is the next word
            value = args[i + 1] if i + 1 < len(args) else ""
            i += 1
        i += 1
        _check_share(name, value)
        if entry.switch and value in _TRUE + _FALSE:
            result.append(f"{PREFIX}{entry.key}={'{}' if value in _TRUE else 'null'}")
        else:
            result.append(f"{PREFIX}{entry.key}={_ours(entry, value)}")
    return result


# Each option's section key ("kl.beta") by itself, so that one given under both names is found.
_SECTION_KEYS = {entry.key: entry.key for entry in FLAT_NAMES.values()}


def _given_once(spelled: dict[str, str], key: str, name: str) -> None:
    """Note that the option `key` was given as `name`; refused, as in a config file, where it was given
    under its other name too (a flat name and its section's key: the last would win in silence)."""
    other = spelled.setdefault(key, name)
    if other != name:
        first, second = sorted((other, name), key=lambda n: n == key)  # the flat name first
        raise ValueError(
            f"command line: model.grpo: {first} and {second} are one option, given twice: give one"
        )


# Counts that transformers reads as a share of the run below 1, and the option that takes the share here.
_SHARE_OPTIONS = {"warmup_steps": "warmup_ratio"}


def _check_share(name: str, typed: str) -> None:
    """Refuse a count given as a share of the run (`--model.grpo.warmup_steps 0.1`, transformers' way),
    naming the option that takes it here."""
    if name not in _SHARE_OPTIONS:
        return
    try:
        value = yaml.safe_load(typed)
    except yaml.YAMLError:
        return
    if isinstance(value, float) and 0 < value < 1:
        ratio = _SHARE_OPTIONS[name]
        raise ValueError(
            f"{PREFIX.removeprefix('--')}{name}={value!r}: a count of optimizer steps; for a share of the "
            f"run, as transformers reads {name} below 1, give --{PREFIX.removeprefix('--')}{ratio} {value!r}"
        )


def _ours(entry: FlatName, typed: str) -> str:
    """A value typed for a flat (TRL's) name, one of TRL's spellings made ours (`--model.grpo.scale_rewards
    false` is "none")."""
    try:
        value = yaml.safe_load(typed)
    except yaml.YAMLError:
        return typed
    ours, spelled = trl_value(section_at(GRPOConfig, entry.path), entry.path[-1], value)
    if not spelled:
        return typed
    return ours if isinstance(ours, str) else json.dumps(ours)


def _sectioned_config(path: str) -> str:
    """The config file at `path`, or its YAML text with its flat `model.grpo` names filed into sections
    where it has any."""
    try:
        with open(path, encoding="utf-8") as f:
            config = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return path  # jsonargparse reports a missing or broken file in its own words
    grpo = config.get("model", {}).get("grpo") if isinstance(config, dict) else None
    if not isinstance(grpo, dict) or not any(_is_flat(key) for key in grpo):
        return path
    config["model"]["grpo"] = sectioned(GRPOConfig, grpo, f"config {path}: model.grpo")
    return yaml.safe_dump(config, sort_keys=False)


def _is_flat(key: str) -> bool:
    entry = FLAT_NAMES.get(key)
    return entry is not None and (entry.path != (key,) or entry.switch)
