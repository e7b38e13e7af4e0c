"""A module's hyper-parameters as its checkpoints store them: what `load_from_checkpoint(ckpt)` needs with no
arguments, in plain Python values that `torch.load(weights_only=True)` reads without importing
grpo-lightning (`portable_hparams`), and read back (`resolve_callable`, `as_options`, `sectioned_hparams`).

The module's hyper-parameters hold the policy and tokenizer as their paths or hub ids, the reward functions as
import paths ("package.module.function"; a `functools.partial`, Hydra's `_partial_: true`, as the mapping
Hydra writes for it: `{"_target_": path, "_partial_": true, **its keyword arguments}`), the option dataclasses
as dicts, and every other value plain: Hydra's `DictConfig` / `ListConfig` as dicts and lists, tuples as
lists, paths as strings; anything else is refused naming the argument (`plain_value`). The loggers receive the
same values (`hparams_initial`). `GRPOModule` accepts each of these forms back, so
`GRPOModule.load_from_checkpoint(ckpt)` rebuilds the run's module. A reward function without an import path (a
lambda, a function defined inside another, a bound method, a callable object built in Python) is stored as
`{"not_importable": "<where it was defined>"}` and must be passed again (`load_from_checkpoint(ckpt,
reward_funcs=[...])`); the module says so when `fit` sets up. Loading imports the functions a checkpoint
names: load checkpoints you trust, as for any code you run.
"""

from __future__ import annotations

import enum
import functools
import importlib
import numbers
import os
import sys
import warnings
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import asdict, is_dataclass
from typing import Any

from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.options import plain_options
from grpo_lightning.io.models import LoraOptions, ModelOptions

__all__ = [
    "as_options",
    "comparable_hparams",
    "import_object",
    "import_path",
    "plain_value",
    "portable_hparams",
    "resolve_callable",
    "reward_recipe",
    "unimportable_rewards",
]
NOT_IMPORTABLE = "not_importable"  # the key of a recipe naming a function without an import path
# A module's arguments that hold functions (or classes), stored by import path: lists of them, and one each.
FUNCTION_LISTS = ("reward_funcs", "tools")
FUNCTIONS = ("val_reward", "rollout_func")
PLAIN_SCALARS = (str, bool, int, float)  # and None
# A value of another type that stands for a plain one (numpy's int64 and float64, a subclass) as it.
PLAIN_KINDS = ((bool, bool), (str, str), (numbers.Integral, int), (numbers.Real, float))


def import_object(path: str) -> Any:
    """The object a dotted import path names: `"package.module.function"` or `"package.module.Class.attr"`."""
    parts = path.split(".")
    for split in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:split])
        try:
            found = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name is not None and module_name.startswith(err.name):
                continue  # not a module: try a shorter prefix
            raise
        try:
            for attr in parts[split:]:
                found = getattr(found, attr)
        except AttributeError:
            break
        return found
    raise ValueError(f"{path!r} is not an importable name (package.module.name)")


