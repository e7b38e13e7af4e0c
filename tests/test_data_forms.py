"""Every form a data set comes in trains: `datasets` objects, `save_to_disk` folders and the files that
`datasets.load_dataset` reads (CSV, JSON lines, Parquet, compressed), with the same rows and row-numbered
errors; the columns the reward functions and the validation check need are checked before any training."""

from __future__ import annotations

import gzip
import json

import datasets
import pytest

from grpo_lightning.core.rewards.verifiable import accuracy_reward, completion_text
from grpo_lightning.training.data import PromptDataModule
from tests.helpers import quiet_trainer, tiny_module

ROWS = [{"prompt": f"What is {i} plus 1?", "solution": str(i + 1)} for i in range(6)]
TEST_ROWS = [{"prompt": f"What is {i} plus 1?", "solution": str(i + 1)} for i in range(10, 13)]


def write_form(form: str, folder) -> object:
    """ROWS (and TEST_ROWS as the test split where the form has splits) as `form`."""
    train, test = datasets.Dataset.from_list(ROWS), datasets.Dataset.from_list(TEST_ROWS)
    if form == "Dataset":
        return train
    if form == "DatasetDict":
        return datasets.DatasetDict(train=train, test=test)
    if form == "save_to_disk":
        datasets.DatasetDict(train=train, test=test).save_to_disk(str(folder / "saved"))
        return str(folder / "saved")
    if form == "csv folder":
        (folder / "csv").mkdir()
        train.to_csv(str(folder / "csv" / "train.csv"), index=False)
        test.to_csv(str(folder / "csv" / "test.csv"), index=False)
        return str(folder / "csv")
    if form == ".jsonl.gz":
        with gzip.open(folder / "rows.jsonl.gz", "wt", encoding="utf-8") as f:
            f.writelines(json.dumps(row) + "\n" for row in ROWS)
        return str(folder / "rows.jsonl.gz")
    if form == ".parquet":
        train.to_parquet(str(folder / "rows.parquet"))
        return str(folder / "rows.parquet")
    if form == ".tsv":
        train.to_csv(str(folder / "rows.tsv"), index=False, sep="\t")
        return str(folder / "rows.tsv")
    raise AssertionError(form)


class SolutionReward:
    """TRL's signature for a reward that reads a `solution` column; remembers the (prompt, solution) pairs it
    was given."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []
        self.__name__ = "solution_reward"

    def __call__(self, prompts: list, completions: list, solution: list, **kwargs) -> list[float]:
        self.seen += [(p, str(s)) for p, s in zip(prompts, solution, strict=True)]
        return [
            float(str(s) in completion_text(c)) + len(completion_text(c)) / 10
            for c, s in zip(completions, solution, strict=True)
        ]


@pytest.mark.parametrize(
    ("form", "val_split"),
    [
        ("Dataset", "holdout"),
        ("DatasetDict", "test"),
        ("save_to_disk", "test"),
        ("csv folder", "test"),
        (".jsonl.gz", "holdout"),
        (".parquet", "holdout"),
        (".tsv", "holdout"),
    ],
)
def test_each_form_trains_with_its_columns(tiny_model_dir, tmp_path, form, val_split):
    data = PromptDataModule(
        write_form(form, tmp_path), answer_field="solution", batch_size=2, val_size=2, val_split=val_split
    )
    reward = SolutionReward()
    module = tiny_module(tiny_model_dir, reward_funcs=[reward], max_completion_length=4)
    trainer = quiet_trainer(max_steps=1, limit_val_batches=0)
    trainer.fit(module, data)

    assert trainer.global_step == 1
    expected = {row["prompt"]: row["solution"] for row in ROWS}
    train_prompts = [row["prompt"] for row in data.train_rows]
    held_out = 2 if val_split == "holdout" else 0
    assert len(train_prompts) == len(ROWS) - held_out and set(train_prompts) <= set(expected)
    if val_split == "test":
        assert [row["prompt"] for row in data.val_rows] == [row["prompt"] for row in TEST_ROWS[:2]]
    # Each completion's reward call got its own row's solution (CSV reads "3" as the number 3).
    assert len(reward.seen) == 2 * 2 and all(expected[prompt] == solution for prompt, solution in reward.seen)


@pytest.mark.parametrize(
    ("form", "where"),
    [
        ("Dataset", "Dataset object[train] row 3: field 'prompt' is empty"),
        (".jsonl.gz", "rows.jsonl.gz:4: field 'prompt' is empty"),
        (".tsv", "rows.tsv row 3: field 'prompt' is empty"),
    ],
)
def test_a_bad_row_is_named_by_its_number_in_every_form(tmp_path, monkeypatch, form, where):
    monkeypatch.setitem(ROWS[3], "prompt", " ")
    data = PromptDataModule(write_form(form, tmp_path), answer_field="solution", val_size=1)
    with pytest.raises(ValueError, match=where.replace("[", r"\[").replace("]", r"\]")):
        data.setup("fit")


def test_missing_columns_are_named_before_any_weights_load(tiny_model_dir, monkeypatch):
    def load_model(*args, **kwargs):
        raise AssertionError("the policy's weights loaded before the error")

    monkeypatch.setattr("grpo_lightning.training.module.load_model", load_model)
    trl_rows = datasets.Dataset.from_list(ROWS)  # TRL's format: `solution`, no `answer`

    # Validation reads the answer column, which TRL-format data calls `solution`.
    module = tiny_module(tiny_model_dir, reward_funcs=[SolutionReward()])
    with pytest.raises(
        ValueError, match="validation checks the reference answer in the data column 'answer'"
    ):
        quiet_trainer(max_steps=1).fit(module, PromptDataModule(trl_rows, val_size=2))

    # A reward that needs a column the rows lack (ours reads `answer`; TRL's `solution`).
    module = tiny_module(tiny_model_dir, reward_funcs=[accuracy_reward])
    with pytest.raises(ValueError, match="reward function 'accuracy_reward' needs the data column 'answer'"):
        quiet_trainer(max_steps=1, limit_val_batches=0).fit(module, PromptDataModule(trl_rows, val_size=2))

    # Without validation, the answer column is not needed.
    module = tiny_module(tiny_model_dir, reward_funcs=[SolutionReward()])
    data = PromptDataModule(trl_rows, val_size=2)
    data.setup("fit")
    data.check_columns(module.reward_funcs, None, validates=False)
