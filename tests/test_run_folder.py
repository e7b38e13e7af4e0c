"""A run is reproducible from its folder: `fit` saves its whole config beside its logs and checkpoints,
`validate` and `export` take that config and a checkpoint and nothing else, `load_from_checkpoint(ckpt)`
needs no arguments, `--ckpt_path last` resumes the newest checkpoint or refuses in one line, and the
Trainer's Lightning options behave the same from Python as from the CLI (`training.trainer_options`)."""

from __future__ import annotations

import glob
import os
import re
import socket
import stat
import subprocess
import sys

import lightning as L
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import EarlyStopping
from transformers import AutoModelForCausalLM

from grpo_lightning.cli import build_cli, main
from grpo_lightning.core.algorithm.dynamic_sampling import GroupBuffer
from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.rewards.verifiable import LengthPenalty
from grpo_lightning.core.types import ScoredGroups
from grpo_lightning.io.hparams import import_object
from grpo_lightning.training.callbacks.run_folder import checkpoint_roots, latest_checkpoint
from grpo_lightning.training.data import GSM8KDataModule
from grpo_lightning.training.module import GRPOModule
from tests.helpers import digit_reward, quiet_trainer
from tests.test_interrupt import REPO, fit_args

CONFIG = """\
seed_everything: 0
trainer:
  accelerator: cpu
  max_steps: 2
  val_check_interval: 2
  limit_val_batches: 1
  num_sanity_val_steps: 0
  enable_progress_bar: false
  default_root_dir: {root}
  logger:
    class_path: lightning.pytorch.loggers.TensorBoardLogger
    init_args: {{save_dir: {root}, name: tensorboard}}
  callbacks:
    - class_path: lightning.pytorch.callbacks.EarlyStopping
      init_args: {{monitor: val/accuracy, mode: max, patience: 5}}
model:
  policy: {policy}
  reward_funcs:
    - tests.helpers.digit_reward
    - class_path: grpo_lightning.core.rewards.verifiable.LengthPenalty
      init_args: {{limit: 4}}
  grpo: {{num_generations: 2, max_completion_length: 6, preflight: false, learning_rate: 0.01}}
data:
  source: arithmetic
  system_prompt: null
  batch_size: 2
  val_size: 2
"""


def policy_weights(ckpt_path: str) -> dict[str, torch.Tensor]:
    state = torch.load(ckpt_path, map_location="cpu", weights_only=True)["state_dict"]
    return {k.removeprefix("policy."): v for k, v in state.items() if k.startswith("policy.")}


@pytest.fixture(scope="module")
def cli_run(tiny_model_dir, tmp_path_factory):
    """`cli.py fit --config run.yaml`: 2 steps, validation at step 2, TensorBoard, a checkpoint."""
    root = tmp_path_factory.mktemp("run")
    config = root / "run.yaml"
    config.write_text(CONFIG.format(root=root, policy=tiny_model_dir))
    build_cli(["fit", "--config", str(config)])
    saved = root / "tensorboard" / "version_0" / "config.yaml"
    (ckpt,) = glob.glob(str(root / "tensorboard" / "version_0" / "checkpoints" / "*.ckpt"))
    return root, config, saved, ckpt


def test_fit_saves_its_whole_config_beside_its_logs_and_checkpoints(cli_run):
    root, _, saved, ckpt = cli_run
    config = yaml.safe_load(saved.read_text())
    # Reward functions and callbacks as import paths; every default filled in.
    rewards = config["model"]["reward_funcs"]
    assert rewards[0] == "tests.helpers.digit_reward"
    assert import_object(rewards[1]["class_path"]) is LengthPenalty  # jsonargparse's shortest import path
    assert rewards[1]["init_args"]["limit"] == 4
    callbacks = [c["class_path"] for c in config["trainer"]["callbacks"]]
    assert "lightning.pytorch.callbacks.EarlyStopping" in callbacks
    assert config["model"]["grpo"]["sampling"]["temperature"] == 1.0 and config["seed_everything"] == 0
    assert os.path.dirname(os.path.dirname(ckpt)) == str(
        saved.parent
    )  # version_0/{config.yaml, checkpoints/}


def test_a_folder_holding_another_runs_config_is_refused_before_training(cli_run, capsys):
    root, config, saved, ckpt = cli_run
    before = saved.read_text()
    with pytest.raises(SystemExit) as exit_info:  # the logger's version fixed to the first run's
        main(["fit", "--config", str(config), "--trainer.logger.init_args.version=version_0"])
    assert exit_info.value.code == 2
    assert f"error: {saved} exists: that folder holds another run's config" in capsys.readouterr().err
    assert saved.read_text() == before and glob.glob(str(saved.parent / "checkpoints" / "*.ckpt")) == [ckpt]


