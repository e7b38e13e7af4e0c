"""Every command the README shows runs, or is marked `# GPU` and still parses; every file it names exists.

- `python cli.py ...`: parsed with `--print_config` (the config and every option checked, nothing built),
  a run folder's `config.yaml` standing for the shipped config that writes it;
- `make <target>`: the Makefile has it; `pip install`: the extras exist; scripts: the file exists and
  compiles; `tensorboard`: installed;
- the Python quick start: run, on the tiny model and 1 CPU step (the substitutions are listed and must all
  apply, so an edit of the README that they miss fails here);
- CI runs the test command the README states.
"""

from __future__ import annotations

import os
import py_compile
import re
import shlex

import pytest
import tomllib
import yaml

from grpo_lightning.cli import main
from tests.test_interrupt import REPO

README = os.path.join(REPO, "README.md")
TEXT = open(README, encoding="utf-8").read()
GPU = "# GPU"


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", TEXT, re.S)


def shell_commands() -> list[tuple[list[str], bool]]:
    """Each command of the README's bash blocks as words, with its `$VARIABLES` filled in, and whether it is
    marked as needing a GPU."""
    commands, variables = [], {}
    for block in blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if not words:
                continue
            if len(words) == 1 and re.fullmatch(r"[A-Z_]+=\S+", words[0]):
                name, value = words[0].split("=", 1)
                variables[name] = value
                continue
            words = [re.sub(r"\$([A-Z_]+)", lambda m: variables[m[1]], w) for w in words]
            commands.append((words, line.rstrip().endswith(GPU)))
    return commands


COMMANDS = shell_commands()


def shipped_config(path: str) -> str:
    """A run folder's `config.yaml` (`runs/<name>/<logger>/version_N/config.yaml`) stands for the shipped
    config `configs/<name>.yaml`, which must write its runs there."""
    match = re.fullmatch(r"runs/([\w.]+)/(\w+)/version_\d+/config\.yaml", path)
    if match is None:
        return path
    config = os.path.join("configs", f"{match[1]}.yaml")
    with open(os.path.join(REPO, config), encoding="utf-8") as f:
        logger = yaml.safe_load(f)["trainer"]["logger"]["init_args"]
    assert (logger["save_dir"], logger["name"]) == (f"runs/{match[1]}", match[2]), path
    return config


def test_the_readme_states_the_two_commands_and_ci_runs_its_test_command():
    words = [c[0] for c in COMMANDS]
    assert ["make", "demo"] in words and ["make", "test"] in words
    with open(os.path.join(REPO, ".ci", "run"), encoding="utf-8") as f:
        assert f.read().strip().splitlines()[-3:] == ["make test", "make test-long", "make test-vllm"]
    # The quick start comes first, and reaches a trained model's accuracy in its first 80 lines.
    assert re.findall(r"^## (.+)$", TEXT, re.M)[0] == "Quick start"
    assert TEXT[: TEXT.index("**3. Validate")].count("\n") < 80


@pytest.mark.parametrize(
    ("words", "gpu"),
    [c for c in COMMANDS if c[0][:2] == ["python", "cli.py"]],
    ids=lambda value: " ".join(value) if isinstance(value, list) else None,
)
def test_each_cli_command_parses(words, gpu, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    args = [shipped_config(w) for w in words[2:]]
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--help"] if args[0] == "prepare-smollm2" else [*args, "--print_config"])
    assert exit_info.value.code in (0, None), capsys.readouterr().err
    if args[0] != "prepare-smollm2":
        printed = yaml.safe_load(capsys.readouterr().out)
        assert "model" in printed and "trainer" in printed


def test_every_other_command_runs_here_or_is_checked():
    with open(os.path.join(REPO, "Makefile"), encoding="utf-8") as f:
        targets = set(re.findall(r"^([\w-]+):", f.read(), re.M))
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        extras = set(tomllib.load(f)["project"]["optional-dependencies"])
    checked = 0
    for words, _gpu in COMMANDS:
        if words[:2] == ["python", "cli.py"]:
            continue
        if words[0] == "make":
            assert set(words[1:]) <= targets, words
        elif words[:2] == ["pip", "install"]:
            for spec in words[2:]:
                if spec.startswith("."):
                    named = re.fullmatch(r"\.(?:\[([\w,]+)\])?", spec)
                    assert named, spec
                    assert set(filter(None, (named[1] or "").split(","))) <= extras, spec
        elif words[0] in ("python", "bash") and words[1].endswith((".py", ".sh")):
            assert os.path.isfile(os.path.join(REPO, words[1])), words
            if words[1].endswith(".py"):
                py_compile.compile(os.path.join(REPO, words[1]), doraise=True)
        elif words[0] == "tensorboard":
            import tensorboard  # noqa: F401  (a dependency)
        else:
            raise AssertionError(f"a README command of a kind this test does not check: {words}")
        checked += 1
    assert checked >= 4


def test_the_files_the_readme_names_exist():
    named = set(re.findall(r"`((?:configs|docs|scripts|benchmarks|tests|grpo_lightning)/[\w./-]+)`", TEXT))
    named |= set(re.findall(r"\b((?:docs|configs)/[\w.-]+\.(?:md|yaml))\b", TEXT))
    assert len(named) > 10
    missing = sorted(p for p in named if not os.path.exists(os.path.join(REPO, p)))
    assert not missing


# The quick start's Python block, shrunk to the tiny model and one CPU step.
SHRINK = {
    '"Qwen/Qwen2.5-0.5B-Instruct"': "TINY_MODEL",
    "num_generations=8, max_completion_length=512": "num_generations=2, max_completion_length=8",
    'loss_type="dapo"': 'loss_type="dapo", preflight=False',  # its sampled completions cost seconds here
    'source="data/gsm8k", batch_size=8, val_split="test", val_size=256': (
        'source="data/gsm8k", batch_size=2, val_split="test", val_size=2'
    ),
    "max_steps=2000": "max_steps=1, accelerator='cpu', logger=False, enable_progress_bar=False",
    'precision="bf16-mixed"': 'precision="32-true"',
    "val_check_interval=100": (
        "val_check_interval=VALIDATE_EVERY, num_sanity_val_steps=0, default_root_dir=ROOT"
    ),
}


@pytest.mark.parametrize("validate_every", [1, 100])  # validated at step 1; ended before any validation
def test_the_python_quick_start_runs(tiny_model_dir, tmp_path, monkeypatch, validate_every):
    (script,) = [b for b in blocks("python") if "trainer.fit" in b]
    for old, new in SHRINK.items():
        assert old in script, old
        script = script.replace(old, new)
    monkeypatch.chdir(REPO)
    scope = {"TINY_MODEL": tiny_model_dir, "ROOT": str(tmp_path), "VALIDATE_EVERY": validate_every}
    exec(compile(script, "README.md", "exec"), scope)
    trainer, best, trained = scope["trainer"], scope["best"], scope["trained"]
    assert trainer.global_step == 1
    assert trained.grpo.num_generations == 2 and trained.grpo.max_grad_norm == 1.0
    if validate_every == 1:
        assert best.best_model_path.startswith(str(tmp_path)) and trained is not scope["module"]
    else:
        assert best.best_model_path == "" and trained is scope["module"]
