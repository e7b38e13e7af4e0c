"""The held-out loops of `GRPOModule`, as Lightning hooks: validation and test score the data module's rows
and sets (`validation_scores.ValidationScoring`: `val/...`, `test/...`), predict answers any prompts; each
samples through the module's rollout engine (greedy with one completion per problem), as training does.
"""

from __future__ import annotations

from grpo_lightning.training.tool_rollouts import prompt_answers
from grpo_lightning.training.validation_sets import COUNTED


class HeldOutLoops:
    """Validation, test and predict for a LightningModule that holds `validation` (`ValidationScoring`),
    `rollouts` (`PolicyRollouts`), `on_validation_start` (the rollout engine placed) and `_trainer_state`
    (the rewards' `trainer_state`)."""

    def on_validation_epoch_start(self) -> None:
        self.validation.start(self.trainer.datamodule, self.device)

    def validation_step(self, batch: dict[str, list], batch_idx: int, dataloader_idx: int = 0) -> dict:
        return self.validation.step(batch, dataloader_idx, self.rollouts, self._trainer_state(batch_idx))

    def on_validation_epoch_end(self) -> None:
        self._log_scores("val/accuracy")

    def _log_scores(self, shown: str) -> None:
        """Log every set's scores of the loop that ends (`shown` on the progress bar)."""
        for key, value in self.validation.end().items():
            # torchmetrics computed each over every rank already, the same value on each: synced as the max
            # of equal values (exact), which tells Lightning so (no warning per key under DDP).
            self.log(
                key, value, prog_bar=key == shown, add_dataloader_idx=False, sync_dist=True, reduce_fx="max"
            )

    def on_test_start(self) -> None:
        self.on_validation_start()

    def on_test_epoch_start(self) -> None:
        self.validation.start(self.trainer.datamodule, self.device, "test")

    def test_step(self, batch: dict[str, list], batch_idx: int, dataloader_idx: int = 0) -> dict:
        """The validation's scores on the data module's test rows and sets, logged as `test/...`."""
        return self.validation.step(batch, dataloader_idx, self.rollouts, self._trainer_state(batch_idx))

    def on_test_epoch_end(self) -> None:
        self._log_scores("test/accuracy")

    def on_predict_start(self) -> None:
        self.on_validation_start()

    def predict_step(self, batch: dict[str, list], batch_idx: int, dataloader_idx: int = 0) -> list[dict]:
        """Answers to `batch`'s prompts (a batch of the data module's, or any dict with a `prompt` list): one
        `{"prompt", "completions"}` per prompt, its `num_generations_eval` completions (greedy when 1)
        sampled through the module's rollout engine, as validation samples them (with tools, each one's
        `transcripts` too). A rank's padding repeats (`validation_sets.rank_share`) are left out."""
        prompts, k = batch["prompt"], self.validation.num_generations
        counted = batch.get(COUNTED, [True] * len(prompts))
        _, completions, turns = self.rollouts.sample_batch(batch, k, do_sample=k > 1)
        answers = prompt_answers(prompts, completions, turns)
        return [answer for answer, kept in zip(answers, counted, strict=True) if kept]
