"""Data modules: TRL-format prompts from any source, GSM8K as a preset, hub data sets without an assumed
configuration, and errors that name the row and field (or what to do offline)."""

import json

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from grpo_lightning.io.rows import collate_rows
from grpo_lightning.training.data.gsm8k import GSM8KDataModule
from grpo_lightning.training.data.prompts import PromptDataModule

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
TRL_ROWS = [
    {"prompt": CHAT, "solution": "5", "level": 1},
    {"prompt": [{"role": "user", "content": "Half of 8?"}], "solution": "4", "level": 2},
    {"prompt": [{"role": "user", "content": "3 * 3?"}], "solution": "9", "level": 1},
]


def write(path, rows: list[dict], kind: str) -> str:
    """`rows` as a .jsonl, .json (an array) or .parquet file."""
    if kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif kind == "json":
        path.write_text(json.dumps(rows))
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def batch_of(data: PromptDataModule) -> dict[str, list]:
    data.setup("fit")
    return collate_rows(sorted(data.train_rows, key=lambda r: r["solution"]), None)


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet"])
def test_trl_format_files_keep_the_prompt_and_pass_every_other_column(tmp_path, kind):
    source = write(tmp_path / f"train.{kind}", TRL_ROWS, kind)
    batch = batch_of(PromptDataModule(source, val_size=0))
    assert set(batch) == {"prompt", "solution", "level"}
    assert batch["prompt"][1] == CHAT  # the conversation as it was, system message included
    assert batch["solution"] == ["4", "5", "9"] and batch["level"] == [2, 1, 1]
    # The same folder layout as GSM8K's: train.* and test.*
    write(tmp_path / f"test.{kind}", TRL_ROWS[:2], kind)
    data = PromptDataModule(str(tmp_path), val_split="test", val_size=5)
    data.setup("fit")
    assert len(data.train_rows) == 3 and [r["solution"] for r in data.val_rows] == ["5", "4"]
    assert data.conversational


def test_standard_prompts_and_a_prompt_column_by_another_name(tmp_path):
    rows = [{"question_text": f"{i} + 1 =", "answer": str(i + 1)} for i in range(4)]
    data = PromptDataModule(
        write(tmp_path / "rows.jsonl", rows, "jsonl"), prompt_field="question_text", val_size=1
    )
    data.setup("fit")
    assert not data.conversational
    row = data.train_rows[0]
    assert set(row) == {"prompt", "answer"} and row["prompt"].endswith("+ 1 =")


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"solution": "5"}, ":2: missing field 'prompt' (has ['solution']); name the prompt column with"),
        ({"prompt": "  ", "solution": "5"}, ":2: field 'prompt' is empty"),
        (
            {"prompt": 5, "solution": "5"},
            ":2: field 'prompt' must be text or a list of chat messages, got int",
        ),
        (
            {"prompt": [{"role": "user"}], "solution": "5"},
            ":2: field 'prompt', message 0: a chat message is ",
        ),
        ({"prompt": "2 + 3?", "solution": "5", "level": 1}, ":1: the prompt is chat messages but at "),
        ({**TRL_ROWS[0], "hint": "add"}, ":2: has column 'hint', unlike the first row ("),
        ({"prompt": CHAT, "level": 1}, ":2: lacks column 'solution', unlike the first row ("),
    ],
)
def test_bad_trl_rows_are_named(tmp_path, row, message):
    source = write(tmp_path / "rows.jsonl", [TRL_ROWS[0], row], "jsonl")
    with pytest.raises(ValueError) as error:
        PromptDataModule(source, val_size=0).setup("fit")
    assert str(error.value).startswith(source) and message in str(error.value)


class FakeHub:
    """`datasets.load_dataset` without a network: records its arguments, serves rows or raises."""

    def __init__(self, rows=None, error: Exception | None = None) -> None:
        self.rows, self.error, self.calls = rows, error, []

    def __call__(self, path, name=None, split=None, **kwargs):
        self.calls.append((path, name, split))
        if self.error is not None:
            raise self.error
        return self.rows[split]


