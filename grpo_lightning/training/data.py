"""Data for GRPO as a LightningDataModule: prompts in TRL's format, with GSM8K as a preset.

`PromptDataModule` reads rows with a `prompt` column (text, or a list of chat messages, as TRL's "prompt-only"
data sets) from a hub data set or local `.jsonl` / `.json` / `.parquet` files. Each batch is a dict of lists:
`prompt` and every other column of the rows, which reach the reward functions as keyword lists, as in TRL.
`GSM8KDataModule` builds the prompts from a question column instead (an optional system prompt, then the
question as the user's turn) and checks that every answer ends in GSM8K's `#### N` line.
"""

from __future__ import annotations

import functools
import json
import math
import os
import random
import warnings
from collections.abc import Mapping, Sequence

import lightning as L
import torch
from torch.utils.data import DataLoader, DistributedSampler

from grpo_lightning.core.options import Rule, check_value
from grpo_lightning.core.rewards.verifiable import reference_answer
from grpo_lightning.training.resume import ResumableSampler
from grpo_lightning.training.validation_sets import (
    ValidationSet,
    check_validation_sets,
    in_order_sampler,
    rank_share,
    read_validation_rows,
)

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


def arithmetic_problems(count: int, seed: int = 0) -> list[Row]:
    """Generated one- and two-step word problems in GSM8K's style, with a `#### N` answer.

    The built-in task of the offline demo: small numbers, so that a small instruct model sometimes gets
    them right before training and GRPO has a signal to work with.
    """
    rng = random.Random(seed)
    names = ["Tom", "Ana", "Lee", "Mia", "Sam", "Zoe", "Raj", "Eva", "Ben", "Ivy"]
    things = ["apples", "books", "coins", "pens", "cards", "shells", "stickers", "marbles"]
    rows = []
    for _ in range(count):
        name, thing = rng.choice(names), rng.choice(things)
        a, b = rng.randint(2, 20), rng.randint(2, 20)
        kind = rng.randrange(4)
        if kind == 0:
            q = f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?"
            steps, result = f"{a} + {b} = <<{a}+{b}={a + b}>>{a + b}", a + b
        elif kind == 1:
            a, b = a + b, min(a, b)
            q = f"{name} has {a} {thing} and gives away {b}. How many {thing} are left?"
            steps, result = f"{a} - {b} = <<{a}-{b}={a - b}>>{a - b}", a - b
        elif kind == 2:
            a, b = a % 9 + 2, b % 9 + 2
            q = f"{name} buys {a} boxes with {b} {thing} in each box. How many {thing} does {name} buy?"
            steps, result = f"{a} * {b} = <<{a}*{b}={a * b}>>{a * b}", a * b
        else:
            c = rng.randint(1, min(a, b))
            q = f"{name} has {a} {thing}, finds {b} more, then loses {c}. How many {thing} does {name} have?"
            s = a + b
            steps = f"{a} + {b} = <<{a}+{b}={s}>>{s}\n{s} - {c} = <<{s}-{c}={s - c}>>{s - c}"
            result = a + b - c
        rows.append({"question": q, "answer": f"{steps}\n#### {result}"})
    return rows


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


DATA_RULES = {
    "val_split": Rule(str, choices=("holdout", "test")),
    "batch_size": Rule(int, ">= 1"),
    "val_batch_size": Rule(int, ">= 1"),
    "val_size": Rule(int, ">= 0"),
    "train_size": Rule(int, ">= 1", none=True),
    "num_workers": Rule(int, ">= 0"),
    "arithmetic_size": Rule(int, ">= 1"),
}


def check_data_options(hparams: Mapping, names: Sequence[str]) -> None:
    """Raise `option_error` ("data.<name>=...") for the first of `names` whose value breaks its rule."""
    for name in names:
        check_value("data", name, hparams[name], DATA_RULES[name])


