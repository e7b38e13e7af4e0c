"""Validation scoring: one `SetScores` per validation loader, filled step by step, computed at the end, on
the random stream of its own.

`GRPOModule`'s validation hooks call `ValidationScoring.start`, `.step` and `.end`, one line each. The
data module's own rows are scored as `val/...` (by `val_reward`, or the numeric answer column with
`GSM8KAccuracy`), each of its `val_sets` as `val/<name>/...`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torchmetrics import Metric

from grpo_lightning.core.rewards.scoring import RewardInputs, call_reward
from grpo_lightning.core.rng import capture_rng_states, restore_rng_states
from grpo_lightning.core.types import Rollout
from grpo_lightning.training.data import PromptDataModule
from grpo_lightning.training.validation_sets import COUNTED, SetScores

Sample = Callable[..., tuple[Rollout, list[str]]]  # (prompts, k, do_sample=) -> rollout, completions
MakeRewardInputs = Callable[[dict, Rollout, list[str], int], RewardInputs]  # (batch, rollout, completions, i)


class ValidationScoring:
    """The validation of one `GRPOModule`.

    Args:
        num_generations: samples per problem of the data module's own rows; 1 decodes greedily.
        reward: the function that judges those rows' completions, or None for the numeric answer column.
        accuracy: the metric of those rows (`GSM8KAccuracy` or `RewardAccuracy`, owned by the module).
    """

    def __init__(self, num_generations: int, reward: Callable | None, accuracy: Metric) -> None:
        self.num_generations, self.reward, self.accuracy = num_generations, reward, accuracy
        self.scores: list[SetScores] = []  # per validation loader, built as each validation starts
        self.answer_column = "answer"
        self.training_rng: dict | None = None  # the training stream's generators while validation runs

    def start(self, datamodule: object, device: torch.device) -> None:
        # Validation sampling must not move the training stream: how often it runs (or whether a resumed
        # run repeats it) then never changes which completions training samples.
        self.training_rng = capture_rng_states()
        self.answer_column = getattr(datamodule, "answer_column", "answer")
        self.scores = [scores.to(device) for scores in self._set_scores(datamodule)]

    def _set_scores(self, datamodule: object) -> list[SetScores]:
        """One `SetScores` per validation loader: the data module's own rows (`val/...`), then its
        `val_sets` (`val/<name>/...`)."""
        sets = datamodule.validation_sets_in_order() if isinstance(datamodule, PromptDataModule) else [None]
        return [
            SetScores("val/", self.num_generations, self.reward, accuracy=self.accuracy)
            if s is None
            else SetScores(f"val/{s.name}/", s.num_generations, s.reward, s.answer_field)
            for s in sets
        ]

    def metric_names(self, datamodule: object) -> list[str]:
        """Every metric `end` returns for `datamodule`'s validation loaders (`val/...`, `val/<name>/...`)."""
        return [name for scores in self._set_scores(datamodule) for name in scores.metric_names()]

    def step(
        self,
        batch: dict[str, list],
        batch_idx: int,
        dataloader_idx: int,
        sample: Sample,
        reward_inputs: MakeRewardInputs,
    ) -> dict[str, list[str]]:
        """Sample `batch`'s completions with the module's `sample` and score them into its loader's
        `SetScores` (`reward_inputs`: the module's, for a set judged by a reward function)."""
        scores = self.scores[dataloader_idx]
        counted = batch.pop(COUNTED, [True] * len(batch["prompt"]))  # False: a rank's padding repeat
        rollout, completions = sample(batch["prompt"], scores.k, do_sample=scores.k > 1)
        lengths = rollout.completion_mask.sum(1)  # [N * k]
        # What was judged, as the metrics judged it, for callbacks such as ValidationResultsWriter.
        judged = {"completions": completions, "set": scores.name, "counted": counted}
        if scores.reward is not None:
            inputs = reward_inputs(batch, rollout, completions, batch_idx)
            rewards = call_reward(scores.reward, inputs)
            judged |= {"rewards": rewards, "correct": scores.update_rewards(counted, lengths, rewards)}
        else:
            column = scores.answer_column or self._answer_column(batch)
            correct = scores.update_answers(counted, lengths, completions, batch[column])
            judged |= {"answer_column": column, "correct": correct}
        return judged

    def _answer_column(self, batch: dict[str, list]) -> str:
        """The batch column validation checks completions against: the data module's answer column."""
        if self.answer_column not in batch:
            raise ValueError(
                f"validation checks answers against a reference, but the data has no answer column "
                f"{self.answer_column!r} (columns: {sorted(batch)}): set data.answer_field to the "
                "reference's column, or model.val_reward to a reward function that judges the completions"
            )
        return self.answer_column

    def end(self) -> dict[str, Tensor]:
        """Every set's metrics; the training stream's generators back in place."""
        # Outside inference mode: states reset inside `trainer.validate` would become inference tensors,
        # which a later validation within `fit` (no_grad only) could not update in place.
        with torch.inference_mode(False):
            results = {key: value for scores in self.scores for key, value in scores.compute().items()}
        restore_rng_states(self.training_rng)
        self.training_rng = None  # back on the training stream
        return results