def test_hub_data_sets_load_without_an_assumed_config(monkeypatch):
    rows = {
        split: [{"problem": f"{split} {i}?", "solution": f"{i}\n#### {i}"} for i in range(4)]
        for split in ("train", "test")
    }
    hub = FakeHub(rows)
    monkeypatch.setattr(datasets, "load_dataset", hub)
    data = GSM8KDataModule(
        "someone/math", question_field="problem", answer_field="solution", val_split="test", val_size=2
    )
    data.setup("fit")
    assert hub.calls == [("someone/math", None, "train"), ("someone/math", None, "test")]
    assert data.val_rows[0]["question"] == "test 0?" and data.val_rows[0]["worked_solution"] == "0\n#### 0"
    assert data.train_rows[0]["prompt"][-1] == {"role": "user", "content": data.train_rows[0]["question"]}
    # GSM8K's own hub id keeps its configuration; any other configuration can be named.
    hub.calls.clear()
    GSM8KDataModule(val_size=1)._records("train")
    GSM8KDataModule("someone/math", config_name="socratic")._records("train")
    assert hub.calls == [("openai/gsm8k", "main", "train"), ("someone/math", "socratic", "train")]


def test_an_unreachable_hub_names_the_offline_alternative(monkeypatch):
    error = ConnectionError("Couldn't reach 'someone/math' on the Hub (LocalEntryNotFoundError)")
    monkeypatch.setattr(datasets, "load_dataset", FakeHub(error=error))
    with pytest.raises(ConnectionError) as raised:
        PromptDataModule("someone/math").setup("fit")
    message = str(raised.value)
    assert message.startswith(
        "data.source='someone/math': could not reach the Hugging Face Hub (Couldn't reach"
    )
    assert (
        "no local folder or file of that name exists. Offline, pass a folder holding train.jsonl" in message
    )
    monkeypatch.setattr(datasets, "load_dataset", FakeHub(error=ValueError("Config name is missing.")))
    with pytest.raises(
        ValueError, match=r"data.source='openai/gsm8k' \(config None, split 'train'\): Config name"
    ):
        PromptDataModule("openai/gsm8k").setup("fit")


def test_gsm8k_preset_rows_and_the_arithmetic_task():
    data = GSM8KDataModule(
        source="arithmetic", arithmetic_size=30, val_size=4, train_size=10, system_prompt="S"
    )
    data.setup("fit")
    assert len(data.train_rows) == 10 and len(data.val_rows) == 4
    row = data.val_rows[0]
    assert row["prompt"] == [{"role": "system", "content": "S"}, {"role": "user", "content": row["question"]}]
    assert data.answer_column == "answer" and data.conversational
    # `answer` is the final number, as TRL's and unsloth's GSM8K recipes keep it; the worked solution has
    # its own column.
    assert sorted(row) == ["answer", "prompt", "question", "worked_solution"]
    assert row["worked_solution"].endswith(f"\n#### {row['answer']}") and row["answer"].isdigit()
    # Old callers collate bare question/answer rows: the prompt is built from the question.
    batch = collate_rows([{"question": "q?", "answer": "#### 1"}], "S")
    assert batch == {
        "prompt": [[{"role": "system", "content": "S"}, {"role": "user", "content": "q?"}]],
        "question": ["q?"],
        "answer": ["#### 1"],
    }


def test_test_split_rows_need_the_same_columns_as_each_other(tmp_path):
    write(tmp_path / "train.jsonl", TRL_ROWS, "jsonl")
    write(tmp_path / "test.jsonl", [TRL_ROWS[0], {"prompt": CHAT, "level": 1}], "jsonl")
    with pytest.raises(ValueError) as error:
        PromptDataModule(str(tmp_path), val_split="test").setup("fit")
    assert str(error.value).startswith(
        f"{tmp_path}/test.jsonl:2: lacks column 'solution', unlike the first row ("
    )
    assert f"({tmp_path}/test.jsonl:1, columns ['level', 'prompt', 'solution'])" in str(error.value)
