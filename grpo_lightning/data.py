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
import os
import random
import warnings

import lightning as L
import torch
from torch.utils.data import DataLoader, DistributedSampler

from grpo_lightning.resume import ResumableSampler
from grpo_lightning.validation_sets import (
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


def read_records(path: str) -> list[tuple[str, object]]:
    """The raw rows of a `.jsonl`, `.json` (an array of objects, or JSON lines) or `.parquet` file, each with
    where it comes from (`file:line`, `file[i]` or `file row i`) for error messages."""
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
    text = "".join(lines)
    if text.lstrip().startswith("["):
        try:
            array = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{err.lineno}: not valid JSON ({err.msg})") from None
        return [(f"{path}[{i}]", row) for i, row in enumerate(array)]
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append((f"{path}:{number}", json.loads(line)))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not valid JSON ({err.msg})") from None
    return records


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
    answer = _check_text(row, answer_field, where)
    if "####" not in answer or not answer.rsplit("####", 1)[1].strip():
        raise ValueError(
            f"{where}: field {answer_field!r} has no final '#### <number>' line: {answer[-80:]!r}"
        )
    out = {k: v for k, v in row.items() if k not in (question_field, answer_field)}
    out.update(question=question, answer=answer)
    return out


def check_prompt(prompt: object, where: str, field: str = "prompt") -> None:
    """A prompt is non-empty text or a non-empty list of `{"role": str, "content": str}` messages."""
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


def _positive(name: str, value: int | None, allow_none: bool = False, minimum: int = 1) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"data.{name}={value!r}: must be an integer >= {minimum}")


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
            (`grpo_lightning.validation_sets.ValidationSet`: source, answer checker, samples per problem).
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
        if hp.val_split not in ("holdout", "test"):
            raise ValueError(f"data.val_split={hp.val_split!r}: must be 'holdout' or 'test'")
        if not isinstance(hp.source, str) or not hp.source.strip():
            raise ValueError(f"data.source={hp.source!r}: name a hub data set, a folder or a file")
        _positive("batch_size", hp.batch_size)
        _positive("val_batch_size", hp.val_batch_size)
        _positive("val_size", hp.val_size, minimum=0)
        _positive("train_size", hp.train_size, allow_none=True)
        _positive("num_workers", hp.num_workers, minimum=0)
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
        _positive("arithmetic_size", self.hparams.arithmetic_size)

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
