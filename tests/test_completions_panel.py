"""The sampled completions where people look: on the console every `log_completions_every` steps, and in
every logger that takes tables (CSV beside the metrics, W&B's and MLflow's `log_table`)."""

from __future__ import annotations

import csv
import os

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, WandbLogger

from grpo_lightning.training.callbacks import completions_panel as monitors
from grpo_lightning.training.callbacks.completions_panel import CompletionsPanel
from grpo_lightning.training.callbacks.completions_table import completion_rows, console_table
from grpo_lightning.training.data import GSM8KDataModule
from grpo_lightning.training.step_metrics import RolloutRecord
from tests.helpers import length_reward, quiet_trainer, tiny_module


def record() -> RolloutRecord:
    return RolloutRecord(
        prompts=[[{"role": "user", "content": "What is 2 + 3?"}], "What is 1 + 1?"],
        completions=["5", "#### 5", "two", "#### 2"],
        reward_names=["accuracy_reward", "format_reward"],
        rewards_per_func=torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0], [1.0, float("nan")]]),
        rewards=torch.tensor([1.0, 2.0, 0.0, 1.0]),
        advantages=torch.tensor([-0.7071, 0.7071, -0.7071, 0.7071]),
        completion_lengths=torch.tensor([2, 4, 3, 4]),
        truncated=torch.tensor([False, False, True, False]),
        num_generations=2,
        entropy=0.5,
        extra={"judge": ["ok", "ok", "no", "ok"]},
    )


def test_rows_hold_every_number_of_each_completion():
    columns, rows = completion_rows(record(), num_prompts=2)
    assert columns == [
        "prompt",
        "completion",
        "accuracy_reward",
        "format_reward",
        "reward",
        "advantage",
        "tokens",
        "cut",
        "judge",
    ]
    assert rows[1] == ["What is 2 + 3?", "#### 5", 1.0, 1.0, 2.0, pytest.approx(0.7071), 4, False, "ok"]
    assert rows[2][0] == "What is 1 + 1?" and rows[2][7] is True
    assert len(completion_rows(record(), num_prompts=1)[1]) == 2  # one group of G = 2


def test_console_text_names_the_prompt_and_each_completion_with_its_numbers():
    lines = console_table(record(), step=7, num_prompts=1).splitlines()
    assert lines[0] == "completions at step 7"
    assert lines[1] == "prompt: What is 2 + 3?"
    assert lines[2].split() == [
        "accuracy_reward",
        "format_reward",
        "reward",
        "advantage",
        "tokens",
        "judge",
    ] + ["completion"]
    assert lines[3].split() == ["1.000", "0.000", "1.000", "-0.707", "2", "ok", "'5'"]
    assert lines[4].split() == ["1.000", "1.000", "2.000", "+0.707", "4", "ok", "'####", "5'"]
    assert len(lines) == 5


class FakeWandb(WandbLogger):
    """WandbLogger's `log_table`, recorded instead of sent (no wandb here)."""

    def __init__(self) -> None:
        self.tables = []

    def log_table(self, key, columns=None, data=None, dataframe=None, step=None) -> None:
        self.tables.append((key, columns, data, step))


class FakeMlflowClient:
    def __init__(self) -> None:
        self.tables = []

    def log_table(self, run_id, data, artifact_file) -> None:
        self.tables.append((run_id, data, artifact_file))


class FakeMlflow(MLFlowLogger):
    """MLFlowLogger's client, recorded instead of sent (no mlflow here)."""

    def __init__(self) -> None:
        self.client = FakeMlflowClient()

    @property
    def experiment(self):
        return self.client

    @property
    def run_id(self) -> str:
        return "run-1"


def test_wandb_and_mlflow_get_the_table(tmp_path):
    wandb, mlflow, csv_logger = FakeWandb(), FakeMlflow(), CSVLogger(str(tmp_path), name="csv")
    CompletionsPanel(num_prompts=2).log_tables([wandb, mlflow, csv_logger], record(), step=3)
    columns, rows = completion_rows(record(), num_prompts=2)

    ((key, logged_columns, data, step),) = wandb.tables
    assert (key, logged_columns, step) == ("completions", columns, 3)
    assert [row[:2] for row in data] == [row[:2] for row in rows] and data[1][4] == 2.0

    ((run_id, table, artifact),) = mlflow.client.tables
    assert (run_id, artifact) == ("run-1", "completions/step_000003.json")
    assert list(table) == columns and table["completion"] == ["5", "#### 5", "two", "#### 2"]
    assert table["cut"] == [False, False, True, False]

    with open(os.path.join(csv_logger.log_dir, "completions.csv"), encoding="utf-8", newline="") as f:
        written = list(csv.reader(f))
    assert written[0] == ["step", *columns] and len(written) == 1 + 4
    assert written[2][:3] == ["3", "What is 2 + 3?", "#### 5"]


@pytest.mark.parametrize("rich", [True, False], ids=["rich", "plain"])
def test_fit_prints_completions_and_writes_them_beside_the_csv_metrics(
    tiny_model_dir, tmp_path, capsys, monkeypatch, rich
):
    if not rich:
        monkeypatch.setattr(monitors, "print_rich_table", lambda *args: False)
    module = tiny_module(tiny_model_dir, reward_funcs=[length_reward], log_completions_every=2)
    logger = CSVLogger(str(tmp_path), name="csv")
    trainer = quiet_trainer(max_steps=3, limit_val_batches=0, logger=logger, log_every_n_steps=1)
    capsys.readouterr()
    trainer.fit(module, GSM8KDataModule("arithmetic", system_prompt=None, batch_size=2, val_size=2))

    printed = capsys.readouterr().out
    assert printed.count("completions at step") == 2  # steps 0 and 2 of 3
    assert "completions at step 0" in printed and "completions at step 2" in printed
    last = module.last_rollout
    assert f"{float(last.rewards[0]):.3f}" in printed.split("completions at step 2")[1]

    with open(os.path.join(logger.log_dir, "completions.csv"), encoding="utf-8", newline="") as f:
        written = list(csv.DictReader(f))
    assert [row["step"] for row in written] == ["0"] * 4 + ["2"] * 4  # 2 prompts x G = 2, twice
    assert [float(row["reward"]) for row in written[4:]] == pytest.approx(last.rewards.tolist())
    assert [row["completion"] for row in written[4:]] == last.completions