class PromptDataModule(L.LightningDataModule):
    """Prompts in TRL's format for GRPO training and held-out evaluation.

    Rows hold a prompt column (text, or a list of `{"role", "content"}` chat messages) and any other columns
    (`solution`, `answer`, ...): a batch passes the prompts to the policy and every other column to the
    reward functions, as TRL's `GRPOTrainer` does. Every row is checked before any weights load; a bad one
    raises `ValueError` naming it (file:line, or data set, split and row) and the field at fault.

    Args:
        source: where the rows come from. A folder holding `train.jsonl` (or `.json` / `.parquet`) and
            optionally `test.*`; a single `.jsonl` / `.json` / `.parquet` file; or a hub data set loaded
            with `datasets.load_dataset(source, config_name, split=...)`. Required.
        config_name: the hub data set's configuration (GSM8K's is "main"); None for its default.
        prompt_field: the column holding the prompt. Default "prompt". It reaches the rewards as `prompts`.
        answer_field: the column holding the reference answer that validation checks (a number, or
            GSM8K's `#### N` form) when the model has no `val_reward`. Default "answer"; rows need it only
            for that check.
        batch_size: prompts per training step (each is sampled `num_generations` times). Default 4.
        val_size: rows of the train split held out for validation, >= 0. Default 64.
        val_split: "holdout" (the held-out train rows) or "test" (the test split) for validation.
        val_batch_size: prompts per validation step. Default 16.
        train_size: use only this many training rows (after the hold-out), >= 1. Default all.
        seed: seed of the hold-out split and shuffling. Default 0.
        num_workers: data loader worker processes. Default 0.
        val_sets: more validation sets, each scored on its own as `val/<name>/...`
            (`grpo_lightning.training.validation_sets.ValidationSet`: source, answer checker, samples per
            problem).
            Default None: only the rows above, as `val/...`.
    """

    def __init__(
        self,
        source: str,
        config_name: str | None = None,
        prompt_field: str = "prompt",
        answer_field: str = "answer",
        batch_size: int = 4,
        val_size: int = 64,
        val_split: str = "holdout",
        val_batch_size: int = 16,
        train_size: int | None = None,
        seed: int = 0,
        num_workers: int = 0,
        val_sets: list[ValidationSet] | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["val_sets"])  # their reward functions do not go in checkpoints
        self.val_sets = list(val_sets or [])
        self.val_set_rows: list[list[Row]] = []  # each set's rows, read in `setup`
        # `_loader` hands it to `collate_rows`, which only uses it for rows without a prompt (GSM8K's preset
        # builds them at read time); a base option it is not, so that the CLI, when switching from the
        # preset to this class, does not carry the preset's system prompt over.
        self.hparams.setdefault("system_prompt", None)
        self.train_rows: list[Row] = []
        self.val_rows: list[Row] = []
        self._resume_at: dict[str, int] | None = None  # from a checkpoint, for the next train_dataloader()

    def check_options(self) -> None:
        """Range-check every option; `setup` calls it, before any rows are read or weights load.

        Not in `__init__`: LightningCLI builds the data module inside a type union, which would fold the
        one-line message into a page of jsonargparse's own.
        """
        hp = self.hparams
        check_data_options(hp, ["val_split"])
        if not isinstance(hp.source, str) or not hp.source.strip():
            raise ValueError(f"data.source={hp.source!r}: name a hub data set, a folder or a file")
        check_data_options(hp, ["batch_size", "val_batch_size", "val_size", "train_size", "num_workers"])
        check_validation_sets(self.val_sets)

    @property
    def answer_column(self) -> str:
        """The batch column holding the reference answer that validation checks."""
        return self.hparams.answer_field

    @property
    def conversational(self) -> bool:
        """Whether the prompts are chat messages (known after `setup`)."""
        rows = self.train_rows or self.val_rows
        return bool(rows) and isinstance(rows[0]["prompt"], list)

    def _prepare_row(self, row: object, where: str) -> Row:
        """A checked row with its prompt under `prompt`, or `ValueError` naming `where` and the field."""
        hp = self.hparams
        if not isinstance(row, dict):
            raise ValueError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
        if hp.prompt_field not in row:
            raise ValueError(
                f"{where}: missing field {hp.prompt_field!r} (has {sorted(row)}); name the prompt column "
                "with data.prompt_field"
            )
        prompt = row[hp.prompt_field]
        check_prompt(prompt, where, hp.prompt_field)
        if hp.answer_field in row:
            check_answer(row[hp.answer_field], where, hp.answer_field)
        out = {k: v for k, v in row.items() if k != hp.prompt_field}
        return {"prompt": prompt, **out}

    def _records(self, split: str) -> list[tuple[str, object]]:
        """Raw rows of a split with where each comes from; hub failures say what to do offline."""
        source = self.hparams.source
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
        return self._hub_records(split)

    def _hub_records(self, split: str) -> list[tuple[str, object]]:
        hp = self.hparams
        import datasets  # only for hub data sets: local files need no `datasets` import

        try:
            ds = datasets.load_dataset(hp.source, hp.config_name, split=split)
        except ConnectionError as err:
            raise ConnectionError(
                f"data.source={hp.source!r}: could not reach the Hugging Face Hub ({err}), and no local "
                "folder or file of that name exists. Offline, pass a folder holding train.jsonl (and "
                "test.jsonl) or a .jsonl / .json / .parquet file as data.source (a hub data set saved once "
                "with `datasets.load_dataset(...)[split].to_json(path)`), or `source: arithmetic` for GSM8K"
            ) from None
        except (OSError, ValueError) as err:  # no such data set, config or split
            raise ValueError(
                f"data.source={hp.source!r} (config {hp.config_name!r}, split {split!r}): {err}"
            ) from None
        return [(f"{hp.source}[{split}] row {i}", row) for i, row in enumerate(ds)]

    def _read_split(self, split: str, like: tuple[str, Row] | None = None) -> tuple[list[Row], list[str]]:
        """A split's checked rows and where each comes from; `like` is a row of another split (and where it
        comes from) whose columns these rows must have too."""
        records = self._records(split)
        if not records:
            raise ValueError(f"data.source={self.hparams.source!r}: the {split} split has no rows")
        rows = [self._prepare_row(row, where) for where, row in records]
        wheres = [where for where, _ in records]
        if like is None:
            check_same_columns(rows, wheres)
        else:
            check_same_columns([like[1], *rows], [like[0], *wheres])
        return rows, wheres

    def _split_rows(self) -> tuple[list[Row], list[Row]]:
        """Training and validation rows: a seeded hold-out of the train split, or the test split."""
        hp = self.hparams
        rows, wheres = self._read_split("train")
        order = list(range(len(rows)))
        random.Random(hp.seed).shuffle(order)
        holdout = hp.val_size if hp.val_split == "holdout" else 0
        if holdout >= len(rows):
            raise ValueError(f"data.val_size={hp.val_size} leaves no training rows out of {len(rows)}")
        val_rows = [rows[i] for i in order[:holdout]]
        train_rows = [rows[i] for i in order[holdout:]][: hp.train_size]
        if hp.val_split == "test" and hp.val_size > 0:
            val_rows = self._read_split("test", like=(wheres[0], rows[0]))[0][: hp.val_size]
        return train_rows, val_rows

    def setup(self, stage: str | None = None) -> None:
        self.check_options()
        if not self.train_rows:
            self.train_rows, self.val_rows = self._split_rows()
        if self.val_sets and not self.val_set_rows:
            self.val_set_rows = [read_validation_rows(validation_set) for validation_set in self.val_sets]
        if stage == "validate" and not self.val_rows and not self.val_sets:
            raise ValueError(
                f"nothing to validate: data.val_size={self.hparams.val_size} gives no validation rows"
            )

    def _loader(self, rows: list[Row], batch_size: int, sampler: DistributedSampler | None) -> DataLoader:
        collate = functools.partial(collate_rows, system_prompt=self.hparams.system_prompt)
        # Its own generator: the loader's per-pass seed never draws from the global RNG that sampling uses.
        return DataLoader(
            rows,
            batch_size=batch_size,
            sampler=sampler,
            collate_fn=collate,
            num_workers=self.hparams.num_workers,
            generator=torch.Generator().manual_seed(self.hparams.seed),
        )

    def train_dataloader(self) -> DataLoader:
        hp = self.hparams
        # Each rank reads its own share: a `DistributedSampler`, which Lightning does not wrap again.
        world, rank = (self.trainer.world_size, self.trainer.global_rank) if self.trainer else (1, 0)
        sampler = ResumableSampler(len(self.train_rows), hp.seed, shuffle=True, num_replicas=world, rank=rank)
        if self._resume_at is not None:
            sampler.resume(self._resume_at["epoch"], self._resume_at["batches_done"] * hp.batch_size)
            self._resume_at = None
        return self._loader(self.train_rows, hp.batch_size, sampler)

    def state_dict(self) -> dict[str, int]:
        """Where the training stream stands: an epoch and how many of its batches each rank has trained on.

        Lightning stores this in every checkpoint and hands it to `load_state_dict` on resume, so that the
        resumed run continues with the batch the interrupted one would have taken next.
        """
        trainer = self.trainer
        if trainer is None:
            return {}
        # The epoch whose batches `batch_progress` counts: the one started last (it stays counted after it
        # ends, until the next one starts).
        epoch = max(trainer.fit_loop.epoch_progress.current.started - 1, 0)
        done = trainer.fit_loop.epoch_loop.batch_progress.current.processed
        if done >= trainer.num_training_batches:  # that epoch is over: the next one starts from its beginning
            epoch, done = epoch + 1, 0
        return {"epoch": epoch, "batches_done": done}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        if not state_dict:
            return
        self._resume_at = dict(state_dict)
        # Lightning warns that a mid-epoch resume repeats data unless the loader itself holds a state; here
        # the data module holds it, and the sampler resumes where the checkpoint left off.
        warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before")

    def validation_sets_in_order(self) -> list[ValidationSet | None]:
        """The set behind each validation loader: None for this module's own rows (`val/...` metrics)."""
        return ([None] if self.val_rows or not self.val_sets else []) + self.val_sets

    def val_dataloader(self) -> DataLoader | list[DataLoader]:
        # Each rank validates its own rows, padded to equal counts with repeats that no metric counts
        # (`validation_sets.rank_share`): Lightning's sampler would count the repeats.
        world, rank = (self.trainer.world_size, self.trainer.global_rank) if self.trainer else (1, 0)
        loaders = []
        for validation_set in self.validation_sets_in_order():
            if validation_set is None:
                rows, size = self.val_rows, self.hparams.val_batch_size
            else:
                rows = self.val_set_rows[self.val_sets.index(validation_set)]
                size = validation_set.batch_size or self.hparams.val_batch_size
            share = rank_share(rows, rank, world)
            loaders.append(self._loader(share, size, in_order_sampler(share)))
        return loaders[0] if not self.val_sets else loaders


