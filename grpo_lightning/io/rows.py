"""Data rows: reading data files, checking each row (errors name the file and line, or the data set, split
and row, and the field at fault), and building the prompts of a batch.

No Lightning here: the data modules (`grpo_lightning/training/data.py`) and the validation sets read rows
through these functions.
"""

from __future__ import annotations

import json
import math
import os

from grpo_lightning.core.rewards.verifiable import reference_answer

DEFAULT_SYSTEM_PROMPT = (
    "Solve the math problem step by step. On the last line, write only the final answer as '#### <number>'."
)
DATA_FILE_TYPES = (".jsonl", ".json", ".parquet")

Row = dict[str, object]


def _read_lines(path: str) -> list[str]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file {path!r} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            return f.readlines()
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not valid UTF-8 ({err.reason} at byte {err.start})") from None


# What a row is, in a data file's own terms, for messages about one that is something else.
ROW_SHAPE = 'a JSON object, {"column": value, ...}: one per line (JSON lines) or a JSON array of them'


def _json_kind(value: object) -> str:
    """What a parsed JSON value is, in JSON's terms, with its start: `an array [1, 2]`."""
    kinds = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    kind = kinds.get(type(value), "a number")
    return kind if value is None else f"{kind} {json.dumps(value, ensure_ascii=False)[:60]}"


def _wrapping_key(document: object) -> str | None:
    """The key of a JSON object that wraps the rows in a list (`{"data": [{...}, {...}]}`), or None. Chat
    messages, a list of objects that a row's prompt may hold, are not rows."""
    if not isinstance(document, dict):
        return None
    return next(
        (
            key
            for key, value in document.items()
            if isinstance(value, list)
            and len(value) > 1
            and all(isinstance(item, dict) and "role" not in item for item in value)
        ),
        None,
    )


def _rows_of(records: list[tuple[str, object]]) -> list[tuple[str, object]]:
    """The records, each checked to be a row object: anything else is named with what it holds."""
    for where, row in records:
        if not isinstance(row, dict):
            raise ValueError(f"{where}: holds {_json_kind(row)}, but a row must be {ROW_SHAPE}")
    return records


def read_records(path: str) -> list[tuple[str, object]]:
    """The raw rows of a `.jsonl`, `.json` (an array of objects, or JSON lines) or `.parquet` file, each with
    where it comes from (`file:line`, `file[i]` or `file row i`) for error messages. Valid JSON of another
    shape (a line holding an array, one object spread over lines) is named as what it is, never as invalid."""
    if path.endswith(".parquet"):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"data file {path!r} does not exist")
        import pyarrow.parquet  # comes with `datasets`; only parquet files need it

        try:
            table = pyarrow.parquet.read_table(path)
        except Exception as err:  # pyarrow raises its own types for a file that is not parquet
            raise ValueError(f"{path}: not a readable parquet file ({err})") from None
        return [(f"{path} row {i}", row) for i, row in enumerate(table.to_pylist())]
    lines = _read_lines(path)
    whole_error = None
    try:
        document = json.loads("".join(lines))
    except json.JSONDecodeError as err:
        whole_error = err  # JSON lines ("Extra data" after line 1's value), or one broken document
    else:
        if isinstance(document, list):
            return _rows_of([(f"{path}[{i}]", row) for i, row in enumerate(document)])
        if key := _wrapping_key(document):
            raise ValueError(
                f"{path}: the whole file is one JSON object whose {key!r} holds a list of "
                f"{len(document[key])} objects, but a row must be {ROW_SHAPE}: write that list alone to the "
                f"file (e.g. jq '.{key}')"
            )
        if sum(bool(line.strip()) for line in lines) > 1:  # one document over several lines: not rows
            raise ValueError(
                f"{path}: the whole file is one JSON document, {_json_kind(document)}, but a row "
                f"must be {ROW_SHAPE}"
            )
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append((f"{path}:{number}", json.loads(line)))
        except json.JSONDecodeError as err:
            # One document spread over lines (a pretty array) is reported where it breaks.
            spread = whole_error.msg != "Extra data" and whole_error.lineno > number
            error = whole_error if spread else err
            raise ValueError(f"{path}:{error.lineno}: not valid JSON ({error.msg})") from None
    return _rows_of(records)


def _check_text(row: dict, field: str, where: str) -> str:
    if field not in row:
        raise ValueError(f"{where}: missing field {field!r} (has {sorted(row)})")
    if not isinstance(row[field], str) or not row[field].strip():
        raise ValueError(f"{where}: field {field!r} is empty or not a string")
    return row[field]