def import_path(obj: object) -> str | None:
    """The dotted path that imports `obj` back, or None where there is none (a lambda, a function defined
    inside another, an object built at run time)."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or "<" in qualname:
        return None
    try:
        found = import_object(f"{module}.{qualname}")
    except (ImportError, ValueError):
        return None
    return f"{module}.{qualname}" if found is obj else None


def resolve_callable(value: Callable | str | Mapping | None, option: str) -> Callable:
    """A reward function given as itself or as the recipe a checkpoint stores (`reward_recipe`): an import
    path, or a partial's `_target_` mapping. A function the checkpoint could not name (None in older
    checkpoints, a `not_importable` recipe) is refused naming the option."""
    again = f"pass it again, e.g. load_from_checkpoint(ckpt, {option.split('[')[0]}=...)"
    if value is None:
        raise ValueError(
            f"{option} is None: the checkpoint could not name this function (a lambda, or one defined inside "
            f"another function, has no import path): {again}"
        )
    if isinstance(value, Mapping) and NOT_IMPORTABLE in value:
        raise ValueError(
            f"{option}: the checkpoint names {value[NOT_IMPORTABLE]}, which has no import path: {again}"
        )
    partial = isinstance(value, Mapping) and value.get("_partial_") is True
    if partial and isinstance(value.get("_target_"), str):
        keywords = {k: v for k, v in value.items() if k not in ("_target_", "_partial_", "_args_")}
        function = resolve_callable(value["_target_"], f"{option}._target_")
        return functools.partial(function, *value.get("_args_", []), **keywords)
    if isinstance(value, str):
        try:
            found = import_object(value)
        except ImportError as err:
            raise ValueError(f"{option}={value!r}: cannot import it ({err})") from None
        except ValueError as err:
            raise ValueError(f"{option}={value!r}: {err}") from None
        if not callable(found):
            raise ValueError(f"{option}={value!r} names a {type(found).__name__}, not a function")
        return found
    return value


def resolve_rewards(
    reward_funcs: list[Callable | str] | None, val_reward: Callable | str | None
) -> tuple[list[Callable] | None, Callable | None]:
    """A module's `reward_funcs` and `val_reward` as functions (`resolve_callable`); None stays None (the
    defaults)."""
    if reward_funcs is not None:
        reward_funcs = [resolve_callable(fn, f"reward_funcs[{i}]") for i, fn in enumerate(reward_funcs)]
    return reward_funcs, None if val_reward is None else resolve_callable(val_reward, "val_reward")


def reward_recipe(value: object) -> object:
    """A reward function as a checkpoint stores it, in plain values: its import path; a `functools.partial`
    of an importable function with plain arguments as Hydra's mapping (`{"_target_": path, "_partial_": true,
    "_args_": [...], **keywords}`); a config's `class_path` mapping as it is; anything else as
    `{"not_importable": "<module>.<qualified name>"}` (`resolve_callable` refuses it by that name)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        return plain_value(value, "reward")
    if isinstance(value, functools.partial):
        target = import_path(value.func)
        try:
            args, keywords = plain_value(list(value.args), "args"), plain_value(value.keywords, "keywords")
        except ValueError:
            target = None  # an argument a checkpoint cannot hold: the partial cannot be rebuilt
        if target is not None:
            return {"_target_": target, "_partial_": True, **({"_args_": args} if args else {}), **keywords}
        return {NOT_IMPORTABLE: f"functools.partial({_defined_at(value.func)}, ...)"}
    return import_path(value) or {NOT_IMPORTABLE: _defined_at(value)}


def _defined_at(value: object) -> str:
    """Where a function was defined (`module.qualified.name`), or what class an object is of."""
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    if isinstance(qualname, str):
        return f"{module}.{qualname}" if isinstance(module, str) else qualname
    cls = type(value)
    return f"a {cls.__module__}.{cls.__qualname__} object"


def unimportable_rewards(hparams: Mapping) -> list[str]:
    """The reward functions a module's hyper-parameters cannot rebuild, as `option (where)`."""
    named = []
    funcs = hparams.get("reward_funcs")
    for i, recipe in enumerate(funcs if isinstance(funcs, list) else []):
        if isinstance(recipe, Mapping) and NOT_IMPORTABLE in recipe:
            named.append(f"reward_funcs[{i}] ({recipe[NOT_IMPORTABLE]})")
    val_reward = hparams.get("val_reward")
    if isinstance(val_reward, Mapping) and NOT_IMPORTABLE in val_reward:
        named.append(f"val_reward ({val_reward[NOT_IMPORTABLE]})")
    return named


def _container(value: object) -> object | None:
    """Hydra's `DictConfig` / `ListConfig` (omegaconf, imported by whoever made one) as a dict or list,
    interpolations resolved; None for any other value."""
    omegaconf = sys.modules.get("omegaconf")
    if omegaconf is None or not isinstance(value, omegaconf.Container):
        return None
    return omegaconf.OmegaConf.to_container(value, resolve=True)


def plain_value(value: object, where: str) -> object:
    """`value` in the plain values that `torch.load(weights_only=True)` and every logger read (str, int,
    float, bool, None, and lists and string-keyed dicts of them): Hydra's containers as dicts and lists,
    tuples and sets as lists, paths as strings, dataclasses as dicts. Anything else raises ValueError
    naming `where`."""
    container = _container(value)
    if container is not None:
        value = container
    if is_dataclass(value) and not isinstance(value, type):
        value = asdict(value)
    if isinstance(value, enum.Enum):
        value = value.value
    if value is None or type(value) in PLAIN_SCALARS:
        return value
    plain = next((to for kind, to in PLAIN_KINDS if isinstance(value, kind)), None)
    if plain is not None:  # pickled as its own class, which weights_only refuses
        return plain(value)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, Mapping):
        if not all(isinstance(key, str) for key in value):
            raise ValueError(f"{where}: a hyper-parameter's mapping needs string keys, got {list(value)!r}")
        return {key: plain_value(item, f"{where}.{key}") for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [plain_value(item, f"{where}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, set | frozenset):  # a list in a fixed order, for the same checkpoint every run
        return [plain_value(item, f"{where}[{i}]") for i, item in enumerate(sorted(value, key=repr))]
    raise ValueError(
        f"{where}={value!r} is a {type(value).__name__}: checkpoints and loggers take plain hyper-parameters "
        "(str, int, float, bool, None, lists and dicts of them); pass it as one (a function or class by its "
        "import path, read back with grpo_lightning.io.hparams.import_object)"
    )


def _source(value: object) -> str | None:
    """A policy or tokenizer as the path or hub id it loads from (`name_or_path`), None if it has none."""
    if value is None or isinstance(value, str):
        return value
    return getattr(value, "name_or_path", None) or None


def portable_hparams(hparams: MutableMapping, sources: Mapping[str, object]) -> None:
    """Make a `GRPOModule`'s hyper-parameters what `load_from_checkpoint(ckpt)` needs, as plain values (in
    place): `sources` (the policy and tokenizer that the class's own arguments take) as their paths or hub
    ids, the reward functions, tools, environment classes and rollout function as recipes (`reward_recipe`),
    the option dataclasses as dicts, every other value plain (`plain_value`)."""
    hparams.update({key: _source(value) for key, value in sources.items()})
    for key in FUNCTION_LISTS:
        funcs = _container(hparams.get(key))  # a Hydra list: its items, partials as they are
        funcs = hparams.get(key) if funcs is None else funcs
        if isinstance(funcs, list | tuple):
            hparams[key] = [reward_recipe(fn) for fn in funcs]
    for key in FUNCTIONS:
        if key in hparams:
            hparams[key] = reward_recipe(hparams[key])
    factories = hparams.get("environment_factory")
    if isinstance(factories, Mapping) and not {"_target_", "class_path"} & set(factories):
        hparams["environment_factory"] = {name: reward_recipe(cls) for name, cls in factories.items()}
    elif factories is not None:
        hparams["environment_factory"] = reward_recipe(factories)
    for key, value in hparams.items():
        if not key.startswith("_"):  # LightningCLI's own bookkeeping (`_class_path`, `_instantiator`)
            hparams[key] = plain_value(value, key)


def as_options(
    grpo: GRPOConfig | Mapping, model_options: ModelOptions | Mapping, lora: LoraOptions | Mapping | None
) -> tuple[GRPOConfig, ModelOptions, LoraOptions | None]:
    """`GRPOModule`'s option dataclasses, given as themselves or as the dicts a checkpoint stores."""

    def build(cls: type, value: object) -> object:
        return cls(**value) if isinstance(value, Mapping) else value

    return build(GRPOConfig, grpo), build(ModelOptions, model_options), build(LoraOptions, lora)


def comparable_hparams(hparams: MutableMapping) -> dict:
    """`hparams` with its functions and classes (reward functions, tools, environment classes, rollout
    function) and options in the plain form a checkpoint stores, for comparing a checkpoint's options with a
    module's or a config's: a function as its import path whether given as itself or as that path; one
    without an import path as None, which compares equal to any other such (neither side can say which
    function it is)."""

    def comparable(fn: object) -> object:
        recipe = reward_recipe(fn)
        return None if isinstance(recipe, Mapping) and NOT_IMPORTABLE in recipe else recipe

    plain = sectioned_hparams(hparams)
    for key in FUNCTION_LISTS:
        if isinstance(plain.get(key), list | tuple):
            plain[key] = [comparable(fn) for fn in plain[key]]
    for key in FUNCTIONS:
        if key in plain:
            plain[key] = comparable(plain[key])
    factories = plain.get("environment_factory")
    if isinstance(factories, Mapping) and not {"_target_", "class_path"} & set(factories):
        plain["environment_factory"] = {name: comparable(cls) for name, cls in factories.items()}
    elif factories is not None:
        plain["environment_factory"] = comparable(factories)
    return plain


def sectioned_hparams(hparams: Mapping) -> dict:
    """`hparams` with the `grpo` options as a dict of sections, also where a checkpoint stores them by their
    flat names (written before the options had sections): read through `GRPOConfig`'s alias table."""
    plain = dict(hparams)
    if isinstance(plain.get("grpo"), Mapping):
        with warnings.catch_warnings():  # the options were told about when the run was built
            warnings.simplefilter("ignore")
            plain["grpo"] = plain_options(GRPOConfig(**plain["grpo"]))
    return plain
