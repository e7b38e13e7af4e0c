"""Bad data ends in one line naming the file, line (or data set, split and row) and field, before any
weights load: rows as they are checked, and files as they are read (valid JSON of another shape is named as
what it is)."""

import json
import os
import tempfile
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from grpo_lightning.cli import build_cli
from grpo_lightning.core.metrics import GSM8KAccuracy
from grpo_lightning.core.rewards.scoring import CALL_KEYWORDS
from grpo_lightning.core.rewards.verifiable import normalize_number, reference_answer
from grpo_lightning.io.rows import CHAT_ROLES, check_prompt, check_row, read_records
from grpo_lightning.training.data.gsm8k import GSM8KDataModule
from grpo_lightning.training.data.prompts import PromptDataModule
from tests.helpers import cli_error, one_error_line, write_rows
from tests.test_interrupt import fit_args

ROW = {"question": "Tom has 2 apples and gets 3 more. How many now?", "answer": "2 + 3 = 5\n#### 5"}


# ------------------------------------------------------------------------------------------ data
@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([ROW, {"question": "q?"}], "rows.jsonl:2: missing field 'answer' (has ['question'])"),
        ([{"answer": "#### 1"}], "rows.jsonl:1: missing field 'question' (has ['answer'])"),
        ([ROW, ROW, {"question": "q?", "answer": "5"}], "rows.jsonl:3: field 'answer' has no final '#### "),
        ([{"question": "  ", "answer": "#### 1"}], "rows.jsonl:1: field 'question' is empty or not a string"),
        (
            [ROW, {**ROW, "answer": 5}],
            "rows.jsonl:2: field 'answer' is the number 5: the GSM8K preset reads ",
        ),
    ],
)
def test_bad_row_names_file_line_and_field(tmp_path, rows, message):
    source = write_rows(tmp_path / "rows.jsonl", rows)
    with pytest.raises(ValueError) as error:  # as the data module's setup, before any weights load
        GSM8KDataModule(source=source, val_size=0).setup("fit")
    assert str(error.value).startswith(f"{tmp_path}/{message}")


def test_missing_and_non_utf8_data_files(tiny_model_dir, tmp_path, capsys, no_weights):
    missing = tmp_path / "absent.jsonl"
    err = cli_error(fit_args(tiny_model_dir, str(tmp_path), 1, f"--data.source={missing}"), capsys)
    assert f"error: data file '{missing}' does not exist" in err

    latin1 = tmp_path / "latin1.jsonl"
    row = json.dumps({"question": "caf\u00e9?", "answer": "#### 1"}, ensure_ascii=False)
    latin1.write_bytes(row.encode("latin-1"))
    err = cli_error(fit_args(tiny_model_dir, str(tmp_path), 1, f"--data.source={latin1}"), capsys)
    assert f"error: {latin1}: not valid UTF-8 (invalid continuation byte at byte " in err


def test_data_files_are_read_by_their_type_in_any_case_and_named_by_their_own_line(
    tiny_model_dir, tmp_path, capsys, no_weights, monkeypatch
):
    import datasets

    monkeypatch.chdir(tmp_path)  # file names as a user types them: "upper.JSONL", not a path from the root

    def rows_of(source: str) -> list:
        data = GSM8KDataModule(source=source, val_size=0)
        data.setup("fit")
        return data.train_rows

    upper = write_rows(tmp_path / "upper.JSONL", [ROW, ROW])  # an existing file: never a hub id
    assert [row["worked_solution"] for row in rows_of("upper.JSONL")] == [ROW["answer"]] * 2
    assert len(rows_of(upper)) == 2
    (tmp_path / "split").mkdir()
    write_rows(tmp_path / "split" / "train.Jsonl", [ROW] * 3)
    assert len(rows_of(str(tmp_path / "split"))) == 3

    text = write_rows(tmp_path / "rows.txt", [ROW])  # JSON lines under another name: not read as them
    with pytest.raises(
        ValueError, match=rf"data file '{text}': its type '.txt' is not one read here \(.jsonl"
    ):
        rows_of(text)
    with pytest.raises(FileNotFoundError, match="data file '.*absent.JSONL' does not exist"):
        rows_of(str(tmp_path / "absent.JSONL"))

    lines = [json.dumps(ROW)] * 12 + ['{"question": "unfinished", '] + [json.dumps(ROW)] * 3
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=f"^{tmp_path}/bad.jsonl:13: not valid JSON \\(Expecting property"):
        rows_of(str(tmp_path / "bad.jsonl"))

    (tmp_path / "twice.csv").write_text("question,answer,answer\nq?,#### 1,#### 2\n")
    with pytest.raises(ValueError) as error:
        rows_of(str(tmp_path / "twice.csv"))
    assert str(error.value) == (
        f"{tmp_path}/twice.csv: the header names column 'answer' twice (columns 2 and 3): every column needs "
        "a name of its own"
    )

    saved = tmp_path / "saved"
    datasets.Dataset.from_list([ROW] * 200).save_to_disk(str(saved))
    (shard,) = saved.glob("*.arrow")
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(ValueError) as error:
        rows_of(str(saved))
    assert str(error.value).startswith(
        f"data folder '{saved}' (written by save_to_disk) cannot be read: its file {shard} is truncated or "
        "damaged ("
    )
    assert "\n" not in str(error.value)

    (tmp_path / "empty.yaml").write_text("# nothing set yet\n")
    err = cli_error(["fit", "--config", str(tmp_path / "empty.yaml")], capsys)
    assert one_error_line(err) == (
        f"error: config {tmp_path}/empty.yaml is empty (or only comments): a config is a mapping of sections "
        "(model:, data:, trainer:)"
    )


