"""GSM8K-style data: prompt + checkable answer, as a LightningDataModule.

Rows are `{"question": str, "answer": str}` where the answer ends in GSM8K's `#### N` line. Each batch is
a dict of lists: `prompt` (chat messages: the system prompt and the question), and every column of the
rows (`question`, `answer`, ...), which reach the reward functions as keyword lists.
"""

from __future__ import annotations

import functools
import json
import os
import random
import warnings

import lightning as L
import torch
from torch.utils.data import DataLoader

from grpo_lightning.resume import ResumableSampler

DEFAULT_SYSTEM_PROMPT = (
    "Solve the math problem step by step. On the last line, write only the final answer as '#### <number>'."
)

Row = dict[str, str]


def read_jsonl(path: str, question_field: str = "question", answer_field: str = "answer") -> list[Row]:
    """Read and check a JSON-lines file; a bad row raises `ValueError` naming the file and line."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file {path!r} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not valid UTF-8 ({err.reason} at byte {err.start})") from None
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not valid JSON ({err.msg})") from None
        rows.append(check_row(row, f"{path}:{number}", question_field, answer_field))
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def check_row(row: object, where: str, question_field: str = "question", answer_field: str = "answer") -> Row:
    """Return the row with `question` and `answer` keys, or raise naming `where` and the field at fault."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    for field in (question_field, answer_field):
        if field not in row:
            raise ValueError(f"{where}: missing field {field!r} (has {sorted(row)})")
        if not isinstance(row[field], str) or not row[field].strip():
            raise ValueError(f"{where}: field {field!r} is empty or not a string")
    answer = row[answer_field]
    if "####" not in answer or not answer.rsplit("####", 1)[1].strip():
        raise ValueError(
            f"{where}: field {answer_field!r} has no final '#### <number>' line: {answer[-80:]!r}"
        )
    out = {k: v for k, v in row.items() if k not in (question_field, answer_field)}
    out.update(question=row[question_field], answer=answer)
    return out


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
    """A batch as a dict of lists: the chat `prompt` plus every column of the rows."""
    batch: dict[str, list] = {"prompt": [chat_prompt(r["question"], system_prompt) for r in rows]}
    for key in rows[0]:
        batch[key] = [r[key] for r in rows]
    return batch


class GSM8KDataModule(L.LightningDataModule):
    """GSM8K (or any prompt + `#### N` answer data) for GRPO training and held-out evaluation.

    Args:
        source: where the rows come from. A folder holding `train.jsonl` (and optionally `test.jsonl`), a
            single `.jsonl` file, `"arithmetic"` (the built-in generated task, no download), or a hub
            dataset name loaded with `datasets.load_dataset(source, "main")`. Default `"openai/gsm8k"`.
        system_prompt: system message asking for the `#### N` form; None for none.
        batch_size: prompts per training step (each is sampled `num_generations` times). Default 4.
        val_size: rows of the train split held out for validation. Default 64.
        val_split: "holdout" (the held-out train rows) or "test" (the test split) for validation.
        val_batch_size: prompts per validation step. Default 16.
        train_size: use only this many training rows (after the hold-out). Default all.
        arithmetic_size: rows generated for `source="arithmetic"` (train + held-out). Default 2000.
        question_field / answer_field: column names in the source, mapped to `question` / `answer`.
        seed: seed of the hold-out split and shuffling.
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
    ) -> None:
        super().__init__()
        if val_split not in ("holdout", "test"):
            raise ValueError(f"val_split must be 'holdout' or 'test', got {val_split!r}")
        if batch_size < 1 or val_batch_size < 1:
            raise ValueError(
                f"batch_size and val_batch_size must be >= 1, got {batch_size}, {val_batch_size}"
            )
        self.save_hyperparameters()
        self.train_rows: list[Row] = []
        self.val_rows: list[Row] = []
        self._resume_at: dict[str, int] | None = None  # from a checkpoint, for the next train_dataloader()

    def _read_split(self, split: str) -> list[Row]:
        hp = self.hparams
        fields = (hp.question_field, hp.answer_field)
        if os.path.isdir(hp.source):
            return read_jsonl(os.path.join(hp.source, f"{split}.jsonl"), *fields)
        if hp.source.endswith(".jsonl") or hp.source.startswith((".", "/", "~")):
            if split != "train":
                raise ValueError(f"source {hp.source!r} is a single file: use val_split='holdout'")
            return read_jsonl(hp.source, *fields)
        import datasets  # only for hub datasets: local files need no `datasets` import

        ds = datasets.load_dataset(hp.source, "main", split=split)
        return [check_row(row, f"{hp.source}[{split}] row {i}", *fields) for i, row in enumerate(ds)]

    def setup(self, stage: str | None = None) -> None:
        if self.train_rows:
            return
        hp = self.hparams
        if hp.source == "arithmetic":
            train = arithmetic_problems(hp.arithmetic_size, seed=hp.seed)
            seen = {row["question"] for row in train}
            # Held-out problems come from another seed, minus any that the training set happens to contain.
            self.val_rows = [
                r for r in arithmetic_problems(2 * hp.val_size, hp.seed + 1) if r["question"] not in seen
            ]
            self.val_rows = self.val_rows[: hp.val_size]
            self.train_rows = train[: hp.train_size]
            return
        rows = self._read_split("train")
        order = list(range(len(rows)))
        random.Random(hp.seed).shuffle(order)
        holdout = hp.val_size if hp.val_split == "holdout" else 0
        if holdout >= len(rows):
            raise ValueError(f"val_size={hp.val_size} leaves no training rows out of {len(rows)}")
        self.val_rows = [rows[i] for i in order[:holdout]]
        self.train_rows = [rows[i] for i in order[holdout:]][: hp.train_size]
        if hp.val_split == "test":
            self.val_rows = self._read_split("test")[: hp.val_size]

    def _loader(self, rows: list[Row], batch_size: int, sampler: ResumableSampler | None) -> DataLoader:
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

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_rows, self.hparams.val_batch_size, sampler=None)
