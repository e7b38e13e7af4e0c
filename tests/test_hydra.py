"""A Hydra-built run, as a Lightning template builds it: a model config with `_target_`, ListConfig values
and `_partial_` rewards, instantiated with `hydra.utils.instantiate`, fitted 2 steps, checkpointed, the
checkpoint read with `torch.load(weights_only=True)`, then tested and predicted from that checkpoint."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from omegaconf import OmegaConf

from grpo_lightning.training.module import GRPOModule
from tests.helpers import ACCURACY_KEYS

CONFIG = """\
model:
  _target_: grpo_lightning.GRPOModule
  policy: ${policy}
  reward_funcs:
    - _target_: tests.test_hparams.scaled_digits
      _partial_: true
      scale: 2.0
    - _target_: tests.helpers.length_reward
      _partial_: true
  reward_weights: [1.0, 0.5]
  grpo:
    _target_: grpo_lightning.GRPOConfig
    num_generations: 2
    max_completion_length: 4
    preflight: false
    log_completions_every: 0
data:
  _target_: grpo_lightning.GSM8KDataModule
  source: arithmetic
  system_prompt: null
  arithmetic_size: 8
  batch_size: 2
  val_size: 2
  val_batch_size: 2
"""


def test_a_hydra_built_run_checkpoints_reloads_tests_and_predicts(tiny_model_dir, tmp_path):
    cfg = OmegaConf.create(CONFIG)
    cfg.policy = tiny_model_dir
    module, data = instantiate(cfg.model), instantiate(cfg.data)
    assert module.reward_names == ["scaled_digits", "length_reward"]
    best = ModelCheckpoint(dirpath=tmp_path / "checkpoints", monitor="val/accuracy", mode="max")
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=2,
        val_check_interval=2,
        limit_val_batches=1,
        logger=CSVLogger(tmp_path),  # the hyper-parameters, written as YAML
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[best],
    )
    trainer.fit(module, data)

    stored = torch.load(best.best_model_path, weights_only=True)["hyper_parameters"]
    assert stored["reward_weights"] == [1.0, 0.5] and type(stored["reward_weights"]) is list
    assert stored["reward_funcs"] == [
        {"_target_": "tests.test_hparams.scaled_digits", "_partial_": True, "scale": 2.0},
        {"_target_": "tests.helpers.length_reward", "_partial_": True},
    ]
    loaded = GRPOModule.load_from_checkpoint(best.best_model_path)
    assert loaded.reward_names == module.reward_names and loaded.reward_funcs[0].keywords == {"scale": 2.0}

    tester = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    (scores,) = tester.test(loaded, data)  # the arithmetic task's test rows: its 2 held-out problems
    assert set(scores) == {f"test/{key}" for key in (*ACCURACY_KEYS, "completion_length")}
    assert scores["test/completion_length"] == pytest.approx(4.0)  # the tiny model never ends early
    # The template's way: the fit's own Trainer, the best checkpoint read back (weights_only, Lightning's
    # default under torch >= 2.6): the same weights, the same greedy scores.
    assert trainer.test(module, data, ckpt_path="best") == [scores]
    (answers,) = tester.predict(loaded, data)
    assert [answer["prompt"] for answer in answers] == [row["prompt"] for row in data.val_rows]
    assert all(len(answer["completions"]) == 1 for answer in answers)  # greedy: one per prompt
    _, again = loaded.rollouts.sample([answers[0]["prompt"]], 1, do_sample=False)
    assert again == answers[0]["completions"]