@pytest.mark.parametrize("preset", [True, False], ids=["gsm8k", "trl-format"])
def test_a_column_only_some_rows_carry_is_named_before_weights_load(
    tiny_model_dir, tmp_path, capsys, no_weights, preset
):
    if preset:
        rows = [ROW, ROW, {**ROW, "hint": "add"}]
        data = []
    else:
        row = {"prompt": "2 + 3?", "solution": "5"}
        rows = [row, {"prompt": "1 + 1?"}, row]
        data = ["--data=grpo_lightning.training.data.PromptDataModule"]
    source = write_rows(tmp_path / "rows.jsonl", rows)
    err = cli_error(fit_args(tiny_model_dir, str(tmp_path), 1, *data, f"--data.source={source}"), capsys)
    where = f"{source}:3: has column 'hint'" if preset else f"{source}:2: lacks column 'solution'"
    assert f"error: {where}, unlike the first row ({source}:1, columns [" in err
    assert "every row needs the same columns" in err


@pytest.mark.parametrize("keyword", CALL_KEYWORDS)
def test_a_column_named_like_a_reward_keyword_is_refused_at_setup(tmp_path, keyword):
    source = write_rows(
        tmp_path / "rows.jsonl", [{"prompt": "2 + 3?", "answer": "5", keyword: "#### 20"}] * 3
    )
    with pytest.raises(ValueError) as error:
        PromptDataModule(source=source, val_size=1).setup("fit")
    assert str(error.value).startswith(
        f"{source}:1: the data column {keyword!r} has the name of a keyword every reward function is given "
    )


def test_a_completions_column_is_one_line_before_weights_load(tiny_model_dir, tmp_path, capsys, no_weights):
    """TRL-format rows with a `completions` column: the rewards would have scored it instead of the
    samples."""
    source = write_rows(tmp_path / "rows.jsonl", [{"prompt": "2 + 3?", "completions": "#### 20"}] * 4)
    data = ["--data=grpo_lightning.training.data.PromptDataModule", f"--data.source={source}"]
    err = cli_error(fit_args(tiny_model_dir, str(tmp_path), 1, *data), capsys)
    assert one_error_line(err) == (
        f"error: {source}:1: the data column 'completions' has the name of a keyword every reward function "
        "is given (prompts, completions, completion_ids, trainer_state, log_extra, log_metric) and would "
        "replace it: rename the column"
    )


@pytest.mark.parametrize("preset", [True, False], ids=["gsm8k", "trl-format"])
def test_a_prompt_column_beside_the_prompt_field_is_refused(tmp_path, preset):
    """A `prompt` column would replace the prompt built from the question (GSM8K) or read from
    `prompt_field`."""
    source = write_rows(tmp_path / "rows.jsonl", [{**ROW, "prompt": "another question"}] * 3)
    with pytest.raises(ValueError) as error:
        if preset:
            GSM8KDataModule(source=source, val_size=1).setup("fit")
        else:
            PromptDataModule(source=source, prompt_field="question", val_size=1).setup("fit")
    assert str(error.value).startswith(
        f"{source}:1: has a column 'prompt', but the GSM8K preset builds"
        if preset
        else f"{source}:1: has a column 'prompt' beside the prompt column 'question'"
    )


# ------------------------------------------------------------------------------------------ 2. data files
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=6,
)
GOOD_ROW = {"prompt": "2 + 3?", "answer": "5"}


def read_text(text: str, name: str = "rows.jsonl"):
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, name)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return read_records(path), path


