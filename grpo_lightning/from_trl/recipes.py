"""Reading a TRL recipe: its keys and values, as TRL's `TrlParser` reads them.

A recipe is either a YAML file of `GRPOConfig`, `ModelConfig` and `ScriptArguments` keys (open-r1's
`recipes/*/grpo/config_*.yaml`), or the command line that TRL's example scripts document
(`accelerate launch ... examples/scripts/gspo.py --beta 0.0 --use_peft ...`): the arguments after the
script, `--key value`, `--key=value`, `--flag` for true, and several values for a list. Values keep YAML's
types; a number YAML reads as text (`1e-6`) is a number, as the dataclass types make it in TRL.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import yaml

_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
_INTEGER = re.compile(r"[-+]?\d+")


@dataclass(frozen=True)
class Recipe:
    """A recipe's keys in its order, where it came from and how it was written."""

    path: str
    keys: dict[str, object]
    form: str  # "yaml" or "command line"
    text: str


def read_recipe(path: str) -> Recipe:
    """The recipe at `path`; a file that is neither a YAML mapping nor a command line raises ValueError."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"{path}: no such recipe file (give a TRL recipe: a YAML file or a command line)")
    text = file.read_text(encoding="utf-8")
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as err:
        if _looks_like_yaml(file, text):
            mark = getattr(err, "problem_mark", None)
            at = f":{mark.line + 1}" if mark is not None else ""
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ValueError(f"{path}{at}: not valid YAML ({problem}); correct the recipe") from None
        loaded = None
    if isinstance(loaded, dict):
        bad = [k for k in loaded if not isinstance(k, str)]
        if bad:
            raise ValueError(f"{path}: key {bad[0]!r} is not an option name")
        return Recipe(path, {k: _typed(v) for k, v in loaded.items()}, "yaml", text)
    if "--" in text:
        return Recipe(path, command_line_keys(text, path), "command line", text)
    raise ValueError(
        f"{path}: neither a YAML mapping of TRL options nor a command line of them (--key value ...)"
    )


def _looks_like_yaml(file: Path, text: str) -> bool:
    """Whether a file meant to be YAML: named so, or its first line that is not a comment is `key: ...`."""
    if file.suffix.lower() in (".yaml", ".yml"):
        return True
    lines = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return bool(lines) and _YAML_KEY.match(lines[0]) is not None


# A shell word: unquoted characters and quoted spans, as many as run together (`--key="a b"` is one word).
_SHELL_WORD = re.compile(r"""(?:[^\s'"\\]+|\\.|'[^']*'|"(?:\\.|[^"\\])*")+""")
_YAML_KEY = re.compile(r"\s*[\w.-]+\s*:(\s|$)")


def _shell_words(line: str, where: str) -> list[tuple[str, bool]]:
    """The words of a command line as a shell reads them, each with whether it began with a quote (a quoted
    `"--x"` is a value, never an option)."""
    try:
        shlex.split(line)  # its own error for an unclosed quote, which the words below would skip
        return [
            (shlex.split(raw)[0] if shlex.split(raw) else "", raw[0] in "'\"")
            for raw in _SHELL_WORD.findall(line)
        ]
    except ValueError as err:  # an unclosed quote
        raise ValueError(f"{where}: {err} in its command line") from None


def command_line_keys(text: str, where: str) -> dict[str, object]:
    """The options of a TRL script's command line: the words after the last `*.py` (or all of them), shell
    quoting, comments and line continuations as a shell reads them."""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    words = _shell_words(" ".join(line.rstrip().removesuffix("\\") for line in lines), where)
    scripts = [i for i, (word, _) in enumerate(words) if word.endswith(".py")]
    words = words[scripts[-1] + 1 :] if scripts else words
    keys: dict[str, object] = {}
    name: str | None = None
    values: list[str] = []

    def close() -> None:
        if name is None:
            return
        if name in keys:
            raise ValueError(f"{where}: --{name} is given twice")
        parsed = [_word(v) for v in values]
        keys[name] = True if not parsed else parsed[0] if len(parsed) == 1 else parsed

    for word, quoted in words:
        if word.startswith("--") and not quoted:
            close()
            name, _, value = word[2:].partition("=")
            values = [value] if value else []
            continue
        if name is None:
            raise ValueError(f"{where}: {word!r} comes before any --option")
        if word != ",":
            values.append(
                word.removesuffix(",")
            )  # `"q_proj", "v_proj"`: two values, as TRL's docs write them
    close()
    return keys


def _word(word: str) -> object:
    """A command-line value as the option's type would make it: booleans, None, numbers, else text."""
    lowered = word.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    if _INTEGER.fullmatch(word):
        return int(word)
    if _NUMBER.fullmatch(word):
        return float(word)
    return word


def _typed(value: object) -> object:
    """A YAML value with numbers written as text (`1e-6`, which YAML 1.1 reads as a string) as numbers."""
    if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        return float(value) if not _INTEGER.fullmatch(value.strip()) else int(value)
    if isinstance(value, list):
        return [_typed(v) for v in value]
    if isinstance(value, dict):
        return {k: _typed(v) for k, v in value.items()}
    return value