def test_two_runs_starting_in_one_folder_at_once_the_second_is_refused(cli_run, capsys):
    root, config, saved, ckpt = cli_run
    folder = saved.parent.parent / "version_7"  # both runs given version 7, neither has written its config
    lock = folder / "config.yaml.lock"
    other = subprocess.Popen(["sleep", "60"])  # the first run, alive on this host, holding the folder
    try:
        folder.mkdir()
        lock.write_text(f"process {other.pid} on {socket.gethostname()}: cli.py fit\n")
        with pytest.raises(SystemExit) as exit_info:
            main(["fit", "--config", str(config), "--trainer.logger.init_args.version=version_7"])
    finally:
        other.kill()
        other.wait()
    assert exit_info.value.code == 2
    assert f"error: the run's config {folder / 'config.yaml'} is being written by another run (process " in (
        capsys.readouterr().err
    )
    # The first run's lock is left as it was; the second wrote no config and no checkpoint (its logger's
    # empty event file aside).
    assert lock.read_text() == f"process {other.pid} on {socket.gethostname()}: cli.py fit\n"
    assert [name for name in os.listdir(folder) if not name.startswith("events.out")] == ["config.yaml.lock"]


def test_validate_and_export_take_the_saved_config_and_a_checkpoint_alone(cli_run, capsys):
    root, _, saved, ckpt = cli_run
    cli = build_cli(["validate", "--config", str(saved), "--ckpt_path", ckpt])
    assert "val/accuracy" in cli.trainer.callback_metrics
    trained = policy_weights(ckpt)
    for name, weight in cli.model.policy.state_dict().items():
        assert torch.equal(weight, trained[name]), name

    capsys.readouterr()
    main(["export", "--config", str(saved), "--ckpt_path", ckpt])
    out = ckpt.removesuffix(".ckpt") + "-hf"
    printed = capsys.readouterr().out
    assert f"exported {ckpt} to {out} (" in printed and "model.safetensors" in printed
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o777 & ~umask  # a normal folder, not mkdtemp's 0700
    exported = AutoModelForCausalLM.from_pretrained(out).state_dict()
    for name, weight in exported.items():
        assert torch.equal(weight, trained[name]), name


def test_load_from_checkpoint_needs_no_arguments(cli_run, tiny_model_dir, recwarn):
    _, _, _, ckpt = cli_run
    module = GRPOModule.load_from_checkpoint(ckpt)
    assert module.grpo.num_generations == 2 and module.grpo.learning_rate == 0.01
    assert [fn.__name__ for fn in module.reward_funcs[:1]] == ["digit_reward"]
    assert module.reward_funcs[1].limit == 4  # the LengthPenalty of the config, rebuilt
    trained = policy_weights(ckpt)
    for name, weight in module.policy.state_dict().items():
        assert torch.equal(weight, trained[name]), name
    # The policy given again is no change of options: no warning.
    GRPOModule.load_from_checkpoint(ckpt, policy=tiny_model_dir)
    assert not [w for w in recwarn if "trained with other options" in str(w.message)]


