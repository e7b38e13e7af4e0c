"""Data rows: reading data sets, checking each row (errors name the file and line, or the data set, split
and row, and the field at fault), and building the prompts of a batch.

Rows come from whatever `datasets` holds or reads: a `datasets.Dataset` or `DatasetDict` object, a folder
written by `save_to_disk`, a folder of `<split>.<type>` files, one file, or a hub data set. JSON and JSON
lines files (compressed or not) are read here, so that an error names the file and line; CSV, TSV, Arrow,
Parquet and the rest go through `datasets.load_dataset` and are named by row.

No Lightning here: the data modules (`grpo_lightning/training/data.py`) and the validation sets read rows
through these functions.
"""

from __future__ import annotations

import bz2
import csv
import gzip
import json
import lzma
import math
import os
from typing import Any

from grpo_lightning.core.rewards.scoring import check_column_names
from grpo_lightning.core.rewards.verifiable import WORKED_SOLUTION, reference_answer

DEFAULT_SYSTEM_PROMPT = (
    "Solve the math problem step by step. On the last line, write only the final answer as '#### <number>'."
)
JSON_TYPES = (".jsonl", ".json")
# The `datasets.load_dataset` builder of each table type, with its options.
TABLE_TYPES = {
    ".parquet": ("parquet", {}),
    ".csv": ("csv", {}),
    ".tsv": ("csv", {"delimiter": "\t"}),
    ".arrow": ("arrow", {}),
}
COMPRESSIONS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}  # read by extension, as `datasets` does
DATA_FILE_TYPES = tuple(
    kind + compression for kind in (*JSON_TYPES, *TABLE_TYPES) for compression in ("", *COMPRESSIONS)
)

Row = dict[str, object]


def _file_type(path: str) -> tuple[str, str]:
    """(type, compression) by the file's extensions, whatever their case: (".jsonl", ".gz") for
    `train.JSONL.gz`."""
    stem, compression = os.path.splitext(path)
    if compression.lower() not in COMPRESSIONS:
        stem, compression = path, ""
    return os.path.splitext(stem)[1].lower(), compression.lower()


def _is_data_file(path: str) -> bool:
    """Whether `path` is named as a data file of a type read here (`DATA_FILE_TYPES`, any case)."""
    return path.lower().endswith(DATA_FILE_TYPES)


def _check_file_type(path: str) -> None:
    kind, _ = _file_type(path)
    if kind not in JSON_TYPES and kind not in TABLE_TYPES:
        types = ", ".join((*JSON_TYPES, *TABLE_TYPES))
        raise ValueError(
            f"data file {path!r}: its type {kind or '(no extension)'!r} is not one read here ({types}, or "
            f"compressed: {', '.join(COMPRESSIONS)}); rename it to its type, e.g. rows.jsonl for JSON lines"
        )


def _read_lines(path: str) -> list[str]:
    opener = COMPRESSIONS.get(_file_type(path)[1])
    try:
        if opener is None:
            with open(path, encoding="utf-8") as f:
                return f.readlines()
        with opener(path, "rt", encoding="utf-8") as f:
            return f.readlines()
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not valid UTF-8 ({err.reason} at byte {err.start})") from None
    except (OSError, EOFError, lzma.LZMAError) as err:  # a file that is not what its extension says
        raise ValueError(f"{path}: cannot decompress it ({err})") from None


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
    """The raw rows of a data file, each with where it comes from for error messages: `file:line` or
    `file[i]` for `.jsonl` / `.json` (an array of objects, or JSON lines; also compressed, `.jsonl.gz`), `file
    row i` for the table types (`.parquet`, `.csv`, `.tsv`, `.arrow`, read by `datasets.load_dataset`).
    Valid JSON of another shape (a line holding an array, one object spread over lines) is named as what it
    is, never as invalid."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file {path!r} does not exist")
    _check_file_type(path)
    kind, _ = _file_type(path)
    if kind in TABLE_TYPES:
        return _table_records(path, *TABLE_TYPES[kind])
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
            line_number = whole_error.lineno if spread else number  # err counts the lines of `line` alone
            message = whole_error.msg if spread else err.msg
            raise ValueError(f"{path}:{line_number}: not valid JSON ({message})") from None
    return _rows_of(records)


def _check_text(row: dict, field: str, where: str) -> str:
    if field not in row:
        raise ValueError(f"{where}: missing field {field!r} (has {sorted(row)})")
    if not isinstance(row[field], str) or not row[field].strip():
        raise ValueError(f"{where}: field {field!r} is empty or not a string")
    return row[field]


def check_row(row: object, where: str, question_field: str = "question", answer_field: str = "answer") -> Row:
    """Return the row with `question`, `answer` (the final number after `####`, as the answer column of
    TRL's and unsloth's GSM8K recipes holds it) and `worked_solution` (the whole worked solution) keys, or
    raise naming `where` and the field at fault."""
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
    if WORKED_SOLUTION in row and answer_field != WORKED_SOLUTION:
        raise ValueError(
            f"{where}: has a column {WORKED_SOLUTION!r}, which the GSM8K preset fills from {answer_field!r}: "
            "rename the column"
        )
    out = {k: v for k, v in row.items() if k not in (question_field, answer_field)}
    out.update(question=question, answer=reference_answer(answer), **{WORKED_SOLUTION: answer})
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


ENVIRONMENT_COLUMN = "environment"  # the column naming a row's environment (`environment_factory`)
ENVIRONMENT_PROMPT = [{"role": "user", "content": ""}]
"""The prompt of a row that has none but an `environment` column, as TRL's: an empty user turn, which the
environment's `reset(**row)` writes (its returned text is appended to it); `reset` is not given it."""


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
    """Every row has the first row's columns: a column that only some rows carry cannot be batched; and
    none of them is named like a keyword every reward function is given (`scoring.check_column_names`)."""
    if not rows:
        return
    first = set(rows[0])
    check_column_names(sorted(first), wheres[0])
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