class GSM8KDataModule(PromptDataModule):
    """GSM8K (or any question + `#### N` answer data) for GRPO training and held-out evaluation: a preset of
    `PromptDataModule` that builds each prompt from the question (an optional system prompt, then the
    question as the user's turn) and checks that every answer ends in a `#### N` line.

    Rows are `{"question": str, "answer": str, ...}` (other column names through `question_field` /
    `answer_field`; they reach the rewards as `question` and `answer`).

    Args:
        source: a folder holding `train.jsonl` (and optionally `test.jsonl`; or `.json` / `.parquet`), a
            single file, `"arithmetic"` (the built-in generated task, no download), or a hub data set
            loaded with `datasets.load_dataset(source, config_name)`. Default `"openai/gsm8k"`.
        system_prompt: system message asking for the `#### N` form; None for none.
        batch_size: prompts per training step (each is sampled `num_generations` times). Default 4.
        val_size: rows of the train split held out for validation, >= 0. Default 64.
        val_split: "holdout" (the held-out train rows) or "test" (the test split) for validation.
        val_batch_size: prompts per validation step. Default 16.
        train_size: use only this many training rows (after the hold-out), >= 1. Default all.
        arithmetic_size: rows generated for `source="arithmetic"` (train + held-out), >= 1. Default 2000.
        question_field / answer_field: column names in the source, mapped to `question` / `answer`.
        seed: seed of the hold-out split and shuffling. Default 0.
        num_workers: data loader worker processes. Default 0.
        config_name: the hub data set's configuration; None for its default, which for "openai/gsm8k"
            (whose configurations are "main" and "socratic") means "main".
        val_sets: more validation sets, as in `PromptDataModule`. Default None.
    """

    def __init__(
        self,
        source: str = "openai/gsm8k",
        system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
        batch_size: int = 4,
        val_size: int = 64,
        val_split: str = "holdout",
        val_batch_size: int = 16,
        train_size: int | None = None,
        arithmetic_size: int = 2000,
        question_field: str = "question",
        answer_field: str = "answer",
        seed: int = 0,
        num_workers: int = 0,
        config_name: str | None = None,
        val_sets: list[ValidationSet] | None = None,
    ) -> None:
        if config_name is None and source == "openai/gsm8k":
            config_name = "main"
        super().__init__(
            source,
            config_name=config_name,
            answer_field=answer_field,
            batch_size=batch_size,
            val_size=val_size,
            val_split=val_split,
            val_batch_size=val_batch_size,
            train_size=train_size,
            seed=seed,
            num_workers=num_workers,
            val_sets=val_sets,
        )

    def check_options(self) -> None:
        super().check_options()
        check_data_options(self.hparams, ["arithmetic_size"])

    @property
    def answer_column(self) -> str:
        return "answer"  # `answer_field` is renamed to `answer`

    def _prepare_row(self, row: object, where: str) -> Row:
        hp = self.hparams
        checked = check_row(row, where, hp.question_field, hp.answer_field)
        return {"prompt": chat_prompt(checked["question"], hp.system_prompt), **checked}

    def _split_rows(self) -> tuple[list[Row], list[Row]]:
        hp = self.hparams
        if hp.source != "arithmetic":
            return super()._split_rows()
        train = [self._prepare_row(r, "arithmetic") for r in arithmetic_problems(hp.arithmetic_size, hp.seed)]
        seen = {row["question"] for row in train}
        # Held-out problems come from another seed, minus any that the training set happens to contain.
        held_out = [r for r in arithmetic_problems(2 * hp.val_size, hp.seed + 1) if r["question"] not in seen]
        val = [self._prepare_row(r, "arithmetic") for r in held_out[: hp.val_size]]
        return train[: hp.train_size], val
