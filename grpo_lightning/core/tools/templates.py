"""The chat templates TRL ships (`trl/chat_templates/*.jinja`, read from the installed `trl` package, never
copied here): which of them a tokenizer's template is, and the training template TRL swaps in for it.

TRL trains tool calls only with templates it knows: it picks the parser of a template's tool calls by
comparing the template with its files, and where a template does not render a conversation as the start of
the next one, it trains with its own patched copy of that template (`<name>_training.jinja`,
`trl.chat_template_utils.get_training_chat_template`). Without TRL installed there is no such copy to load:
a template that needs one is refused, naming TRL.
"""

from __future__ import annotations

import importlib.resources
from functools import cache

TRAINING_SUFFIX = "_training"


@cache
def trl_chat_templates() -> dict[str, str]:
    """TRL's shipped chat templates by file name without `.jinja` (`qwen3`, `qwen3_training`, ...); empty
    where TRL is not installed."""
    try:
        folder = importlib.resources.files("trl") / "chat_templates"
    except ModuleNotFoundError:
        return {}
    if not folder.is_dir():
        return {}
    return {
        entry.name.removesuffix(".jinja"): entry.read_text(encoding="utf-8")
        for entry in folder.iterdir()
        if entry.name.endswith(".jinja")
    }


def template_text(chat_template: str | dict | None) -> str:
    """A tokenizer's chat template as text: the `default` one of named templates, "" without one."""
    if isinstance(chat_template, dict):
        return chat_template.get("default", "")
    return chat_template or ""


def trl_template_name(chat_template: str | dict | None) -> str | None:
    """The name of TRL's template file that `chat_template` is, character for character (a training one
    included), or None."""
    text = template_text(chat_template)
    if not text:
        return None
    return next((name for name, shipped in trl_chat_templates().items() if shipped == text), None)


def trl_training_template(chat_template: str | dict | None) -> str | None:
    """TRL's training template for `chat_template` (one of its shipped templates), or None where TRL ships
    none for it (or is not installed)."""
    name = trl_template_name(chat_template)
    if name is None or name.endswith(TRAINING_SUFFIX):
        return None
    return trl_chat_templates().get(name + TRAINING_SUFFIX)
