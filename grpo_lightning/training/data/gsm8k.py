"""GSM8K's preset of `PromptDataModule`: the prompts built from a question column (an optional system
prompt, then the question as the user's turn), every answer checked to end in GSM8K's `#### N` line, and
the built-in arithmetic task (`source: arithmetic`).
"""

from typing import TYPE_CHECKING

from grpo_lightning.core.options import check_arguments
from grpo_lightning.io.arithmetic_task import arithmetic_problems
from grpo_lightning.io.rows import DEFAULT_SYSTEM_PROMPT, Row, chat_prompt, check_row
from grpo_lightning.training.data.prompts import AtLeastOne, NonNegativeInt, PromptDataModule, ValSplit
from grpo_lightning.training.validation_sets import ValidationSet

if TYPE_CHECKING:  # a type of `source`; `datasets` is imported where a source needs it
    from datasets import Dataset, DatasetDict


class GSM8KDataModule(PromptDataModule):
    """GSM8K (or any question + `#### N` answer data) for GRPO training and held-out evaluation: a preset of
    `PromptDataModule` that builds each prompt from the question (an optional system prompt, then the
    question as the user's turn) and checks that every answer ends in a `#### N` line.

    Rows are `{"question": str, "answer": str, ...}` (other column names through `question_field` /
    `answer_field`). They reach the rewards as `question`, `answer`, the final number after `####` (as the
    GSM8K recipes of TRL and unsloth keep it, for exact-match rewards), and `worked_solution`, the answer
    column as written.

    Args:
        source: `"arithmetic"` (the built-in generated task, no download), or any source
            `PromptDataModule` reads (a `Dataset` / `DatasetDict`, a `save_to_disk` folder, a folder of
            `train` / `test` files, one file, a hub data set). Default `"openai/gsm8k"`.
        system_prompt: system message asking for the `#### N` form; None for none.
        few_shot: worked examples as earlier turns of each prompt's conversation, between the system turn
            and the question (`PromptDataModule`'s `few_shot`). Default None: none.
        batch_size: prompts per training step (each is sampled `num_generations` times). Default 4.
        val_size: rows of the train split held out for validation, >= 0. Default 64.
        val_split: "holdout" (the held-out train rows) or "test" (the test split) for validation.
        val_batch_size: prompts per validation step. Default 16.
        train_size: use only this many training rows (after the hold-out), >= 1. Default all.
        arithmetic_size: rows generated for `source="arithmetic"` (train + held-out), >= 1. Default 2000.
        question_field / answer_field: column names in the source, mapped to `question` / `answer`.
        seed: seed of the hold-out split and shuffling. Default 0. Logged with the data module's
            hyper-parameters as `seed`: a project that logs a `seed` of its own with another value gets two
            values for one name, which MLflow refuses; give the data module the same one
            (`docs/from_lightning.md`).
        num_workers: data loader worker processes. Default 0.
        config_name: the hub data set's configuration; None for its default, which for "openai/gsm8k"
            (whose configurations are "main" and "socratic") means "main".
        val_sets: more validation sets, as in `PromptDataModule`. Default None.
    """

    def __init__(
        self,
        source: "str | Dataset | DatasetDict" = "openai/gsm8k",
        system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
        few_shot: list[dict[str, str]] | None = None,
        batch_size: AtLeastOne = 4,
        val_size: NonNegativeInt = 64,
        val_split: ValSplit = "holdout",
        val_batch_size: AtLeastOne = 16,
        train_size: AtLeastOne | None = None,
        arithmetic_size: AtLeastOne = 2000,
        question_field: str = "question",
        answer_field: str = "answer",
        seed: int = 0,
        num_workers: NonNegativeInt = 0,
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
            system_prompt=system_prompt,
            few_shot=few_shot,
            seed=seed,
            num_workers=num_workers,
            val_sets=val_sets,
        )

    def check_options(self) -> None:
        super().check_options()
        check_arguments("data", GSM8KDataModule.__init__, self.hparams, ["arithmetic_size"])

    @property
    def answer_column(self) -> str:
        return "answer"  # `answer_field` is renamed to `answer`

    def _prepare_row(self, row: object, where: str) -> Row:
        hp = self.hparams
        checked = check_row(row, where, hp.question_field, hp.answer_field)
        if "prompt" in checked:  # it would replace the prompt built from the question
            raise ValueError(
                f"{where}: has a column 'prompt', but the GSM8K preset builds the prompt from "
                f"{hp.question_field!r}: rename the column, or read the rows with PromptDataModule"
            )
        return {"prompt": chat_prompt(checked["question"], hp.system_prompt, hp.few_shot), **checked}

    def _test_split_rows(self) -> list[Row]:
        return self.val_rows if self.source == "arithmetic" else super()._test_split_rows()

    def _split_rows(self) -> tuple[list[Row], list[Row]]:
        hp = self.hparams
        if self.source != "arithmetic":
            return super()._split_rows()
        train = [self._prepare_row(r, "arithmetic") for r in arithmetic_problems(hp.arithmetic_size, hp.seed)]
        seen = {row["question"] for row in train}
        # Held-out problems come from another seed, minus any that the training set happens to contain.
        held_out = [r for r in arithmetic_problems(2 * hp.val_size, hp.seed + 1) if r["question"] not in seen]
        val = [self._prepare_row(r, "arithmetic") for r in held_out[: hp.val_size]]
        return train[: hp.train_size], val
