"""Validation scoring: one `SetScores` per validation loader, filled step by step, computed at the end, on
the random stream of its own.

`GRPOModule`'s validation and test hooks call `ValidationScoring.start`, `.step` and `.end`, one line each.
The data module's own rows are scored as `val/...` (by `val_reward`, or the numeric answer column with
`GSM8KAccuracy`), each of its `val_sets` as `val/<name>/...`; its test rows and sets likewise as `test/...`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torchmetrics import Metric
from transformers import TrainerState

from grpo_lightning.core.group_source import reward_inputs
from grpo_lightning.core.metrics import GSM8KAccuracy, RewardAccuracy
from grpo_lightning.core.rewards.scoring import call_reward
from grpo_lightning.core.rng import capture_rng_states, restore_rng_states
from grpo_lightning.training.data import PromptDataModule
from grpo_lightning.training.rollouts import PolicyRollouts
from grpo_lightning.training.validation_sets import COUNTED, SetScores


class ValidationScoring:
    """The validation of one `GRPOModule`.

    Args:
        num_generations: samples per problem of the data module's own rows, >= 1; 1 decodes greedily.
        reward: the function that judges those rows' completions, or None for the numeric answer column.
    """

    def __init__(self, num_generations: int, reward: Callable | None) -> None:
        if num_generations < 1:
            raise ValueError(f"num_generations_eval must be >= 1, got {num_generations}")
        self.num_generations, self.reward = num_generations, reward
        # The metric of those rows; the module holds it too, so that it moves to the module's device.
        self.accuracy: Metric = (GSM8KAccuracy if reward is None else RewardAccuracy)(k=num_generations)
        self.scores: list[SetScores] = []  # per validation loader, built as each validation starts
        self.answer_column = "answer"
        self.training_rng: dict | None = None  # the training stream's generators while validation runs

    def start(self, datamodule: object, device: torch.device, stage: str = "val") -> None:
        """Before a validation (`stage` "val") or test ("test") loop: its sets' scores, the training stream's
        generators put aside."""
        # Validation sampling must not move the training stream: how often it runs (or whether a resumed
        # run repeats it) then never changes which completions training samples.
        self.training_rng = capture_rng_states()
        self.answer_column = getattr(datamodule, "answer_column", "answer")
        self.scores = [scores.to(device) for scores in self._set_scores(datamodule, stage)]

    def _set_scores(self, datamodule: object, stage: str = "val") -> list[SetScores]:
        """One `SetScores` per loader of `stage`: the data module's own rows (`<stage>/...`), then its
        `val_sets` (`<stage>/<name>/...`)."""
        own = isinstance(datamodule, PromptDataModule)
        sets = datamodule.validation_sets_in_order(stage) if own else [None]
        return [
            SetScores(f"{stage}/", self.num_generations, self.reward, accuracy=self.accuracy)
            if s is None
            else SetScores(f"{stage}/{s.name}/", s.num_generations, s.reward, s.answer_field)
            for s in sets
        ]

    def metric_names(self, datamodule: object) -> list[str]:
        """Every metric `end` returns for `datamodule`'s validation loaders (`val/...`, `val/<name>/...`)."""
        return [name for scores in self._set_scores(datamodule) for name in scores.metric_names()]

    def step(
        self, batch: dict[str, list], dataloader_idx: int, rollouts: PolicyRollouts, state: TrainerState
    ) -> dict[str, list[str]]:
        """Sample `batch`'s completions with the module's `rollouts` and score them into its loader's
        `SetScores` (`state`: the trainer's, for a set judged by a reward function)."""
        scores = self.scores[dataloader_idx]
        counted = batch.pop(COUNTED, [True] * len(batch["prompt"]))  # False: a rank's padding repeat
        rollout, completions, turns = rollouts.sample_batch(batch, scores.k, do_sample=scores.k > 1)
        lengths = rollout.model_mask.sum(1)  # [N * k] the model's tokens
        # What was judged, as the metrics judged it, for callbacks such as ValidationResultsWriter.
        judged = {"completions": completions, "set": scores.name, "counted": counted}
        if turns is not None and turns.messages is not None:
            judged["transcripts"] = turns.messages  # each sample's tool calls and results
        if scores.reward is not None:
            inputs = reward_inputs(batch, rollout, completions, state, turns)
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
