"""The CLI's config checks that come before jsonargparse's, and its reports made plain, one line each.

- `check_config_files`: every `--config` YAML holds a mapping of sections (an empty file is named), and
  each section (`model`, `data`, `trainer`, `model.grpo`, ...) a mapping, not a number or a list
  (jsonargparse would drop such a section and report an option as missing, or fail with a traceback);
- `plain_value_error`: jsonargparse's report of a value that no accepted type takes (`Does not validate
  against any of the Union subtypes ... Given value: inf`) as the key, the value and what it takes; where a
  class refused the value itself (its own `ValueError`), that message alone;
- `strategy_class_path`: `trainer.strategy` named by a `Strategy` class (`ModelParallelStrategy`, or its
  import path), which Lightning would take for an unknown strategy name, as the class path it is;
- `drop_switched_logger_kwargs`: a `trainer.logger` class switched on the command line (or by a later
  config) without the earlier class's `dict_kwargs`, which jsonargparse would hand the new class.
"""

from __future__ import annotations

import importlib
import inspect
import math
import os
import re
from collections.abc import Iterator, Sequence
from typing import Any

import yaml

# Sections of a config: where a YAML config holds a mapping, with what it holds the options of.
SECTIONS = {
    ("model",): "GRPOModule's options",
    ("data",): "the data module's options",
    ("trainer",): "the Trainer's options",
    ("model", "grpo"): "GRPOConfig options",
    ("model", "model_options"): "ModelOptions options",
    ("model", "lora"): "LoraOptions options",
}
_YAML_KINDS = {list: "a list", int: "an integer", float: "a number", bool: "a boolean", str: "a string"}


def config_files(argv: Sequence[str]) -> list[str]:
    """The files that `--config` / `-c` name in a command line."""
    files = []
    for i, arg in enumerate(argv):
        if arg in ("--config", "-c") and i + 1 < len(argv):
            files.append(argv[i + 1])
        elif arg.startswith("--config="):
            files.append(arg.removeprefix("--config="))
    return files


def check_config_files(argv: Sequence[str]) -> None:
    """Refuse a `--config` file whose sections are not mappings, naming the file and the section."""
    for path in config_files(argv):
        try:
            with open(path, encoding="utf-8") as f:
                config = yaml.safe_load(f)
        except (OSError, yaml.YAMLError):
            continue  # jsonargparse reports a missing or broken file in its own words
        if config is None:  # jsonargparse would say "Unexpected config:" and nothing more
            raise ValueError(
                f"config {path} is empty (or only comments): a config is a mapping of sections (model:, "
                "data:, trainer:)"
            )
        if not isinstance(config, dict):
            raise ValueError(
                f"config {path} holds {_YAML_KINDS.get(type(config), 'a value')}: a config is a mapping of "
                "sections (model:, data:, trainer:)"
            )
        for keys, owner in SECTIONS.items():
            value = config
            for key in keys:
                value = value.get(key) if isinstance(value, dict) else None
            # A string may be a file holding the section, or the data module's class path.
            if value is not None and not isinstance(value, dict | str):
                raise ValueError(
                    f"config {path}: {'.'.join(keys)} is {_YAML_KINDS.get(type(value), 'a value')} "
                    f"({value!r}): it must be a section, a mapping of {owner}"
                )


_SIMPLE = re.compile(
    r'^Parser key "(?P<key>[^"]+)": Expected a (?P<types><class \'[^\']+\'>)\. Got value: (?P<value>.*)$'
)
_UNION = re.compile(
    r'^(?:Parser key "(?P<key>[^"]+)": )?Does not validate against any of the Union subtypes '
    r"Subtypes: \[(?P<types>.*?)\] Errors:(?P<errors>.*?)"
    r"(?: Given value type: .*? Given value: (?P<value>.*))?$"
)
# A type of the Subtypes list: `list[str]`, `<class 'float'>`, or the base of `typing.Annotated[float, > 0]`.
_TYPE = re.compile(r"list\[(?:[\w.]+|dict\[[\w., ]+\])\]|<class '[\w.]+'>|(?<=Annotated\[)[\w.]+")
# What an item inside a list or mapping was checked against, and what it held (`None` where a YAML flow
# mapping split an unquoted text at a comma).
_INNER = re.compile(r"Expected a <class '(?P<type>[\w.]+)'>\. Got value: (?P<value>.*)")
# The errors jsonargparse writes of a type it tried; anything else is the class's own message.
_GENERIC = ("Expected a ", "Not a valid subclass", "Does not validate", "a class path", "a dict with")
_TYPE_WORDS = {"float": "a number", "int": "an integer", "bool": "true or false", "str": "a string"}