def chat_prompt(question: str, system_prompt: str | None, few_shot: list[dict] | None = None) -> list[dict]:
    """The conversational prompt: an optional system message, the `few_shot` turns (`check_few_shot`), then
    the question as the user's turn."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return messages + [dict(m) for m in few_shot or ()] + [{"role": "user", "content": question}]


FEW_SHOT_ROLES = ("user", "assistant", "tool")


def check_few_shot(messages: object) -> None:
    """`data.few_shot`: a conversation that a prompt's question follows, so a list of `{"role", "content"}`
    messages (a tool turn may add the tool's `name`; an assistant turn writes its calls as text, in the
    model's tool-call format) whose roles are user, assistant or tool, opening with a user turn and closing
    with an assistant's; else `ValueError` naming the message."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"data.few_shot: a non-empty list of chat messages, got {str(messages)[:80]!r}")
    for i, message in enumerate(messages):
        if not (
            isinstance(message, dict)
            and message.get("role") in FEW_SHOT_ROLES
            and isinstance(message.get("content"), str)
        ):
            raise ValueError(
                f"data.few_shot[{i}]: a message is {{'role': {' | '.join(FEW_SHOT_ROLES)}, 'content': str}}, "
                f"got {str(message)[:80]!r}"
            )
    for i, role, why in ((0, "user", "open"), (-1, "assistant", "close")):
        if messages[i]["role"] != role:
            raise ValueError(
                f"data.few_shot[{i % len(messages)}] has role {messages[i]['role']!r}: the examples must "
                f"{why} with the {role}'s turn, so that each question follows an answer"
            )


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


def _table_records(path: str, builder: str, options: dict) -> list[tuple[str, object]]:
    if builder == "csv":
        _check_header(path, options.get("delimiter", ","))
    import datasets  # only the table types need it

    try:
        table = datasets.load_dataset(builder, data_files=path, split="train", **options)
    except Exception as err:  # pyarrow and datasets raise their own types for a file of another kind
        raise ValueError(f"{path}: not a readable {builder} file ({type(err).__name__}: {err})") from None
    return [(f"{path} row {i}", row) for i, row in enumerate(table)]


def _check_header(path: str, delimiter: str) -> None:
    """Refuse a CSV / TSV header that names a column twice: pandas would rename the second `answer.1`."""
    opener = COMPRESSIONS.get(_file_type(path)[1], open)
    try:
        with opener(path, "rt", encoding="utf-8", newline="") as f:
            header = next(csv.reader(f, delimiter=delimiter), [])
    except (OSError, EOFError, UnicodeDecodeError, lzma.LZMAError, csv.Error):
        return  # not readable as text: `datasets` names the file when it fails on it
    seen: dict[str, int] = {}
    for number, name in enumerate(header, start=1):
        if name in seen:
            raise ValueError(
                f"{path}: the header names column {name!r} twice (columns {seen[name]} and {number}): every "
                "column needs a name of its own"
            )
        seen[name] = number


def is_dataset(source: object) -> bool:
    """Whether `source` is a `datasets.Dataset` or `DatasetDict` object (checked without importing
    `datasets` for a path)."""
    if isinstance(source, str):
        return False
    import datasets

    return isinstance(source, datasets.Dataset | datasets.DatasetDict)


def has_split(source: object, split: str) -> bool:
    """Whether `source` may hold `split` beside its training rows: a `DatasetDict` holding it, a folder, a
    hub data set; not one `Dataset` or one file, which are the training rows alone."""
    if is_dataset(source):
        return isinstance(source, dict) and split in source
    if os.path.isdir(source):
        return True
    return not (source.endswith(DATA_FILE_TYPES) or source.startswith((".", "/", "~")))


def _dataset_records(data: Any, split: str, name: str) -> list[tuple[str, object]]:
    """The rows of a `Dataset` (one split: "train") or of a `DatasetDict`'s `split`."""
    return [(f"{name}[{split}] row {i}", row) for i, row in enumerate(_split_of(data, split, name))]


def _split_of(data: Any, split: str, name: str) -> Any:
    """A `Dataset` (one split: "train"), or a `DatasetDict`'s `split`."""
    import datasets

    if isinstance(data, datasets.DatasetDict):
        if split not in data:
            raise ValueError(f"{name} has no {split!r} split (it has {sorted(data)})")
        data = data[split]
    elif split != "train":
        raise ValueError(
            f"{name} is one Dataset, the training rows: use val_split='holdout', or give a DatasetDict "
            f"with a {split!r} split"
        )
    return data


def _saved_to_disk(folder: str) -> bool:
    """A folder that `Dataset.save_to_disk` or `DatasetDict.save_to_disk` wrote."""
    return any(os.path.isfile(os.path.join(folder, n)) for n in ("dataset_dict.json", "state.json"))


def read_split_records(source: object, config_name: str | None, split: str) -> list[tuple[str, object]]:
    """Raw rows of a split of `source` with where each comes from: a `Dataset` / `DatasetDict` object, a
    `save_to_disk` folder, a folder of `<split>.<type>` files (or any folder `datasets.load_dataset` reads),
    one file, or a hub data set; hub failures say what to do offline."""
    if is_dataset(source):
        return _dataset_records(source, split, f"{type(source).__name__} object")
    if os.path.isdir(source):
        if _saved_to_disk(source):
            return _saved_records(source, split)
        names = {f"{split}{ext}" for ext in DATA_FILE_TYPES}
        found = sorted(
            n for n in os.listdir(source) if n.lower() in names and os.path.isfile(os.path.join(source, n))
        )
        if found:
            return read_records(os.path.join(source, found[0]))
        return _folder_records(source, split)
    path = os.path.expanduser(source)
    # A file that exists, or a name that only a file has: never a hub id.
    if os.path.isfile(path) or _is_data_file(source) or source.startswith((".", "/", "~")):
        if split != "train":
            raise ValueError(f"data.source={source!r} is a single file: use val_split='holdout'")
        return read_records(path)
    return _hub_records(source, config_name, split)


def _saved_records(folder: str, split: str) -> list[tuple[str, object]]:
    """The rows of a `save_to_disk` folder's split, a damaged shard named: pyarrow's own message names no
    file."""
    import datasets

    try:
        data = datasets.load_from_disk(folder)
    except Exception as err:  # pyarrow and datasets raise their own types for damaged files
        raise _damaged(folder, err) from None
    table = _split_of(data, split, folder)
    try:  # the rows are read here, from the memory-mapped shards
        return [(f"{folder}[{split}] row {i}", row) for i, row in enumerate(table)]
    except Exception as err:
        raise _damaged(folder, err) from None


def _damaged(folder: str, err: Exception) -> ValueError:
    shard = _damaged_shard(folder)
    where = f"its file {shard}" if shard else "one of its files"
    return ValueError(
        f"data folder {folder!r} (written by save_to_disk) cannot be read: {where} is truncated or damaged "
        f"({type(err).__name__}: {' '.join(str(err).split())}); write the data set again with save_to_disk"
    )


def _damaged_shard(folder: str) -> str | None:
    """The first `.arrow` file under `folder` that pyarrow cannot read through, or None."""
    import pyarrow as pa

    for parent, _, names in sorted(os.walk(folder)):
        for name in sorted(n for n in names if n.endswith(".arrow")):
            path = os.path.join(parent, name)
            try:
                with pa.memory_map(path) as source:
                    pa.ipc.open_stream(source).read_all().validate(full=True)
            except Exception:  # the error pyarrow raises depends on where the bytes end
                return path
    return None


def _folder_records(folder: str, split: str) -> list[tuple[str, object]]:
    """A folder of another layout that `datasets.load_dataset` reads (a hub data set's download, with its
    files under `data/`); its splits come from the file names."""
    import datasets

    try:
        data = datasets.load_dataset(folder)
    except Exception as err:  # datasets raises its own types for a folder it cannot read
        names = ", ".join(f"{split}{ext}" for ext in (*JSON_TYPES, *TABLE_TYPES))
        raise FileNotFoundError(
            f"data folder {folder!r} has no {split} file ({names}, or compressed) and datasets.load_dataset "
            f"cannot read it ({type(err).__name__}: {err})"
        ) from None
    return _dataset_records(data, split, folder)


def _hub_records(source: str, config_name: str | None, split: str) -> list[tuple[str, object]]:
    import datasets  # only for hub data sets: local files need no `datasets` import

    try:
        ds = datasets.load_dataset(source, config_name, split=split)
    except ConnectionError as err:
        raise ConnectionError(
            f"data.source={source!r}: could not reach the Hugging Face Hub ({err}), and no local "
            "folder or file of that name exists. Offline, pass a folder holding train.jsonl (and "
            "test.jsonl) or a .jsonl / .json / .parquet / .csv file as data.source (a hub data set saved "
            "once with `datasets.load_dataset(...).save_to_disk(folder)`), or `source: arithmetic` for GSM8K"
        ) from None
    except (OSError, ValueError) as err:  # no such data set, config or split
        raise ValueError(f"data.source={source!r} (config {config_name!r}, split {split!r}): {err}") from None
    return [(f"{source}[{split}] row {i}", row) for i, row in enumerate(ds)]
