"""`ValidationResultsWriter`: one JSON line per validation completion (question, completion, extracted
answer, reference, correct), for `python cli.py validate`, and likewise for `test` and `predict`; the
results path checked before the run (`check_results_path`: never a folder, the run's data, or a file other
than an earlier results file without `overwrite`) and the file written whole (`write_results`).
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping
from contextlib import nullcontext
from functools import partial

import lightning as L
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException

from grpo_lightning.core.rewards.verifiable import extract_answer, reference_answer
from grpo_lightning.io.files import OutputLock, write_atomically
from grpo_lightning.training.callbacks.output_lock import HoldsOutputLock
from grpo_lightning.training.validation_sets import COUNTED

LOOP_NAMES = {"validate": "validation", "test": "test", "predict": "prediction"}  # the results' loop, said


class ValidationResultsWriter(HoldsOutputLock):
    """Writes every validation completion of the last validation run to a JSON-lines file, judged as the
    validation metrics judged it; likewise every completion of a `trainer.test` run (`set` as in
    `test/<name>/accuracy`), and every answer of a `trainer.predict` run (the row's data columns, `sample`,
    `completion`, `extracted`; nothing judged).

    One line per completion: `set` (the validation set's name, as in `val/<name>/accuracy`; null for the
    data module's own rows, `val/accuracy`), the row's data columns (GSM8K's `question`; TRL-format data's
    `prompt` and any others), `sample` (index among the problem's samples) and `completion`; for a set
    checked against a numeric answer `extracted` (the lenient answer, as `accuracy` reads it) and `answer`
    (the reference number); for a set judged by a reward function `reward`; and `correct`, as that set's
    `accuracy` counted it; with tools, `transcript`: the sample's turns as chat messages (each assistant
    turn with its `tool_calls`, each result a `tool` message). A data column named like one of these fields
    (`RESULT_FIELDS`: a prompt-completion data set's own `completion`) is kept as `data.<name>`, said when
    the file is written. A rank's padding repeats, which no metric counts, are left out. Needs a
    `validation_step` that returns `{"completions": [...]}` with the `k` samples of each problem contiguous;
    `GRPOModule`'s also returns each completion's judgement. `path=None` writes nothing; under DDP rank
    r > 0 writes `<path>.rank<r>`.

    Args:
        path: the file to write. Checked when the run starts (`check_results_path`): a folder, any input
            of the run (the data's source, a validation set's, or a file inside such a folder), or a file
            that is not such a results file, is refused; an earlier results file only with `overwrite`.
            Through a link, the file it points to is written and the link kept; a stream (`/dev/stdout`, a
            named pipe) is written as it is.
        overwrite: replace an earlier results file at `path`. Default False.
    """

    def __init__(self, path: str | None = None, overwrite: bool = False) -> None:
        self.path = path
        self.overwrite = overwrite
        self._records: list[dict] = []
        self._checked: str | None = None  # the path checked for this run: later validations rewrite it
        self._renamed: dict[str, str] = {}  # data columns kept under another name: said once written

    def _rank_path(self, trainer: L.Trainer) -> str:
        return self.path if trainer.global_rank == 0 else f"{self.path}.rank{trainer.global_rank}"

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.path is not None:  # before any weights load: never after the validation it is for
            path, inputs = self._rank_path(trainer), run_inputs(trainer)
            check_results_path(path, self.overwrite, inputs)
            if not is_stream(path):  # a stream is never replaced: nothing to hold
                # Held until the run ends, a second run is refused; checked again, as a run holding the
                # lock before may have written it.
                self.hold_lock(
                    path, "results.path", partial(check_results_path, path, self.overwrite, inputs)
                )
            self._checked = path

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._records, self._renamed = [], {}

    def on_test_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.on_validation_epoch_start(trainer, pl_module)

    def on_predict_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.on_validation_epoch_start(trainer, pl_module)

    def _data_columns(self, batch: dict[str, list], shown: list[str], row: int) -> dict:
        """Row `row`'s data columns of `batch`, each under its name in the results (`kept_names`)."""
        names = kept_names(shown)
        self._renamed |= {column: name for column, name in names.items() if name != column}
        return {names[column]: batch[column][row] for column in shown}

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.on_validation_batch_end(trainer, pl_module, outputs, batch, batch_idx, dataloader_idx)

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if self.path is None:
            return
        # `predict_step`'s answers, one per counted prompt of the batch, in its order.
        counted = batch.get(COUNTED, [True] * len(batch["prompt"]))
        rows = [i for i, kept in enumerate(counted) if kept]
        shown = [key for key in batch if key != COUNTED and not (key == "prompt" and "question" in batch)]
        for row, answer in zip(rows, outputs, strict=True):
            for sample, completion in enumerate(answer["completions"]):
                record = self._data_columns(batch, shown, row)
                record.update(sample=sample, completion=completion, extracted=extract_answer(completion))
                if "transcripts" in answer:
                    record["transcript"] = answer["transcripts"][sample]
                self._records.append(record)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if self.path is None:
            return
        completions = outputs["completions"]
        k = len(completions) // len(batch["prompt"])
        counted = outputs.get("counted", [True] * len(batch["prompt"]))
        # The reference's column: the set's own, where the module says which it checked.
        column = outputs.get("answer_column", getattr(trainer.datamodule, "answer_column", "answer"))
        # The data's own columns; the preset's chat prompt is made from its question, which says it shorter.
        shown = [key for key in batch if key != column and not (key == "prompt" and "question" in batch)]
        for i, completion in enumerate(completions):
            if not counted[i // k]:
                continue
            record = {"set": outputs.get("set")} | self._data_columns(batch, shown, i // k)
            record.update(sample=i % k, completion=completion)
            if "rewards" in outputs:  # judged by the set's reward function
                record.update(reward=outputs["rewards"][i], correct=outputs["correct"][i])
            else:
                record["extracted"] = extract_answer(completion)
                if column in batch:
                    record.update(self._judged(batch[column][i // k], record["extracted"]))
                if "correct" in outputs:
                    record["correct"] = outputs["correct"][i]
            if "transcripts" in outputs:  # a multi-turn rollout's turns (tool calls, results), written last
                record["transcript"] = outputs["transcripts"][i]
            self._records.append(record)

    @staticmethod
    def _judged(reference: object, extracted: str | None) -> dict:
        """The reference number and whether the extracted answer is it; a reference that is not a number
        (for a `val_reward` to judge) is written as it is, `correct` null."""
        try:
            answer = reference_answer(reference)
        except ValueError:
            return {"answer": reference, "correct": None}
        return {"answer": answer, "correct": extracted == answer}

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        # Stopped by SIGTERM (`InterruptCheckpoint`) during `validate`, `test` or `predict`: the rows
        # answered so far are written, whole, and the log says that they are not all.
        if not isinstance(exception, SIGTERMException) or trainer.state.fn == TrainerFn.FITTING:
            return
        if self.path is None or not self._records:
            return
        self.on_validation_epoch_end(trainer, pl_module)
        rank_zero_info(f"stopped by SIGTERM: {self._rank_path(trainer)} holds the rows answered before it")

    def on_test_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.on_validation_epoch_end(trainer, pl_module)

    def on_predict_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.on_validation_epoch_end(trainer, pl_module)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.path is None or trainer.sanity_checking:
            return
        path = self._rank_path(trainer)
        if path != self._checked:  # validation called without setup (a bare loop): checked here
            check_results_path(path, self.overwrite, run_inputs(trainer))
            lock = nullcontext() if is_stream(path) else OutputLock(path, "results.path")
            with lock:
                check_results_path(path, self.overwrite, run_inputs(trainer))
                write_results(path, self._records)
            self._checked = path
        else:
            write_results(path, self._records)
        correct = sum(bool(r.get("correct")) for r in self._records)
        what = LOOP_NAMES.get(trainer.state.stage.value, "validation")
        renamed = "".join(f"; the data's {c!r} as {n!r}" for c, n in self._renamed.items())
        rank_zero_info(
            f"{len(self._records)} {what} completions ({correct} correct) written to {path}{renamed}"
        )


# The fields a results line holds beside the row's data columns.
RESULT_FIELDS = ("set", "sample", "completion", "extracted", "answer", "correct", "reward", "transcript")
# What follows the data columns on each line, in order: predict's answers and validation's or test's
# completions, judged by the numeric check or by a reward function (`ValidationResultsWriter`).
RESULT_TAILS = {
    ("sample", "completion", "extracted"),
    ("sample", "completion", "extracted", "correct"),
    ("sample", "completion", "extracted", "answer", "correct"),
    ("sample", "completion", "reward", "correct"),
}


def kept_names(columns: list[str]) -> dict[str, str]:
    """Each data column's name in the results: its own, or `data.<name>` for one that a results field
    would shadow (`data.data.<name>` where the data has that too)."""
    names = {}
    for column in columns:
        name = column
        while name in RESULT_FIELDS or (name != column and name in columns):
            name = f"data.{name}"
        names[column] = name
    return names


def write_results(path: str, records: list[dict]) -> None:
    """The records as JSON lines, written whole (`files.write_atomically`): a kill or a full disk leaves the
    earlier file. Through a link, the file it points to is replaced and the link kept; a stream
    (`is_stream`) is written as it is."""
    lines = "".join(json.dumps(record, ensure_ascii=False, default=str) + "\n" for record in records)
    if is_stream(path):
        with open(path, "w", encoding="utf-8") as f:
            f.write(lines)
        return
    write_atomically(os.path.realpath(path), lines, "the results file")


def is_stream(path: str) -> bool:
    """Whether `path` is (or links to) something other than a file or folder: a terminal, `/dev/null`, a
    named pipe, a socket."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def run_inputs(trainer: L.Trainer) -> dict[str, str]:
    """The paths a run reads its rows from, by what they are: the data module's source and each of its
    validation sets', and those of the callbacks' own data (`GSM8KAccuracyCallback`)."""
    inputs = {}
    owners = [("the data", getattr(trainer, "datamodule", None))]
    owners += [(type(c).__name__ + "'s data", getattr(c, "data", None)) for c in trainer.callbacks]
    for what, data in owners:
        if isinstance(getattr(data, "source", None), str):
            inputs[f"{what} source"] = data.source
        for validation_set in getattr(data, "val_sets", None) or []:
            inputs[f"validation set {validation_set.name!r}'s source"] = validation_set.source
    return {what: path for what, path in inputs.items() if os.path.exists(os.path.expanduser(path))}


def check_results_path(path: str, overwrite: bool, inputs: Mapping[str, str] | None = None) -> None:
    """Refuse a results path that is a folder, whose folder cannot be made, that is or lies inside one of
    `inputs` (by what they are: the data's source; through links, hard links and relative paths alike), or
    that holds a non-empty file other than an earlier results file (any non-empty file without
    `overwrite`). A stream (`is_stream`) is accepted: writing it replaces nothing."""
    if os.path.isdir(path):
        raise ValueError(f"results.path={path!r} is a folder: name the file to write, e.g. {path}/val.jsonl")
    for what, source in (inputs or {}).items():
        source = os.path.expanduser(source)
        if os.path.exists(path) and os.path.samefile(path, source):
            raise ValueError(
                f"results.path={path!r} is {what} ({source}): the results would replace it; choose another "
                "path"
            )
        if os.path.isdir(source) and _inside(path, source):
            raise ValueError(
                f"results.path={path!r} lies inside {what} ({source}), where it would be read as data: "
                "choose a path outside it"
            )
    if is_stream(path):
        return
    parent = os.path.dirname(os.path.realpath(path))
    blocking = next((p for p in _ancestors(parent) if os.path.exists(p) and not os.path.isdir(p)), None)
    if blocking is not None:
        raise ValueError(f"results.path={path!r}: {blocking} is a file, not a folder")
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return
    if not _is_results_file(path):
        raise ValueError(
            f"results.path={path!r} holds a file that is not a validation results file: choose another path"
        )
    if not overwrite:
        raise ValueError(
            f"results.path={path!r} holds the results of an earlier validation: choose another path, or "
            "replace them with --results.overwrite true"
        )


def _ancestors(folder: str) -> list[str]:
    """`folder` and every folder above it, outermost first."""
    chain = [folder]
    while os.path.dirname(chain[-1]) != chain[-1]:
        chain.append(os.path.dirname(chain[-1]))
    return chain[::-1]


def _inside(path: str, folder: str) -> bool:
    """Whether `path` lies under `folder` (real paths: links and `..` resolved)."""
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return os.path.commonpath([path, folder]) == folder


def _is_results_file(path: str) -> bool:
    """Whether every line of `path` is a JSON object ending in the fields written here, in their order
    (`RESULT_TAILS`): rows of data that merely have a `completion` and a `sample` column are not."""
    try:
        with open(path, encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return False
    return all(isinstance(r, dict) and _results_tail(list(r)) in RESULT_TAILS for r in records)


def _results_tail(keys: list[str]) -> tuple[str, ...]:
    """A line's keys from its `sample` on: the fields written after the row's data columns (a multi-turn
    sample's `transcript`, written last, aside)."""
    tail = tuple(keys[keys.index("sample") :]) if "sample" in keys else ()
    return tail[:-1] if tail[-1:] == ("transcript",) else tail