def check_row(row: object, where: str, question_field: str = "question", answer_field: str = "answer") -> Row:
    """Return the row with `question` and `answer` keys, or raise naming `where` and the field at fault."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    question = _check_text(row, question_field, where)
    if isinstance(row.get(answer_field), int | float) and not isinstance(row[answer_field], bool):
        raise ValueError(
            f"{where}: field {answer_field!r} is the number {row[answer_field]!r}: the GSM8K preset reads a "
            f"worked solution ending in '#### <number>'; rows whose answer is a number read as they are "
            f"with data.class_path grpo_lightning.training.data.PromptDataModule and data.prompt_field "
            f"{question_field}"
        )
    answer = _check_text(row, answer_field, where)
    if "####" not in answer or not answer.rsplit("####", 1)[1].strip():
        raise ValueError(
            f"{where}: field {answer_field!r} has no final '#### <number>' line: {answer[-80:]!r}"
        )
    check_answer(answer, where, answer_field)
    out = {k: v for k, v in row.items() if k not in (question_field, answer_field)}
    out.update(question=question, answer=answer)
    return out


def check_answer(answer: object, where: str, field: str = "answer") -> None:
    """A reference answer that validation can read: a finite number (TRL-format data often holds ints), or
    text whose final `#### ` line, where it has one (GSM8K's form), holds a number. Other text passes: it
    is for a `val_reward` such as math-verify to judge."""
    if isinstance(answer, float) and not math.isfinite(answer):
        raise ValueError(f"{where}: field {field!r} is {answer}: a reference answer must be a finite number")
    if isinstance(answer, str) and "####" in answer:
        try:
            reference_answer(answer)
        except ValueError:
            final = answer.rpartition("####")[2].strip()
            raise ValueError(
                f"{where}: field {field!r} ends in '#### {final}', which is not a number: write the final "
                "answer as '#### <number>' (digits, e.g. '#### 5', no units or words)"
            ) from None


CHAT_ROLES = ("system", "user", "assistant")  # the turns that every chat template renders


def check_prompt(prompt: object, where: str, field: str = "prompt") -> None:
    """A prompt is non-empty text or a non-empty list of `{"role": str, "content": str}` messages whose
    roles are system, user or assistant (a template renders another role as a turn the model never saw, or
    not at all)."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError(f"{where}: field {field!r} is empty")
        return
    if not isinstance(prompt, list) or not prompt:
        raise ValueError(
            f"{where}: field {field!r} must be text or a list of chat messages, got {type(prompt).__name__}"
        )
    for i, message in enumerate(prompt):
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise ValueError(
                f"{where}: field {field!r}, message {i}: a chat message is {{'role': str, 'content': str}}, "
                f"got {str(message)[:80]!r}"
            )
        if message["role"] not in CHAT_ROLES:
            raise ValueError(
                f"{where}: field {field!r}, message {i} has role {message['role']!r}: a chat role is one of "
                f"{', '.join(CHAT_ROLES)}"
            )


def check_same_columns(rows: list[Row], wheres: list[str]) -> None:
    """Every row has the first row's columns: a column that only some rows carry cannot be batched."""
    if not rows:
        return
    first = set(rows[0])
    for row, where in zip(rows, wheres, strict=True):
        if set(row) != first:
            missing, extra = sorted(first - set(row)), sorted(set(row) - first)
            what = f"lacks column {missing[0]!r}" if missing else f"has column {extra[0]!r}"
            raise ValueError(
                f"{where}: {what}, unlike the first row ({wheres[0]}, columns {sorted(first)}): every row "
                "needs the same columns"
            )
    kinds = {isinstance(row["prompt"], list) for row in rows}
    if len(kinds) > 1:
        chat = next(w for row, w in zip(rows, wheres, strict=True) if isinstance(row["prompt"], list))
        text = next(w for row, w in zip(rows, wheres, strict=True) if not isinstance(row["prompt"], list))
        raise ValueError(f"{chat}: the prompt is chat messages but at {text} it is text: use one kind")


def chat_prompt(question: str, system_prompt: str | None) -> list[dict[str, str]]:
    """The conversational prompt: an optional system message, then the question as the user's turn."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return messages + [{"role": "user", "content": question}]


def collate_rows(rows: list[Row], system_prompt: str | None) -> dict[str, list]:
    """A batch as a dict of lists: each row's `prompt` (built from its `question` when it has none) plus
    every other column of the rows."""
    batch: dict[str, list] = {
        "prompt": [r["prompt"] if "prompt" in r else chat_prompt(r["question"], system_prompt) for r in rows]
    }
    for key in rows[0]:
        if key != "prompt":
            batch[key] = [r[key] for r in rows]
    return batch


def read_split_records(source: str, config_name: str | None, split: str) -> list[tuple[str, object]]:
    """Raw rows of a split of `source` (a folder of `<split>` files, one file, or a hub data set) with
    where each comes from; hub failures say what to do offline."""
    if os.path.isdir(source):
        names = [f"{split}{ext}" for ext in DATA_FILE_TYPES]
        found = [os.path.join(source, n) for n in names if os.path.isfile(os.path.join(source, n))]
        if not found:
            raise FileNotFoundError(f"data folder {source!r} has none of {names}")
        return read_records(found[0])
    if source.endswith(DATA_FILE_TYPES) or source.startswith((".", "/", "~")):
        if split != "train":
            raise ValueError(f"data.source={source!r} is a single file: use val_split='holdout'")
        return read_records(os.path.expanduser(source))
    return _hub_records(source, config_name, split)


def _hub_records(source: str, config_name: str | None, split: str) -> list[tuple[str, object]]:
    import datasets  # only for hub data sets: local files need no `datasets` import

    try:
        ds = datasets.load_dataset(source, config_name, split=split)
    except ConnectionError as err:
        raise ConnectionError(
            f"data.source={source!r}: could not reach the Hugging Face Hub ({err}), and no local "
            "folder or file of that name exists. Offline, pass a folder holding train.jsonl (and "
            "test.jsonl) or a .jsonl / .json / .parquet file as data.source (a hub data set saved once "
            "with `datasets.load_dataset(...)[split].to_json(path)`), or `source: arithmetic` for GSM8K"
        ) from None
    except (OSError, ValueError) as err:  # no such data set, config or split
        raise ValueError(f"data.source={source!r} (config {config_name!r}, split {split!r}): {err}") from None
    return [(f"{source}[{split}] row {i}", row) for i, row in enumerate(ds)]
