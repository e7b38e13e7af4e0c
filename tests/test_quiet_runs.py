"""Quiet runs: a 2-step fit with validation, step-cadence checkpoints and a logger, in one process and on 2
DDP ranks, warns of nothing but what is listed here (what the user can act on, or what is not ours): any new
warning fails. Its progress bar counts the epochs its `max_steps` take."""

from __future__ import annotations

import json
import os
import warnings

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from grpo_lightning.training.module import GRPOModule
from tests.helpers import arithmetic_data, length_reward, tiny_module

# Each warning a 2-step fit on the tiny model may give, by its start, and why it stays.
EXPECTED = (
    # Lightning 2.6.6's own use of torch 2.13's pytree: theirs, nothing a user changes.
    "`isinstance(treespec, LeafSpec)` is deprecated",
    # The random tiny model never ends a completion: a real run's truncation, which it names the option for.
    "all 4 completions of this step reached max_completion_length=4",
    "all 2 completions of this step reached max_completion_length=4",  # a DDP rank's share of them
)


class EpochTotal(L.Callback):
    """The `max_epochs` the progress bar shows (`Epoch n/max_epochs - 1`) when each training epoch starts."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.seen.append(trainer.max_epochs)


def fit_counting_warnings(cfg: dict) -> None:
    """2 steps (2 prompts each) on 4 rows per rank, validated at step 2, a checkpoint every step; every
    warning it gives and the epoch totals written to `<out>/rank<r>.json`."""
    module = tiny_module(cfg["model"], GRPOModule, reward_funcs=[length_reward], max_completion_length=4)
    epochs, checkpoints = EpochTotal(), os.path.join(cfg["out"], "checkpoints")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = L.Trainer(
            accelerator="cpu",
            devices=cfg["devices"],
            strategy=cfg["strategy"],
            max_steps=2,
            val_check_interval=2,
            limit_val_batches=1,
            log_every_n_steps=1,
            enable_progress_bar=False,
            logger=CSVLogger(cfg["out"]),
            callbacks=[ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=1, save_top_k=-1), epochs],
        )
        trainer.fit(module, arithmetic_data(4 * cfg["devices"]))
    record = {"warnings": [str(w.message) for w in caught], "epochs": epochs.seen}
    with open(os.path.join(cfg["out"], f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(record, f)


def unexpected(messages: list[str]) -> list[str]:
    return [message for message in messages if not message.startswith(EXPECTED)]


def test_a_fit_warns_only_of_what_is_listed_and_counts_its_epochs(tiny_model_dir, tmp_path):
    fit_counting_warnings({"model": tiny_model_dir, "out": str(tmp_path), "devices": 1, "strategy": "auto"})
    record = json.load(open(tmp_path / "rank0.json"))
    assert unexpected(record["warnings"]) == []
    assert len(os.listdir(tmp_path / "checkpoints")) == 2  # one per step
    assert record["epochs"] == [1]  # 2 steps of the 2 batches of one epoch: `Epoch 0/0`, not `Epoch 0/-2`


def two_rank_jobs(model: str, out: str) -> list[dict]:
    """This file's run in the launch of tests/two_ranks.py: the fit above on 2 DDP ranks, first of the
    launch, so that no earlier run has used up Lightning's once-per-process warnings."""
    cfg = {"model": model, "out": os.path.join(out, "ddp"), "devices": 2, "strategy": "ddp"}
    os.makedirs(cfg["out"])
    return [{"call": "tests.test_quiet_runs:fit_counting_warnings", "cfg": cfg}]


def test_a_two_rank_fit_with_checkpoints_warns_only_of_what_is_listed(two_rank_runs):
    out = os.path.join(two_rank_runs, "test_quiet_runs", "ddp")
    for rank in (0, 1):
        record = json.load(open(os.path.join(out, f"rank{rank}.json")))
        assert unexpected(record["warnings"]) == [], rank
        assert record["epochs"] == [1]