def test_a_python_checkpoint_reloads_and_reads_without_grpo_lightning(tiny_model_dir, tmp_path, recwarn):
    """Made from Python, with dynamic sampling's groups waiting: `torch.load(weights_only=True)` in a process
    that never imports grpo_lightning, and `load_from_checkpoint(ckpt)` with no arguments."""
    grpo = GRPOConfig(
        num_generations=2,
        max_completion_length=4,
        dynamic_sampling=True,
        dynamic_sampling_metric="digit_reward",
        preflight=False,
    )
    module = GRPOModule(tiny_model_dir, reward_funcs=[digit_reward], grpo=grpo)
    module.configure_model()
    prompts = [[{"role": "user", "content": "1 + 1?"}], [{"role": "user", "content": "2 + 2?"}]]
    rollout, completions = module.rollouts.sample(prompts, 2)
    rewards = torch.tensor([0.0, 1.0, 1.0, 1.0])
    module.group_source.buffer.add(ScoredGroups(prompts, rollout, completions, rewards[:, None], rewards, 2))
    trainer = quiet_trainer(max_steps=1, limit_val_batches=0)
    trainer.strategy.connect(module)
    trainer.save_checkpoint(tmp_path / "python.ckpt")

    read = "import sys, torch; c = torch.load(sys.argv[1], weights_only=True); "
    read += "assert 'grpo_lightning' not in sys.modules; print(c['hyper_parameters']['reward_funcs'])"
    done = subprocess.run(
        [sys.executable, "-c", read, tmp_path / "python.ckpt"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "['tests.helpers.digit_reward']"

    loaded = GRPOModule.load_from_checkpoint(tmp_path / "python.ckpt")
    assert loaded.reward_funcs == [digit_reward] and loaded.grpo.dynamic_sampling
    assert isinstance(loaded.group_source.buffer, GroupBuffer) and loaded.group_source.buffer.num_kept == 1
    assert loaded.group_source.buffer.kept[0].completions == completions[:2]
    assert not [w for w in recwarn if "trained with other options" in str(w.message)]


def test_ckpt_path_last_resumes_the_newest_checkpoint_or_refuses(tiny_model_dir, tmp_path, capsys):
    args = fit_args(tiny_model_dir, str(tmp_path), 1)
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--ckpt_path", "last"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"error: --ckpt_path last: this run has no checkpoint yet (none under {tmp_path})" in err
    assert not glob.glob(str(tmp_path / "**" / "*.ckpt"), recursive=True)  # nothing trained

    first = build_cli(args)
    (ckpt,) = glob.glob(str(tmp_path / "**" / "*.ckpt"), recursive=True)
    resumed = build_cli([*fit_args(tiny_model_dir, str(tmp_path), 2), "--ckpt_path", "last"])
    assert resumed.trainer.ckpt_path == ckpt
    assert first.trainer.global_step == 1 and resumed.trainer.global_step == 2  # one more step, not two


@pytest.mark.parametrize("config", sorted(glob.glob(os.path.join(REPO, "configs", "*.yaml"))))
def test_ckpt_path_last_finds_where_each_shipped_config_writes(config, tmp_path, monkeypatch):
    """Every shipped config: a checkpoint where its run writes one (the logger's version folder, or the
    interrupted run's `checkpoints/`) is what `--ckpt_path last` resumes."""
    monkeypatch.chdir(tmp_path)
    with open(config, encoding="utf-8") as f:
        trainer = yaml.safe_load(f)["trainer"]
    from jsonargparse import Namespace

    roots = checkpoint_roots(Namespace(trainer))
    logger = trainer.get("logger")
    if isinstance(logger, dict):
        folder = os.path.join(logger["init_args"]["save_dir"], logger["init_args"]["name"], "version_3")
    else:
        folder = os.path.join(trainer["default_root_dir"], "checkpoints")
    older = os.path.join(trainer["default_root_dir"], "checkpoints", "interrupted.ckpt")
    newest = os.path.join(folder, "checkpoints", "step00100.ckpt")
    for path in (older, newest):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "wb").close()
    os.utime(older, (1, 1))
    assert latest_checkpoint(roots) == newest


def test_python_trainer_options_equal_the_cli_run(tiny_model_dir, tmp_path):
    """`Trainer(gradient_clip_val=..., accumulate_grad_batches=...)` from Python trains the same weights as
    the CLI with the same options; an EarlyStopping on val/accuracy left at Lightning's defaults survives a
    run that ends before its first validation."""
    options = ["--seed_everything=0", "--model.grpo.learning_rate=0.01"]
    lightning_options = ["--trainer.gradient_clip_val=0.5", "--trainer.accumulate_grad_batches=2"]
    cli = build_cli(fit_args(tiny_model_dir, str(tmp_path / "cli"), 1, *options, *lightning_options))

    L.seed_everything(0, workers=True)
    grpo = GRPOConfig(num_generations=2, max_completion_length=6, preflight=False, learning_rate=0.01)
    module = GRPOModule(tiny_model_dir, reward_funcs=[digit_reward], grpo=grpo)
    data = GSM8KDataModule("arithmetic", system_prompt=None, batch_size=2, val_size=2)
    stopper = EarlyStopping(monitor="val/accuracy", mode="max")
    trainer = quiet_trainer(
        max_steps=1,
        gradient_clip_val=0.5,
        accumulate_grad_batches=2,
        callbacks=[stopper],
        num_sanity_val_steps=0,
        default_root_dir=str(tmp_path / "python"),
    )
    trainer.fit(module, data)

    assert (module.grpo.max_grad_norm, module.grpo.micro_batch_size, data.hparams.batch_size) == (0.5, 4, 4)
    assert trainer.gradient_clip_val is None and trainer.accumulate_grad_batches == 1
    assert stopper._check_on_train_epoch_end is False and trainer.global_step == 1
    before = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    ours = cli.model.policy.state_dict()
    moved = False
    for name, weight in module.policy.state_dict().items():
        assert torch.equal(weight, ours[name]), name
        moved |= not torch.equal(weight, before[name])
    assert moved


def test_help_lists_the_commands_that_run(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    listed = capsys.readouterr().out.split("Available subcommands:")[1]
    commands = [m[1] for line in listed.splitlines() if (m := re.match(r" {4}([a-z][\w-]*)", line))]
    assert commands == [
        "fit",
        "validate",
        "test",
        "predict",
        "audit",
        "export",
        "prepare-smollm2",
        "from-trl",
        "vllm-serve",
    ]
