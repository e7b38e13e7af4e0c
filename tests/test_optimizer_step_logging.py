"""The `train/...` metrics of a real fit, as a CSVLogger writes them: one row per optimizer step at its
index (the optimizer steps before it), every `log_every_n_steps` optimizer steps as TRL's `logging_steps`,
each with the loss, statistics and learning rate of its own update; the rollout's metrics once per rollout,
in the first row of its optimizer steps that is written."""

import csv

import lightning as L
import pytest
from lightning.pytorch.loggers import CSVLogger

from grpo_lightning.training.data import GSM8KDataModule
from tests.helpers import length_reward, quiet_trainer, tiny_module

LR = 0.05


def fit_and_read_rows(
    tiny_model_dir, tmp_path, steps_per_generation, training_steps, log_every_n_steps, first=False
):
    """Fit `training_steps` rollouts of 2 prompts under a linear schedule over the run's optimizer steps;
    the rows of metrics.csv, and each optimizer step's loss as its update computed it."""
    L.seed_everything(0)
    optimizer_steps = training_steps * steps_per_generation
    module = tiny_module(
        tiny_model_dir,
        reward_funcs=[length_reward],
        num_generations=4,
        steps_per_generation=steps_per_generation,
        learning_rate=LR,
        lr_scheduler_type="linear",
        logging_first_step=first,
    )
    losses = []
    original = module.optimization.optimizer_step

    def record(*args):
        stats, grad_norm = original(*args)
        losses.append(float(stats["loss"]))
        return stats, grad_norm

    module.optimization.optimizer_step = record
    data = GSM8KDataModule(
        source="arithmetic", system_prompt=None, arithmetic_size=20, batch_size=2, val_size=2
    )
    logger = CSVLogger(str(tmp_path), name="logs", version=0)
    trainer = quiet_trainer(
        max_steps=optimizer_steps, limit_val_batches=0, logger=logger, log_every_n_steps=log_every_n_steps
    )
    trainer.fit(module, data)
    assert trainer.global_step == optimizer_steps == len(losses)
    with open(f"{logger.log_dir}/metrics.csv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    return rows, losses


def steps_with(rows: list[dict], key: str) -> list[int]:
    return [int(row["step"]) for row in rows if row.get(key)]


def test_each_optimizer_step_has_its_row_and_each_rollout_its_metrics_once(tiny_model_dir, tmp_path):
    """steps_per_generation=2, 2 training steps: 4 rows of update metrics at steps 0..3, each with its own
    update's loss and the learning rate it used (linear decay over 4 steps: lr x (1 - s/4)), and the
    rollout's reward at steps 0 and 2, the first optimizer step of each rollout."""
    rows, losses = fit_and_read_rows(tiny_model_dir, tmp_path, 2, 2, log_every_n_steps=1)
    for key in ("train/loss", "train/kl", "train/entropy", "train/clip_ratio/region_mean", "train/grad_norm"):
        assert steps_with(rows, key) == [0, 1, 2, 3], key
    update_rows = [row for row in rows if row.get("train/loss")]
    assert [float(row["train/loss"]) for row in update_rows] == pytest.approx(losses, rel=1e-6)
    assert len(set(losses)) == 4  # each row holds its own update's loss, not the rollout's last
    rates = [float(row["train/learning_rate"]) for row in update_rows]
    assert rates == pytest.approx([LR * (1 - s / 4) for s in range(4)])
    for key in ("train/reward", "train/completion_length", "train/generate_seconds", "train/skipped_steps"):
        assert steps_with(rows, key) == [0, 2], key
    # A rollout's metrics share the row of its first optimizer step.
    assert all(row.get("train/loss") for row in rows if row.get("train/reward"))


def test_log_every_n_steps_counts_optimizer_steps(tiny_model_dir, tmp_path):
    """log_every_n_steps=3 over 6 optimizer steps of 3 rollouts: the 3rd and 6th optimizer steps are
    written (TRL's logging_steps=3 writes global steps 3 and 6), at indices 2 and 5; the rollouts those
    steps belong to (the 2nd: steps 2-3, the 3rd: steps 4-5) give their reward there, the 1st none."""
    rows, losses = fit_and_read_rows(tiny_model_dir, tmp_path, 2, 3, log_every_n_steps=3)
    assert steps_with(rows, "train/loss") == [2, 5]
    written = [float(row["train/loss"]) for row in rows if row.get("train/loss")]
    assert written == pytest.approx([losses[2], losses[5]], rel=1e-6)
    assert steps_with(rows, "train/reward") == [2, 5]


def test_one_optimizer_step_per_rollout_writes_one_row_per_training_step(tiny_model_dir, tmp_path):
    """The default: the update's, the rollout's and the monitors' metrics in one row per training step, at
    Lightning's own step numbers (0, 1, 2)."""
    rows, losses = fit_and_read_rows(tiny_model_dir, tmp_path, 1, 3, log_every_n_steps=1)
    assert [int(row["step"]) for row in rows] == [0, 1, 2]
    for row in rows:
        assert row["train/loss"] and row["train/reward"] and row["train/learning_rate"]
        assert row["monitor/frac_identical_groups"]  # CollapseMonitor's, logged after the training step
    assert [float(row["train/loss"]) for row in rows] == pytest.approx(losses, rel=1e-6)


@pytest.mark.parametrize("steps_per_generation", [1, 2])
def test_logging_first_step_also_writes_the_first_optimizer_step(
    tiny_model_dir, tmp_path, steps_per_generation
):
    """TRL's logging_first_step with logging_steps 3: global steps 1, 3 and 6 (indices 0, 2, 5), whether
    Lightning writes the rows (one optimizer step per rollout) or the module does."""
    rows, losses = fit_and_read_rows(
        tiny_model_dir,
        tmp_path,
        steps_per_generation,
        6 // steps_per_generation,
        log_every_n_steps=3,
        first=True,
    )
    assert steps_with(rows, "train/loss") == [0, 2, 5]
    written = [float(row["train/loss"]) for row in rows if row.get("train/loss")]
    assert written == pytest.approx([losses[0], losses[2], losses[5]], rel=1e-6)
    assert 0 in steps_with(rows, "train/reward")