def _type_word(token: str, finite: bool) -> str:
    name = token.removeprefix("<class '").removesuffix("'>")
    if name.startswith("list["):
        return f"a list of {name[5:-1].rpartition('.')[2]}"
    if name == "NoneType":
        return "null"
    if name == "float" and finite:
        return "a finite number"
    return _TYPE_WORDS.get(name, f"a {name.rpartition('.')[2]} (a class path, or a mapping of its options)")


def _not_finite(value: str) -> bool:
    try:
        return not math.isfinite(float(value.strip("'\"")))
    except ValueError:
        return False


def plain_value_error(message: str) -> str:
    """A one-line jsonargparse message made plain (see the module's docstring); other messages as given."""
    if match := _SIMPLE.match(message):
        words = _type_word(match["types"], _not_finite(match["value"]))
        return f"{match['key']}={match['value']}: expected {words}"
    match = _UNION.match(message)
    if not match:
        return message
    errors = [error.strip() for error in re.split(r"(?:^| )- ", match["errors"])]
    own = [error for error in errors if error and not error.startswith(_GENERIC)]
    if own:  # the class's own complaint about the value
        return f"{match['key']}: {own[0]}" if match["key"] else own[0]
    value = match["value"]
    if value is not None:  # a union inside a union (an `Alias` around `X | None`) repeats the value
        value = value.rpartition("Given value: ")[2]
    tokens = [t for t in _TYPE.findall(match["types"]) if t not in ("typing.Optional", "typing.Union")]
    finite = value is not None and _not_finite(value)
    words = " or ".join(dict.fromkeys(_type_word(t, finite) for t in tokens))
    where = match["key"] or "a value"
    if value is not None:
        return f"{where}={value}: expected {words}"
    inner = next((m for m in map(_INNER.match, errors) if m), None)
    if inner is None:
        return f"{where}: expected {words}"
    return (
        f"{where}: expected {words}; an item inside holds {inner['value']}, not "
        f"{_type_word(inner['type'], False)} (in YAML, quote a text holding ', ' or ': ')"
    )


def strategy_class_path(strategy: object) -> str | None:
    """The class path of a `Strategy` subclass that `strategy` names (a Lightning strategy's class name, or
    an import path), where it is not one of Lightning's registered strategy names; else None."""
    from lightning.pytorch import strategies
    from lightning.pytorch.strategies import StrategyRegistry

    if not isinstance(strategy, str) or strategy in StrategyRegistry.available_strategies():
        return None
    module_name, _, name = strategy.rpartition(".")
    try:
        module = importlib.import_module(module_name) if module_name else strategies
    except ImportError:
        return None
    found = getattr(module, name, None)
    if isinstance(found, type) and issubclass(found, strategies.Strategy):
        return f"{found.__module__}.{found.__qualname__}"
    return None


LOGGER = "trainer.logger"


def _short(class_path: str) -> str:
    return class_path.rpartition(".")[2]


def _given_loggers(argv: Sequence[str]) -> Iterator[dict]:
    """The `trainer.logger` mappings (with a class path) that the `--config` files or YAML texts of `argv`,
    and its `--trainer.logger` values, give."""
    for config in config_files(argv):
        try:
            if os.path.isfile(config):
                with open(config, encoding="utf-8") as f:
                    config = f.read()
            loaded = yaml.safe_load(config)
        except (OSError, yaml.YAMLError):
            continue  # jsonargparse reports it
        trainer = loaded.get("trainer") if isinstance(loaded, dict) else None
        logger = trainer.get("logger") if isinstance(trainer, dict) else None
        if isinstance(logger, dict) and isinstance(logger.get("class_path"), str):
            yield logger
    for i, arg in enumerate(argv):
        value = arg.removeprefix(f"--{LOGGER}=") if arg.startswith(f"--{LOGGER}=") else None
        if arg == f"--{LOGGER}" and i + 1 < len(argv):
            value = argv[i + 1]
        try:
            loaded = yaml.safe_load(value) if value is not None else None
        except yaml.YAMLError:
            continue
        if isinstance(loaded, dict) and isinstance(loaded.get("class_path"), str):
            yield loaded


