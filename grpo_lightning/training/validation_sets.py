"""Several validation sets, each with its own answer checker and sample count, and validation rows shared
among ranks without repeats.

`ValidationSet` names a data source (e.g. GSM8K's test split, a MATH-500-style file) that the data module
serves as one more validation loader; `GRPOModule` scores its completions with the set's own reward (or
its numeric answer column) and logs `val/<name>/accuracy`, `val/<name>/pass_at_k`, ... per set, as verl
reports per `data_source`. The data module's own validation rows keep the plain `val/accuracy` names.

Under DDP, Lightning's `DistributedSampler` pads the ranks' shares to equal length by repeating rows, which
then count twice. `rank_share` pads the same way, so that every rank takes as many batches (FSDP2 gathers
the weights for each validation batch's generate: a collective), but marks the repeats, and `SetScores`
leaves them out: the accuracy over the ranks is that of the rows, each once.
Nothing here imports Lightning; rows are read and checked by `grpo_lightning/io/rows.py`, as the data
module's.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.data import DistributedSampler
from torchmetrics import MeanMetric

from grpo_lightning.core.metrics import GSM8KAccuracy, RewardAccuracy
from grpo_lightning.core.rewards.verifiable import extract_answer, reference_answer
from grpo_lightning.io.rows import (
    DATA_FILE_TYPES,
    DEFAULT_SYSTEM_PROMPT,
    Row,
    chat_prompt,
    check_prompt,
    check_same_columns,
    read_records,
    read_split_records,
)

COUNTED = "_counted"  # row column: False on a rank's padding repeat, which no metric counts


@dataclass
class ValidationSet:
    """One more validation set, scored on its own.

    Args:
        name: the metrics' infix, `val/<name>/accuracy`; letters, digits, `_`, `-` and `.`.
        source: a `.jsonl` / `.json` / `.parquet` file, a folder holding `<split>.jsonl` (or .json /
            .parquet), or a hub data set (its `split`).
        split: the split of a folder or hub data set. Default "test".
        config_name: the hub data set's configuration. Default None.
        prompt_field: the column holding the prompt (text or chat messages). Default "prompt".
        question_field: build the prompt from this column instead, as GSM8K's preset does: `system_prompt`,
            then the question as the user's turn. Default None (use `prompt_field`).
        system_prompt: the system message of prompts built from `question_field`; "" for none. Default None:
            GSM8K's (`data.DEFAULT_SYSTEM_PROMPT`, asking for a `#### <number>` last line).
        answer_field: the column holding a numeric reference answer (a number, or GSM8K's `#### N`), checked
            as `val/accuracy` is when `reward` is None. Default "answer".
        reward: the function that judges each completion, called as training rewards are (full marks, >= 1,
            is right), e.g. `trl.rewards.accuracy_reward` (math-verify, LaTeX answers, a `solution`
            column). Default None: the numeric answer check.
        num_generations: samples per problem: mean@k (`accuracy`), pass@k, maj@k; 1 decodes greedily.
            Default 1.
        size: use the first `size` rows. Default None (all).
        batch_size: prompts per validation step. Default None (the data module's `val_batch_size`).
    """

    name: str
    source: str
    split: str = "test"
    config_name: str | None = None
    prompt_field: str = "prompt"
    question_field: str | None = None
    system_prompt: str | None = None
    answer_field: str = "answer"
    reward: Callable | None = None
    num_generations: int = 1
    size: int | None = None
    batch_size: int | None = None

    def check(self, index: int) -> None:
        """One clear error naming `data.val_sets[index]` and the option at fault."""
        where = f"data.val_sets[{index}]"
        if (
            not isinstance(self.name, str)
            or not self.name
            or not all(c.isalnum() or c in "_-." for c in self.name)
        ):
            raise ValueError(f"{where}.name={self.name!r}: must be letters, digits, '_', '-' or '.'")
        if not isinstance(self.source, str) or not self.source.strip():
            raise ValueError(f"{where}.source={self.source!r}: name a file, a folder or a hub data set")
        for option, minimum, allow_none in (
            ("num_generations", 1, False),
            ("size", 1, True),
            ("batch_size", 1, True),
        ):
            value = getattr(self, option)
            if not (value is None and allow_none) and (
                isinstance(value, bool) or not isinstance(value, int) or value < minimum
            ):
                raise ValueError(f"{where}.{option}={value!r}: must be an integer >= {minimum}")


def check_validation_sets(sets: Sequence[ValidationSet]) -> None:
    """Each set's options, and names that tell the sets' metrics apart."""
    for index, validation_set in enumerate(sets):
        validation_set.check(index)
    names = [s.name for s in sets]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(
            f"data.val_sets: the name {repeated[0]!r} is used twice; each set's metrics need their own"
        )


def read_validation_rows(validation_set: ValidationSet) -> list[Row]:
    """The set's checked rows, each with its prompt under `prompt`; a bad row raises naming it, and the
    field at fault."""
    vs = validation_set
    if vs.source.endswith(DATA_FILE_TYPES):
        records = read_records(os.path.expanduser(vs.source))
    else:  # a folder or a hub data set, read as the data module reads its test split
        records = read_split_records(vs.source, vs.config_name, vs.split)
    records = records[: vs.size]
    if not records:
        raise ValueError(f"validation set {vs.name!r}: {vs.source} has no rows")
    rows = [_prepare_row(vs, row, f"validation set {vs.name!r}, {where}") for where, row in records]
    check_same_columns(rows, [where for where, _ in records])
    return rows


def _prepare_row(vs: ValidationSet, row: object, where: str) -> Row:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    field = vs.question_field or vs.prompt_field
    if field not in row:
        raise ValueError(f"{where}: missing field {field!r} (has {sorted(row)})")
    if vs.question_field is not None:
        if not isinstance(row[field], str) or not row[field].strip():
            raise ValueError(f"{where}: field {field!r} is empty or not a string")
        prompt = chat_prompt(
            row[field], DEFAULT_SYSTEM_PROMPT if vs.system_prompt is None else vs.system_prompt
        )
    else:
        check_prompt(row[field], where, field)
        prompt = row[field]
    if vs.reward is None:  # the numeric check: the answer must be a number, said now rather than mid-run
        if vs.answer_field not in row:
            raise ValueError(
                f"{where}: missing field {vs.answer_field!r}, which the answer check reads; set "
                "answer_field, or reward to a function that judges the completions"
            )
        try:
            reference_answer(str(row[vs.answer_field]))
        except ValueError:
            raise ValueError(
                f"{where}: field {vs.answer_field!r} is not a number ({str(row[vs.answer_field])[:60]!r}); "
                "for other answers set the set's reward, e.g. trl.rewards.accuracy_reward"
            ) from None
    return {**{k: v for k, v in row.items() if k != vs.prompt_field}, "prompt": prompt}


# --------------------------------------------------------------------------------- sharing among ranks
def rank_share(rows: Sequence[Row], rank: int, world: int) -> list[Row]:
    """Rank `rank`'s rows `rank, rank + world, ...`, marked counted, then repeats of the first row, marked
    not counted, up to `ceil(len(rows) / world)` rows: every rank holds as many rows, none counts twice."""
    own = [{**row, COUNTED: True} for row in rows[rank::world]]
    padding = [{**rows[0], COUNTED: False}] * (math.ceil(len(rows) / world) - len(own)) if rows else []
    return own + padding


def in_order_sampler(rows: Sequence[Row]) -> DistributedSampler:
    """Every row of a rank's share, in order: a `DistributedSampler` of one replica, which Lightning leaves
    as it is (any other sampler it replaces by its own padded `DistributedSampler` under DDP)."""
    return DistributedSampler(rows, num_replicas=1, rank=0, shuffle=False)


# --------------------------------------------------------------------------------- scores
class SetScores:
    """One validation set's metrics: its accuracy metric, sample count, checker and completion lengths.

    Args:
        prefix: "val/" for the data module's own set, "val/<name>/" for a `ValidationSet` ("test/...",
            "test/<name>/" in `trainer.test`).
        num_generations: samples per problem.
        reward: the judging function, or None for the numeric answer check.
        answer_column: the numeric check's column (None: the data module's, found by the module).
    """

    def __init__(
        self,
        prefix: str,
        num_generations: int,
        reward: Callable | None = None,
        answer_column: str | None = None,
        accuracy: GSM8KAccuracy | RewardAccuracy | None = None,
    ) -> None:
        self.prefix = prefix
        self.k = num_generations
        self.reward = reward
        self.answer_column = answer_column
        self.accuracy = accuracy or (
            GSM8KAccuracy(k=num_generations) if reward is None else RewardAccuracy(k=num_generations)
        )
        self.completion_length = MeanMetric()

    def to(self, device: torch.device) -> SetScores:
        self.accuracy.to(device)
        self.completion_length.to(device)
        return self

    @property
    def name(self) -> str | None:
        """The set's name, as its metrics carry it (`val/<name>/...`); None for the data module's own rows."""
        return self.prefix.split("/", 1)[1].removesuffix("/") or None

    def update_answers(
        self, counted: Sequence[bool], lengths: Tensor, completions: Sequence[str], answers: Sequence
    ) -> list[bool]:
        """Fold in a batch checked against numeric answers: `counted` and `answers` per problem, the `k`
        `completions` per problem and their `lengths` ([N * k]). Returns whether each completion is right as
        `accuracy` reads it (the lenient answer equals the reference)."""
        keep = self._counted_completions(counted)
        if keep:
            kept_answers = [str(a) for a, c in zip(answers, counted, strict=True) if c]
            self.accuracy.update([completions[i] for i in keep], kept_answers)
            self.completion_length.update(lengths[keep].float())
        references = [reference_answer(str(a)) for a in answers]
        return [extract_answer(c) == references[i // self.k] for i, c in enumerate(completions)]

    def update_rewards(
        self, counted: Sequence[bool], lengths: Tensor, rewards: Sequence[float | None]
    ) -> list[bool]:
        """Fold in a batch judged by the set's reward: one reward per completion (None counts as wrong).
        Returns whether each completion is right as `accuracy` counts it (full marks)."""
        keep = self._counted_completions(counted)
        if keep:
            self.accuracy.update([0.0 if rewards[i] is None else rewards[i] for i in keep])
            self.completion_length.update(lengths[keep].float())
        return [r is not None and r >= self.accuracy.full_marks for r in rewards]

    def _counted_completions(self, counted: Sequence[bool]) -> list[int]:
        return [i for i, c in enumerate(counted) for i in range(i * self.k, (i + 1) * self.k) if c]

    def metric_names(self) -> list[str]:
        """The names `compute` logs."""
        return [self.prefix + key for key in (*self.accuracy.KEYS, "completion_length")]

    def compute(self) -> dict[str, Tensor]:
        """The metrics over every rank's counted rows, under their logged names; resets for the next run.
        Call it outside inference mode: states reset inside it could not be updated in place later."""
        results = {**self.accuracy.compute(), "completion_length": self.completion_length.compute()}
        self.accuracy.reset()
        self.completion_length.reset()
        return {self.prefix + key: value for key, value in results.items()}
