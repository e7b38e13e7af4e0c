"""A run made when every GRPO option was one flat key of `model.grpo` (`tests/fixtures/flat_options_run`: the
`config.yaml` and `step2.ckpt` that `cli.py fit` wrote then, options set in every group) goes on unchanged:
`fit --ckpt_path` resumes it to step 3, and `validate`, `test` and `export` take its checkpoint back. Only
the paths of the machine that wrote it change: its tiny random Llama is rebuilt from the same config
(`tiny_model_dir`), and its folders are the test's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from grpo_lightning.cli import build_cli
from tests.helpers import GSM8K_DIR

RUN = Path(__file__).parent / "fixtures" / "flat_options_run"
ONE_BATCH = ["--trainer.limit_val_batches=1", "--trainer.limit_test_batches=1"]  # of 4 problems


@pytest.fixture
def old_run(tiny_model_dir, tmp_path) -> tuple[str, str]:
    """The old run's config with this machine's paths (its flat `model.grpo` kept as written) and a copy of
    its checkpoint whose data source is this machine's copy of the same data."""
    config = yaml.safe_load((RUN / "config.yaml").read_text())
    assert "beta" in config["model"]["grpo"] and "kl" not in config["model"]["grpo"]  # the flat layout
    root = str(tmp_path / "run")
    config["model"]["policy"] = tiny_model_dir
    config["trainer"]["default_root_dir"] = root
    config["trainer"]["logger"]["init_args"]["save_dir"] = root
    config["data"]["init_args"]["source"] = GSM8K_DIR
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    checkpoint = tmp_path / "step2.ckpt"
    saved = torch.load(RUN / "step2.ckpt", weights_only=True, map_location="cpu")
    saved["datamodule_hyper_parameters"]["source"] = GSM8K_DIR  # the data it was trained on, on this machine
    torch.save(saved, checkpoint)
    return str(path), str(checkpoint)


def test_an_old_run_resumes_and_its_checkpoint_validates_tests_and_exports(old_run, tmp_path):
    config, checkpoint = old_run
    saved = torch.load(checkpoint, weights_only=True, map_location="cpu")
    assert saved["global_step"] == 2

    resumed = build_cli(["fit", "--config", config, "--ckpt_path", checkpoint, "--trainer.max_steps=3"])
    assert resumed.trainer.global_step == 3  # on from step 2, not from scratch
    kl = resumed.model.grpo.kl
    assert (kl.beta, kl.estimator) == (0.04, "k2")  # the flat beta and kl_estimator, in their section
    moved = [
        name
        for name, weight in resumed.model.policy.state_dict().items()
        if not torch.equal(weight, saved["state_dict"][f"policy.{name}"])
    ]
    assert moved  # the resumed step trained the checkpoint's weights

    validated = build_cli(["validate", "--config", config, "--ckpt_path", checkpoint, *ONE_BATCH])
    assert "val/accuracy" in validated.trainer.callback_metrics
    tested = build_cli(["test", "--config", config, "--ckpt_path", checkpoint, *ONE_BATCH])
    assert "test/accuracy" in tested.trainer.callback_metrics

    out = tmp_path / "export"
    build_cli(["export", "--config", config, "--ckpt_path", checkpoint, f"--out={out}"])
    model = AutoModelForCausalLM.from_pretrained(out)  # the checkpoint's policy, as users load it
    for name, weight in model.state_dict().items():
        assert torch.equal(weight, saved["state_dict"][f"policy.{name}"]), name