def _takes_any_keyword(class_path: str) -> bool:
    module_name, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name)
        parameters = inspect.signature(cls.__init__).parameters.values()
    except (ImportError, AttributeError, TypeError, ValueError):
        return True  # jsonargparse names a class it cannot import; the call reports the rest
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def drop_switched_logger_kwargs(config: Any, argv: Sequence[str]) -> str | None:
    """Drop from the parsed `config` of a command the `trainer.logger` `dict_kwargs` that only a logger of
    another class was given: jsonargparse keeps them when the class changes (`--trainer.logger CSVLogger`
    over a config's `WandbLogger` with `dict_kwargs: {group: ...}`), and the new class would refuse them
    with a TypeError. Returns the line that says what was dropped, or None. `dict_kwargs` left for a class
    that takes no `**kwargs` are refused in one line, naming them."""
    spec = config.get(LOGGER) if LOGGER in config else None
    kwargs = spec.get("dict_kwargs") if hasattr(spec, "get") and spec.get("class_path") else None
    if not kwargs:
        return None
    name = _short(spec["class_path"])
    given = list(_given_loggers(argv))
    own = {
        key
        for logger in given
        if _short(logger["class_path"]) == name
        for key in logger.get("dict_kwargs") or {}
    }
    others = {_short(logger["class_path"]) for logger in given if _short(logger["class_path"]) != name}
    theirs = {
        key
        for logger in given
        if _short(logger["class_path"]) != name
        for key in logger.get("dict_kwargs") or {}
    }
    explicit = {
        arg.partition("=")[0].removeprefix(f"--{LOGGER}.dict_kwargs.")
        for arg in argv
        if arg.startswith(f"--{LOGGER}.dict_kwargs.")
    }
    dropped = sorted(key for key in kwargs if key in theirs and key not in own | explicit)
    for key in dropped:
        del kwargs[key]
    if kwargs and not _takes_any_keyword(spec["class_path"]):
        raise ValueError(
            f"{LOGGER}: {name} takes no keyword arguments beyond its own, but its dict_kwargs give it "
            f"{', '.join(sorted(kwargs))}: remove them, or name a logger class that takes them"
        )
    if not dropped:
        return None
    return (
        f"{LOGGER}: {name} replaces the config's {', '.join(sorted(others))}; its dict_kwargs "
        f"({', '.join(dropped)}) are not passed to {name}"
    )


DATA_PRESET = "grpo_lightning.training.data.GSM8KDataModule"  # the CLI's data class when a config names none


def reset_preset_data_defaults(config: Any, given: Any) -> None:
    """Give a data class that replaces the preset its own defaults for the options the user left out:
    jsonargparse keeps the preset's default values when the class changes (`--data.class_path
    PromptDataModule` would get GSM8K's system prompt, which makes every prompt a conversation).
    `given`: the command's options without the defaults (`GRPOCLI.typed_config`)."""
    spec = config.get("data") if "data" in config else None
    if not hasattr(spec, "get") or not spec.get("class_path") or spec["class_path"] == DATA_PRESET:
        return
    init_args = spec.get("init_args")
    module_name, _, name = spec["class_path"].rpartition(".")
    try:
        own = inspect.signature(getattr(importlib.import_module(module_name), name).__init__).parameters
    except (ImportError, AttributeError, TypeError, ValueError):
        return  # jsonargparse names a class it cannot import
    preset_module, _, preset_name = DATA_PRESET.rpartition(".")
    preset = inspect.signature(
        getattr(importlib.import_module(preset_module), preset_name).__init__
    ).parameters
    given_args = given.get("data.init_args") if hasattr(given, "get") else None
    given_keys = set(given_args.keys()) if hasattr(given_args, "keys") else set()
    for key in list(init_args.keys()) if hasattr(init_args, "keys") else []:
        if key in given_keys or key not in own or key not in preset:
            continue
        carried, default = preset[key].default, own[key].default
        if default is not inspect.Parameter.empty and init_args[key] == carried != default:
            init_args[key] = default