class TestDataFilesAsRead:
    @given(st.sampled_from(["rows.jsonl", "rows.json"]), JSON_VALUES, st.booleans())
    def test_valid_json_of_another_shape_is_named_never_invalid(self, name, document, pretty):
        text = json.dumps(document, indent=2 if pretty else None)
        try:
            records, _ = read_text(text, name)
        except ValueError as err:
            assert "not valid JSON" not in str(err)
            assert "a row must be a JSON object" in str(err)
        else:  # read: every record is a row object
            assert all(isinstance(row, dict) for _, row in records)

    @given(JSON_VALUES.filter(lambda v: not isinstance(v, dict)))
    def test_a_first_line_that_is_not_an_object_says_what_it_holds(self, first):
        text = json.dumps(first) + "\n" + json.dumps(GOOD_ROW) + "\n"
        with pytest.raises(ValueError) as error:
            read_text(text)
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(first))
        assert f"rows.jsonl:1: holds {kind or 'a number'}" in str(error.value)
        assert 'but a row must be a JSON object, {"column": value, ...}' in str(error.value)

    def test_broken_json_is_still_named_where_it_breaks(self):
        for text, line in [('{"a": 1}\n{"a": \n', 2), ('[\n {"a": 1},\n {"a": ]\n', 3)]:
            with pytest.raises(ValueError, match=rf"rows.jsonl:{line}: not valid JSON \("):
                read_text(text)

    @given(st.text(min_size=1, max_size=12))
    def test_chat_roles_outside_system_user_assistant_are_refused_with_the_row(self, role):
        prompt = [{"role": "system", "content": "Be brief."}, {"role": role, "content": "2 + 3?"}]
        if role in CHAT_ROLES:
            check_prompt(prompt, "rows.jsonl:7")
            return
        with pytest.raises(ValueError) as error:
            check_prompt(prompt, "rows.jsonl:7")
        assert str(error.value) == (
            f"rows.jsonl:7: field 'prompt', message 1 has role {role!r}: a chat role is one of system, user, "
            "assistant"
        )

    @given(st.integers(-(10**12), 10**12) | st.floats(allow_nan=False, allow_infinity=False, width=32))
    def test_numeric_reference_answers_are_read_as_the_number(self, number):
        assert Fraction(reference_answer(number)) == Fraction(repr(number))
        metric = GSM8KAccuracy()
        metric.update([f"#### {reference_answer(number)}"], [number])
        assert float(metric.compute()["accuracy"]) == 1.0

    @given(st.text(max_size=10))
    def test_a_final_line_that_is_not_a_number_is_refused_at_the_row(self, tail):
        answer = f"2 + 3 = 5\n#### {tail}"
        row = {"question": "2 + 3?", "answer": answer}
        if normalize_number(tail) is not None:
            check_row(row, "rows.jsonl:3")
            return
        with pytest.raises(ValueError) as error:
            check_row(row, "rows.jsonl:3")
        assert str(error.value).startswith("rows.jsonl:3: field 'answer' ")

    @pytest.mark.parametrize(
        ("rows", "message"),
        [
            (
                [ROW, {**ROW, "answer": "#### four"}],
                "rows.jsonl:2: field 'answer' ends in '#### four', which is not",
            ),
            (
                [ROW, {**ROW, "answer": "#### 5 apples"}],
                "rows.jsonl:2: field 'answer' ends in '#### 5 apples', ",
            ),
            ([[ROW], ROW], "rows.jsonl:1: holds an array [{"),
        ],
    )
    def test_the_file_and_line_are_named(self, tmp_path, rows, message):
        source = write_rows(tmp_path / "rows.jsonl", rows)
        with pytest.raises(ValueError) as error:
            GSM8KDataModule(source=source, val_size=0).setup("fit")
        assert str(error.value).startswith(f"{tmp_path}/{message}")

    def test_the_cli_names_file_and_line_before_weights_load(
        self, tiny_model_dir, tmp_path, capsys, no_weights
    ):
        source = write_rows(tmp_path / "rows.jsonl", [ROW, {**ROW, "answer": "#### four"}])
        err = cli_error(fit_args(tiny_model_dir, str(tmp_path), 1, f"--data.source={source}"), capsys)
        assert one_error_line(err).startswith(
            f"error: {source}:2: field 'answer' ends in '#### four', which is"
        )

    def test_trl_rows_with_numbers_as_answers_are_accepted_and_bad_roles_refused(
        self, tiny_model_dir, tmp_path, capsys, no_weights
    ):
        chat = [{"role": "user", "content": "2 + 3?"}]
        good = write_rows(tmp_path / "good.jsonl", [{"prompt": chat, "answer": n} for n in (5, 2.5, -3)])
        data = PromptDataModule(good, val_size=1)
        data.setup("fit")
        assert sorted(r["answer"] for r in data.train_rows + data.val_rows) == [-3, 2.5, 5]

        bad = [{"prompt": chat, "answer": 5}, {"prompt": [{"role": "usr", "content": "2 + 3?"}], "answer": 5}]
        source = write_rows(tmp_path / "bad.jsonl", bad)
        args = fit_args(
            tiny_model_dir, str(tmp_path), 1, "--data=grpo_lightning.training.data.PromptDataModule"
        )
        err = cli_error([*args, f"--data.source={source}"], capsys)
        assert f"error: {source}:2: field 'prompt', message 0 has role 'usr': a chat role is one of " in err


