"""Data for GRPO as a LightningDataModule: prompts in TRL's format (GSM8K's preset: `gsm8k`).

`PromptDataModule` reads rows with a `prompt` column (text, or a list of chat messages, as TRL's "prompt-only"
data sets) from whatever `datasets` holds or reads: a `Dataset` / `DatasetDict` object, a `save_to_disk`
folder, local `.jsonl` / `.json` / `.parquet` / `.csv` files (also compressed), or a hub data set. Each batch
is a dict of lists: `prompt` and every other column of the rows, which reach the reward functions as keyword
lists, as in TRL. The columns the reward functions and the validation check need are checked when `fit` or
`validate` sets up, before any weights load (`check_columns`).

`trainer.test` scores the source's test split (every row; `Trainer(limit_test_batches=...)` takes fewer) as
`test/...`, and each of `val_sets` as `test/<name>/...`; a source without a test split (one file, one
`Dataset`, the arithmetic task) is tested on its validation rows. `trainer.predict` samples answers to the
same rows' prompts.
"""

import functools
import random
import string
import warnings
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Annotated, Literal

import lightning as L
import torch
from torch.utils.data import DataLoader, DistributedSampler

from grpo_lightning.core.options import Range, check_arguments
from grpo_lightning.core.rewards.scoring import required_columns
from grpo_lightning.core.rewards.verifiable import reward_name
from grpo_lightning.io.rows import (
    ENVIRONMENT_COLUMN,
    ENVIRONMENT_PROMPT,
    Row,
    chat_prompt,
    check_answer,
    check_few_shot,
    check_prompt,
    check_same_columns,
    collate_rows,
    has_split,
    is_dataset,
    read_split_records,
)
from grpo_lightning.training.resume import ResumableSampler
from grpo_lightning.training.validation_sets import (
    ValidationSet,
    check_validation_sets,
    in_order_sampler,
    rank_share,
    read_validation_rows,
)

if TYPE_CHECKING:  # a type of `source`; `datasets` is imported where a source needs it
    from datasets import Dataset, DatasetDict

# The options' types, shared by the data modules' signatures (jsonargparse reads and `--help` prints them).
AtLeastOne = Annotated[int, Range(">= 1")]
NonNegativeInt = Annotated[int, Range(">= 0")]
ValSplit = Literal["holdout", "test"]


