"""What a run resumed with `--ckpt_path` takes from its checkpoint and what from the command line: the options
the user typed (`typed_options`, from a config parsed without defaults; a value typed at its default counts),
the checkpoint's data continued unless other data is typed (`data_to_continue`), and the checkpoint's
reward functions where a config could not name them (`not_for_the_config`).
"""

from __future__ import annotations

from jsonargparse import Namespace

from grpo_lightning.core.options import plain_options
from grpo_lightning.training.training_state import changed_data_options, listed_differences


def data_to_continue(ckpt_path: str, checkpoint: dict, data: Namespace, given: object) -> dict:
    """A resumed run continues the checkpoint's data where it stopped: data options given (`given`, the
    data's config without defaults) another value that changes what is trained on are refused, unless
    `--new_data true` asks for this data from its beginning; the options left out that the checkpoint has
    otherwise are returned with its values."""
    saved = checkpoint.get("datamodule_hyper_parameters")
    if not saved or not isinstance(data, Namespace):
        return {}
    init_args = (data.get("init_args") or Namespace()).as_dict()
    typed = typed_options(given.get("init_args") if isinstance(given, Namespace) else None)
    changed = [
        (key, theirs, ours)
        for key, theirs, ours in changed_data_options(
            saved, {**init_args, "_class_path": data.get("class_path")}
        )
        if key == "data.class_path" or is_typed(key.removeprefix("data."), typed)
    ]
    if changed:
        raise ValueError(
            f"--ckpt_path {ckpt_path} was trained on other data ({listed_differences(changed)}). A resumed "
            "run continues the checkpoint's data where it stopped: drop these options or set them to the "
            "checkpoint's values; to continue these weights on this data from its beginning, add "
            "--new_data true"
        )
    return {
        key: theirs
        for key, theirs in saved.items()
        if key in init_args and not is_typed(key, typed) and init_args[key] != theirs
    }


def typed_options(given: object, prefix: str = "") -> set[str]:
    """The dotted names of the options in `given` (a config without defaults): each value's, and a section
    given empty (`dynamic_sampling: {}`, on with its defaults) by its own name."""
    given = plain_options(given)
    if isinstance(given, Namespace):
        given = given.as_dict()
    if not isinstance(given, dict) or not given:
        return {prefix.removesuffix(".")} if prefix else set()
    return set().union(
        *(typed_options(value, f"{prefix}{key}.") for key, value in given.items() if not key.startswith("_"))
    )


def is_typed(option: str, typed: set[str]) -> bool:
    """Whether the option at the dotted name `option` (or an option inside it) is among `typed`."""
    return any(name == option or name.startswith(option + ".") for name in typed)


def not_for_the_config(value: object) -> bool:
    """Whether a checkpoint's reward functions hold one that a config cannot name (None or a
    `not_importable` recipe where the checkpoint could not name it, a partial's `_target_` mapping): the
    config's are kept."""
    items = value if isinstance(value, list) else [value]
    return any(
        not (isinstance(item, str) or (isinstance(item, dict) and "class_path" in item))
        for item in items
        if item is not None or isinstance(value, list)
    )


def drop_leaf(options: dict, dotted: str) -> None:
    *parents, last = dotted.split(".")
    for key in parents:
        options = options[key]
    del options[last]