@given(
    key=st.text(st.characters(categories=["L", "N"]), min_size=1, max_size=8),
    rows=st.lists(
        st.fixed_dictionaries({"question": st.text(max_size=5), "answer": st.integers()}), min_size=2
    ),
    others=st.dictionaries(st.sampled_from(["version", "license"]), st.text(max_size=5), max_size=2),
    pretty=st.booleans(),
)
def test_a_json_object_wrapping_the_rows_is_named_with_its_key(key, rows, others, pretty):
    """`{"data": [rows...]}` (a common export): one line naming the key and how many objects it holds."""
    document = {**{k: v for k, v in others.items() if k != key}, key: rows}
    with pytest.raises(ValueError) as error:
        read_text(json.dumps(document, indent=2 if pretty else None), "rows.json")
    assert f"the whole file is one JSON object whose {key!r} holds a list of {len(rows)} objects" in str(
        error.value
    )
    assert f"jq '.{key}'" in str(error.value) and "\n" not in str(error.value)


def test_a_one_row_file_with_a_chat_prompt_is_still_a_row():
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 3?"}]
    records, path = read_text(json.dumps({"prompt": chat, "answer": 5}) + "\n")
    assert [row for _, row in records] == [{"prompt": chat, "answer": 5}]


# ------------------------------------------------------------------------------------------ test and predict
def test_test_and_predict_take_real_splits_extra_columns_and_prompts_alone(tiny_model_dir, tmp_path, capsys):
    """A test split may carry columns the train split has not (an `id`), and lack those nothing judges;
    `predict` answers prompts without any answer column; what a loop does judge is still checked, in one
    line naming its rows, before any weights load."""
    chat = [{"role": "user", "content": "2 + 3?"}]
    folder = tmp_path / "data"
    folder.mkdir()
    write_rows(folder / "train.jsonl", [{"prompt": chat, "answer": n} for n in range(6)])
    write_rows(folder / "test.jsonl", [{"prompt": chat, "answer": 5, "id": f"t{n}"} for n in range(3)])
    prompts = write_rows(tmp_path / "prompts.jsonl", [{"prompt": chat}] * 6)
    args = [
        *fit_args(tiny_model_dir, str(tmp_path), 1, "--data=grpo_lightning.training.data.PromptDataModule")[
            1:
        ],
        "--data.val_size=2",
    ]
    tested, answered = tmp_path / "tested.jsonl", tmp_path / "answers.jsonl"
    build_cli(["test", *args, f"--data.source={folder}", f"--results.path={tested}"])
    lines = [json.loads(line) for line in tested.read_text().splitlines()]
    assert [line["id"] for line in lines] == ["t0", "t1", "t2"] and all(
        line["answer"] == "5" for line in lines
    )
    fitted = build_cli(["fit", *args, f"--data.source={folder}", "--data.val_split=test"])
    assert fitted.trainer.global_step == 1  # validating on that test split trains too

    build_cli(["predict", *args, f"--data.source={prompts}", f"--results.path={answered}"])
    answers = [json.loads(line) for line in answered.read_text().splitlines()]
    assert len(answers) == 2 and all(
        set(a) == {"prompt", "sample", "completion", "extracted"} for a in answers
    )

    write_rows(folder / "test.jsonl", [{"prompt": chat, "id": "t0"}])  # prompts alone: predicted, not tested
    build_cli(
        [
            "predict",
            *args,
            f"--data.source={folder}",
            f"--results.path={answered}",
            "--results.overwrite=true",
        ]
    )
    assert [json.loads(line)["id"] for line in answered.read_text().splitlines()] == ["t0"]
    capsys.readouterr()
    for source in (folder, prompts):
        with pytest.MonkeyPatch.context() as patch:  # refused before any weights load
            patch.setattr("grpo_lightning.training.module.load_model", lambda *a, **k: 1 / 0)
            err = cli_error(["test", *args, f"--data.source={source}"], capsys)
        assert one_error_line(err).startswith(
            "error: validation checks the reference answer in the data column 'answer', which the test rows "
            "lack (they have ["
        )