class PromptDataModule(L.LightningDataModule):
    """Prompts in TRL's format for GRPO training and held-out evaluation.

    Rows hold a prompt column (text, or a list of `{"role", "content"}` chat messages) and any other columns
    (`solution`, `answer`, ...): a batch passes the prompts to the policy and every other column to the
    reward functions, as TRL's `GRPOTrainer` does. Every row is checked before any weights load; a bad one
    raises `ValueError` naming it (file:line, or data set, split and row) and the field at fault.

    Args:
        source: where the rows come from: a `datasets.Dataset` (the training rows) or `DatasetDict` (its
            "train" and "test" splits); a folder written by `save_to_disk`; a folder holding `train.jsonl`
            (or `.json`, `.parquet`, `.csv`, `.tsv`, `.arrow`, each also `.gz` / `.bz2` / `.xz`) and
            optionally `test.*`, or any other folder `datasets.load_dataset` reads; a single such file; or a
            hub data set loaded with `datasets.load_dataset(source, config_name, split=...)`. Required.
        config_name: the hub data set's configuration (GSM8K's is "main"); None for its default.
        prompt_field: the column holding the prompt. Default "prompt". It reaches the rewards as `prompts`.
            A row without it but with an `environment` column (TRL's routing data set of
            `environment_factory`) starts from an empty user turn that the environment's `reset` writes.
        system_prompt: a system message put before each prompt, which makes every prompt chat messages
            (open-r1's `system_prompt`): a text prompt becomes `[{"role": "system", "content":
            system_prompt}, {"role": "user", "content": <the text>}]`; a chat prompt gets the system turn
            put first, and one that already starts with a system turn is refused (two system turns are
            something no chat template expects). Default None: none.
        prompt_template: a Python format string over the row's columns that writes each text prompt
            (`"Solve: {question}"`), instead of reading `prompt_field`; the other columns still reach the
            rewards, and a row's own `prompt` column, which the template may read, is replaced by the
            text. A `{name}` that is no column is refused before any weights load. Default None.
        chat_prompt: make each text prompt the user's turn of a conversation, rendered through the chat
            template (TRL's "conversational" format; open-r1 makes one from its `dataset_prompt_column`).
            Default False: a text prompt stays text, tokenized as it is without any chat template (TRL's
            "standard" format), unless `system_prompt` is set, which implies a conversation. Prompts that
            are chat messages in the rows are conversational either way.
        few_shot: worked examples put before each prompt as earlier turns of its conversation (after the
            system turn): user, assistant and, to show a tool exchange, tool messages (`{"role": "tool",
            "name": ..., "content": ...}`; the assistant's calls written as text in the model's tool-call
            format), opening with a user turn and closing with an assistant's. A tool exchange reads as the
            rollout's own tool turns will: where the chat template shows no tools, the results become the
            user turn of `<tool_response>` blocks the rollout writes. The rewards see them in `prompts`,
            never in a completion. Implies a conversation, as `system_prompt` does. Default None: none.
        answer_field: the column holding the reference answer that validation checks (a number, or
            GSM8K's `#### N` form) when the model has no `val_reward`. Default "answer"; rows need it only
            for that check.
        batch_size: prompts per training step (each is sampled `num_generations` times). Default 4.
        val_size: rows of the train split held out for validation, >= 0. Default 64.
        val_split: "holdout" (the held-out train rows) or "test" (the test split) for validation.
        val_batch_size: prompts per validation step. Default 16.
        train_size: use only this many training rows (after the hold-out), >= 1. Default all.
        seed: seed of the hold-out split and shuffling. Default 0. Logged with the data module's
            hyper-parameters as `seed`: a project that logs a `seed` of its own with another value gets two
            values for one name, which MLflow refuses; give the data module the same one
            (`docs/from_lightning.md`).
        num_workers: data loader worker processes. Default 0.
        val_sets: more validation sets, each scored on its own as `val/<name>/...`
            (`grpo_lightning.training.validation_sets.ValidationSet`: source, answer checker, samples per
            problem).
            Default None: only the rows above, as `val/...`.
    """

    def __init__(
        self,
        source: "str | Dataset | DatasetDict",
        config_name: str | None = None,
        prompt_field: str = "prompt",
        answer_field: str = "answer",
        system_prompt: str | None = None,
        prompt_template: str | None = None,
        chat_prompt: bool = False,
        few_shot: list[dict[str, str]] | None = None,
        batch_size: AtLeastOne = 4,
        val_size: NonNegativeInt = 64,
        val_split: ValSplit = "holdout",
        val_batch_size: AtLeastOne = 16,
        train_size: AtLeastOne | None = None,
        seed: int = 0,
        num_workers: NonNegativeInt = 0,
        val_sets: list[ValidationSet] | None = None,
    ) -> None:
        super().__init__()
        # Their reward functions, and a data set object, do not go in checkpoints: the hyper-parameters hold
        # `source` only when it is a path or hub id.
        self.save_hyperparameters(ignore=["val_sets", "source"])
        self.hparams["source"] = source if isinstance(source, str) else None
        self.source = source
        self.val_sets = list(val_sets or [])
        self.val_set_rows: list[list[Row]] = []  # each set's rows, read in `setup`
        self.train_rows: list[Row] = []
        self.val_rows: list[Row] = []
        self.test_rows: list[Row] = []  # read in `setup` for `test` and `predict`
        self._resume_at: dict[str, int] | None = None  # from a checkpoint, for the next train_dataloader()

    def check_options(self) -> None:
        """Range-check every option; `setup` calls it, before any rows are read or weights load.

        Not in `__init__`: LightningCLI builds the data module inside a type union, which would fold the
        one-line message into a page of jsonargparse's own.
        """
        hp, signature = self.hparams, PromptDataModule.__init__
        check_arguments("data", signature, hp, ["val_split"])
        if not is_dataset(self.source) and (not isinstance(self.source, str) or not self.source.strip()):
            raise ValueError(
                f"data.source={self.source!r}: name a hub data set, a folder or a file, or give a "
                "datasets.Dataset or DatasetDict"
            )
        names = ["batch_size", "val_batch_size", "val_size", "train_size", "num_workers"]
        check_arguments("data", signature, hp, names)
        check_validation_sets(self.val_sets)
        if hp.get("few_shot") is not None:
            check_few_shot(hp.few_shot)
        self._template_columns()

    def _template_columns(self) -> list[str]:
        """The columns `prompt_template` names, or `ValueError` for a template that `str.format` cannot
        fill from columns (a broken brace, a `{}` without a name)."""
        template = self.hparams.get("prompt_template")
        if template is None:
            return []
        try:
            names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
        except ValueError as err:
            raise ValueError(f"data.prompt_template={template!r}: not a format string ({err})") from None
        columns = [name.split(".")[0].split("[")[0] for name in names]
        if not columns or any(not column or column.isdigit() for column in columns):
            raise ValueError(
                f"data.prompt_template={template!r}: name the columns it reads in braces, e.g. "
                "'Solve: {question}'"
            )
        return columns

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
        if hp.prompt_template is not None:
            prompt, field = self._templated_prompt(row, where), "prompt"
            out = {k: v for k, v in row.items() if k != "prompt"}
        elif hp.prompt_field not in row and ENVIRONMENT_COLUMN in row:  # the environment writes the prompt
            return {"prompt": [dict(message) for message in ENVIRONMENT_PROMPT], **row}
        else:
            if hp.prompt_field not in row:
                raise ValueError(
                    f"{where}: missing field {hp.prompt_field!r} (has {sorted(row)}); name the prompt column "
                    "with data.prompt_field"
                )
            prompt, field = row[hp.prompt_field], hp.prompt_field
            out = {k: v for k, v in row.items() if k != hp.prompt_field}
            if "prompt" in out:  # it would replace the prompt read from prompt_field
                raise ValueError(
                    f"{where}: has a column 'prompt' beside the prompt column {hp.prompt_field!r} "
                    "(data.prompt_field): rename one of them"
                )
        check_prompt(prompt, where, field)
        if hp.answer_field in row:
            check_answer(row[hp.answer_field], where, hp.answer_field)
        return {"prompt": self._as_conversation(prompt, where, field), **out}

    def _templated_prompt(self, row: Row, where: str) -> str:
        """`prompt_template` filled from the row's columns; a name that is no column is refused."""
        template = self.hparams.prompt_template
        missing = [column for column in self._template_columns() if column not in row]
        if missing:
            raise ValueError(
                f"{where}: data.prompt_template={template!r} names {{{missing[0]}}}, which is not a column "
                f"(the columns are {sorted(row)}): name a column in braces"
            )
        try:
            return template.format_map(row)
        except (KeyError, IndexError, AttributeError, TypeError, ValueError) as err:
            raise ValueError(
                f"{where}: data.prompt_template={template!r} cannot be filled from the row "
                f"({type(err).__name__}: {err})"
            ) from None

    def _as_conversation(self, prompt: str | list, where: str, field: str) -> str | list:
        """The prompt as `system_prompt`, `few_shot` and `chat_prompt` make it: a text prompt as the user's
        turn (after the system turn and the examples), a chat prompt with the system turn put first and the
        examples after its own system turn; else as it is."""
        system_prompt, few_shot = self.hparams.system_prompt, self.hparams.get("few_shot")
        if isinstance(prompt, str):
            return chat_prompt(prompt, system_prompt, few_shot) if self.makes_conversations else prompt
        if system_prompt:
            if prompt[0]["role"] == "system":
                raise ValueError(
                    f"{where}: field {field!r} starts with a system message of its own, and "
                    "data.system_prompt would put a second one before it: drop data.system_prompt, or the "
                    "rows' system messages"
                )
            prompt = [{"role": "system", "content": system_prompt}, *prompt]
        if not few_shot:
            return prompt
        at = int(prompt[0]["role"] == "system")  # the examples after the system turn
        return [*prompt[:at], *(dict(m) for m in few_shot), *prompt[at:]]

    @property
    def makes_conversations(self) -> bool:
        """Whether text prompts become chat messages (`chat_prompt`, a `system_prompt` or `few_shot`)."""
        hp = self.hparams
        return bool(hp.get("chat_prompt")) or hp.system_prompt is not None or hp.get("few_shot") is not None

    def _records(self, split: str) -> list[tuple[str, object]]:
        return read_split_records(self.source, self.hparams.config_name, split)

    def _read_split(self, split: str) -> tuple[list[Row], list[str]]:
        """A split's checked rows and where each comes from. Every row of a split has the same columns (a
        batch needs them); another split's may differ (a test split's `id`): what a split is judged by is
        checked by `check_columns`."""
        records = self._records(split)
        if not records:
            raise ValueError(f"data.source={self._source_name()}: the {split} split has no rows")
        rows = [self._prepare_row(row, where) for where, row in records]
        wheres = [where for where, _ in records]
        check_same_columns(rows, wheres)
        return rows, wheres

    def _source_name(self) -> str:
        return repr(self.source) if isinstance(self.source, str) else f"a {type(self.source).__name__}"

    def _split_rows(self) -> tuple[list[Row], list[Row]]:
        """Training and validation rows: a seeded hold-out of the train split, or the test split."""
        hp = self.hparams
        rows, _ = self._read_split("train")
        order = list(range(len(rows)))
        random.Random(hp.seed).shuffle(order)
        holdout = hp.val_size if hp.val_split == "holdout" else 0
        if holdout >= len(rows):
            raise ValueError(f"data.val_size={hp.val_size} leaves no training rows out of {len(rows)}")
        val_rows = [rows[i] for i in order[:holdout]]
        train_rows = [rows[i] for i in order[holdout:]][: hp.train_size]
        if hp.val_split == "test" and hp.val_size > 0:
            val_rows = self._read_split("test")[0][: hp.val_size]
        return train_rows, val_rows

    def _test_split_rows(self) -> list[Row]:
        """The rows `test` and `predict` take: the source's test split where it has one, else the validation
        rows."""
        if not has_split(self.source, "test"):
            return self.val_rows
        return self._read_split("test")[0]

    def setup(self, stage: str | None = None) -> None:
        self.check_options()
        if not self.train_rows:
            self.train_rows, self.val_rows = self._split_rows()
        if stage in ("test", "predict") and not self.test_rows:
            self.test_rows = self._test_split_rows()
        if self.val_sets and not self.val_set_rows:
            self.val_set_rows = [read_validation_rows(validation_set) for validation_set in self.val_sets]
        if stage == "validate" and not self.val_rows and not self.val_sets:
            raise ValueError(
                f"nothing to validate: data.val_size={self.hparams.val_size} gives no validation rows"
            )

    def check_columns(
        self,
        reward_funcs: Sequence[Callable],
        val_reward: Callable | None,
        validates: bool,
        supplied: Collection[str] | None = (),
    ) -> None:
        """Refuse, before any training step, rows that lack a column the reward functions require (every
        parameter without a default beyond the keywords each call gets, `scoring.required_columns`), or one
        that the validation check reads (`val_reward`'s columns, else the answer column) in the rows the
        trainer's loop judges: the validation rows when `validates` (`fit`, `validate`), the test rows in
        `test` (unless `limit_test_batches` is 0); none in `predict`, which only answers the prompts.
        `supplied`: keywords the rollouts add (a multi-turn rollout's `environments`); None where they are
        known only once sampled (a rollout function's fields), and the training rows are not checked."""
        train_columns = (
            set(self.train_rows[0]) - {"prompt"} if self.train_rows and supplied is not None else None
        )
        train_columns = None if train_columns is None else train_columns | set(supplied)
        for fn in reward_funcs if train_columns is not None else []:
            missing = [c for c in required_columns(fn) if c not in train_columns]
            if missing:
                raise ValueError(
                    f"reward function {reward_name(fn)!r} needs the data column {missing[0]!r}, which the "
                    f"training rows lack (they have {sorted(train_columns)}): rename the column in the data, "
                    "or choose another reward function"
                )
        which, judged = self._judged_rows(validates)
        if not judged:
            return
        val_columns = set(judged[0]) - {"prompt"}
        if val_reward is not None:
            missing = [c for c in required_columns(val_reward) if c not in val_columns]
            if missing:
                raise ValueError(
                    f"model.val_reward {reward_name(val_reward)!r} needs the data column {missing[0]!r}, "
                    f"which the {which} rows lack (they have {sorted(val_columns)})"
                )
        elif self.answer_column not in val_columns:
            raise ValueError(
                f"validation checks the reference answer in the data column {self.answer_column!r}, which "
                f"the {which} rows lack (they have {sorted(val_columns)}): name the answer column with "
                "data.answer_field, or judge the completions with model.val_reward (e.g. "
                "trl.rewards.accuracy_reward for a `solution` column)"
            )

    def _judged_rows(self, validates: bool) -> tuple[str, list[Row]]:
        """The rows the trainer's loop judges against their reference, and what they are called."""
        loop = self.trainer.state.fn if self.trainer is not None else "fit"
        if loop == "predict":
            return "predicted", []
        if loop == "test":
            return "test", self.test_rows if self.trainer.limit_test_batches != 0 else []
        return "validation", self.val_rows if validates else []

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

    def validation_sets_in_order(self, stage: str = "val") -> list[ValidationSet | None]:
        """The set behind each validation (`stage` "val") or test ("test") loader: None for this module's own
        rows (`val/...`, `test/...` metrics)."""
        own = self.test_rows if stage == "test" else self.val_rows
        return ([None] if own or not self.val_sets else []) + self.val_sets

    def _evaluation_loaders(self, stage: str) -> DataLoader | list[DataLoader]:
        # Each rank scores its own rows, padded to equal counts with repeats that no metric counts
        # (`validation_sets.rank_share`): Lightning's sampler would count the repeats.
        world, rank = (self.trainer.world_size, self.trainer.global_rank) if self.trainer else (1, 0)
        loaders = []
        for validation_set in self.validation_sets_in_order(stage):
            if validation_set is None:
                rows = self.test_rows if stage == "test" else self.val_rows
                size = self.hparams.val_batch_size
            else:
                rows = self.val_set_rows[self.val_sets.index(validation_set)]
                size = validation_set.batch_size or self.hparams.val_batch_size
            share = rank_share(rows, rank, world)
            loaders.append(self._loader(share, size, in_order_sampler(share)))
        return loaders[0] if not self.val_sets else loaders

    def val_dataloader(self) -> DataLoader | list[DataLoader]:
        return self._evaluation_loaders("val")

    def test_dataloader(self) -> DataLoader | list[DataLoader]:
        """The test split's rows (`test/...`), then each of `val_sets` (`test/<name>/...`)."""
        return self._evaluation_loaders("test")

    def predict_dataloader(self) -> DataLoader:
        """The test split's rows, whose prompts `trainer.predict` answers."""
        world, rank = (self.trainer.world_size, self.trainer.global_rank) if self.trainer else (1, 0)
        share = rank_share(self.test_rows, rank, world)
        return self._loader(share, self.hparams.val_batch_size, in_order_sampler(share))
