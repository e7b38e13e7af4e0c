"""Training without a data set, as TRL's `GRPOTrainer(train_dataset=None, environment_factory=...)`: the
environment owns the task, and each rollout's `reset` writes its prompt.

`EnvironmentPromptDataModule` holds one training step's worth of placeholder rows (an empty user turn each,
as TRL builds one generation round's worth), cycled every step; the run's length is `trainer.max_steps`,
which it requires, as TRL requires `max_steps`.
"""

from torch.utils.data import DataLoader

from grpo_lightning.core.options import check_arguments
from grpo_lightning.io.rows import ENVIRONMENT_PROMPT, Row
from grpo_lightning.training.data.prompts import AtLeastOne, NonNegativeInt, PromptDataModule
from grpo_lightning.training.validation_sets import ValidationSet, check_validation_sets


class EnvironmentPromptDataModule(PromptDataModule):
    """Prompts that an `environment_factory`'s environments write: no data set, TRL's `train_dataset=None`.

    Each training step takes `batch_size` rows per rank (each sampled `num_generations` times), every one an
    empty user turn that the sample's environment's `reset()` fills with the text it returns. The rows carry
    no columns, so `reset` is called with no keywords (TRL passes its placeholder prompt as `prompt=`; an
    environment written for TRL takes `**kwargs` and works with both). One epoch is one training step:
    set `trainer.max_steps` to the run's length. `environment_factory` must be one environment (a dict of
    them needs rows naming each row's own: a data set with an `environment` column, read by
    `PromptDataModule`).

    The data has no answers to validate against: `trainer.validate` scores only `val_sets`, each with its
    own source (`grpo_lightning.training.validation_sets.ValidationSet`).

    Args:
        batch_size: prompts per training step on each rank. Default 4.
        seed: seed of the loader's order (the rows are all alike). Default 0.
        num_workers: data loader worker processes. Default 0.
        val_sets: validation sets, each scored on its own as `val/<name>/...`. Default None: no validation.
    """

    def __init__(
        self,
        batch_size: AtLeastOne = 4,
        seed: int = 0,
        num_workers: NonNegativeInt = 0,
        val_sets: list[ValidationSet] | None = None,
    ) -> None:
        super().__init__(
            None, batch_size=batch_size, val_size=0, seed=seed, num_workers=num_workers, val_sets=val_sets
        )

    def check_options(self) -> None:
        check_arguments(
            "data", EnvironmentPromptDataModule.__init__, self.hparams, ["batch_size", "num_workers"]
        )
        check_validation_sets(self.val_sets)

    def setup(self, stage: str | None = None) -> None:
        trainer = self.trainer
        if stage == "fit" and trainer is not None and trainer.max_steps <= 0:
            raise ValueError(
                f"trainer.max_steps={trainer.max_steps}: EnvironmentPromptDataModule has no data set to run "
                "out of (the environment writes every prompt), so set the run's length in training steps"
            )
        super().setup(stage)

    def _split_rows(self) -> tuple[list[Row], list[Row]]:
        """One training step's rows on every rank, no validation rows."""
        world = self.trainer.world_size if self.trainer is not None else 1
        count = world * self.hparams.batch_size
        return [{"prompt": [dict(message) for message in ENVIRONMENT_PROMPT]} for _ in range(count)], []

    def _test_split_rows(self) -> list[Row]:
        return []

    def validation_sets_in_order(self, stage: str = "val") -> list[ValidationSet | None]:
        """Only `val_sets`: the placeholder rows have no answers (no `val/...` metrics of their own)."""
        return list(self.val_sets)

    def _evaluation_loaders(self, stage: str) -> DataLoader | list[DataLoader]:
        # No loader without `val_sets`: Lightning skips the loop (it warns about an empty loader).
        return super()._evaluation_loaders(stage) if self.val_sets else []

    def _source_name(self) -> str:
        return "environment prompts"
