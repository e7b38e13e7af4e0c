"""The optimizer steps of a training step, under Lightning's manual optimisation: one per mini-batch of the
rollout's trajectory (`core.update.RolloutUpdate.mini_batches`), each the backward of every micro-batch's
loss, the gradient clipped and the step taken unless the loss or the gradient is not finite
(`StepGuard`), and its metrics kept for the logs (`step_metrics.update_metrics`); the schedulers stepped
as Lightning would step them under automatic optimisation (`lr_schedulers.step_schedulers`: after each
optimizer step, at an epoch's end, and a `ReduceLROnPlateau` of interval "step" at the training step's
end, once its metrics are logged), and the rollout engine told that the weights changed.
"""

from __future__ import annotations

import math
import warnings

import lightning as L
import torch
from torch import Tensor

from grpo_lightning.core.types import Trajectory
from grpo_lightning.core.update import MicroBatchSums
from grpo_lightning.training.lr_schedulers import Monitored, step_monitored, step_schedulers
from grpo_lightning.training.step_metrics import UpdateRows, update_metrics


class StepGuard:
    """Takes the optimizer step unless the update is not finite; counts consecutive skipped steps."""

    def __init__(self, max_bad_steps: int) -> None:
        self.max_bad_steps = max_bad_steps
        self.bad_steps = 0  # consecutive non-finite steps, kept in checkpoints

    def clip_and_step(
        self,
        optimizer: torch.optim.Optimizer,
        loss: Tensor,
        params: list[Tensor],
        max_norm: float | None,
        scaled: bool,
        step: int,
    ) -> Tensor | None:
        """Clip the gradients of `params` to the global norm `max_norm` (None: measured, not clipped) and
        `step`: the gradient norm of a step taken, None for a step skipped."""
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm is not None else math.inf)
        return grad_norm if self.step(optimizer, loss, grad_norm, scaled, step) else None

    def step(
        self, optimizer: torch.optim.Optimizer, loss: Tensor, grad_norm: Tensor, scaled: bool, step: int
    ) -> bool:
        """Step `optimizer` (whose gradients were clipped to `grad_norm`) when the update is finite; True
        when the weights changed. `scaled`: a 16-mixed loss scaler wraps the optimizer."""
        if scaled and torch.isfinite(loss) and not torch.isfinite(grad_norm):
            optimizer.step()  # the scaler sees the overflow: it skips the update and lowers the loss scale
            warnings.warn(f"step {step}: fp16 gradients overflowed, update skipped", stacklevel=3)
            return False
        if not (torch.isfinite(loss) and torch.isfinite(grad_norm)):
            optimizer.zero_grad()
            self.bad_steps += 1
            warnings.warn(f"step {step}: loss or gradient not finite, update skipped", stacklevel=3)
            if self.bad_steps >= self.max_bad_steps:
                raise FloatingPointError(
                    f"{self.bad_steps} consecutive steps with a non-finite loss or gradient (max_bad_steps="
                    f"{self.max_bad_steps}): lower the learning rate, or check the rewards and the model's "
                    "dtype"
                )
            return False
        self.bad_steps = 0
        optimizer.step()
        return True


class ManualOptimization:
    """A module's optimizer steps: the guard against non-finite updates (`max_bad_steps` in a row stop the
    run) and the schedulers' monitors (`scheduler_monitors`, set from `configure_optimizers` by
    `lr_schedulers.reading_schedulers`)."""

    def __init__(self, max_bad_steps: int) -> None:
        self.step_guard = StepGuard(max_bad_steps)
        self.scheduler_monitors: dict[int, Monitored] = {}
        self.steps_at_batch_start = 0  # for the schedulers that wait for a training step's metrics

    def batch_started(self, global_step: int) -> None:
        self.steps_at_batch_start = global_step

    def batch_ended(self, trainer: L.Trainer) -> None:
        step_monitored(trainer, self.steps_at_batch_start, self.scheduler_monitors)

    def epoch_ended(self, trainer: L.Trainer) -> None:
        step_schedulers(trainer, "epoch", self.scheduler_monitors)

    def rollout_steps(
        self, module: L.LightningModule, trajectory: Trajectory
    ) -> tuple[dict[str, Tensor], UpdateRows]:
        """An optimizer step per mini-batch of `trajectory`: the last one's statistics, and each one's index
        (the optimizer steps before it; a skipped step shares it with the next) with its metrics
        (`step_metrics.update_metrics`, the learning rate it used among them)."""
        optimizer, trainer = module.optimizers(), module.trainer
        max_steps = trainer.max_steps  # -1: no limit
        rows: UpdateRows = []
        for mini_batch, denominators in module.update.mini_batches(trajectory):
            index, learning_rate = module.global_step, optimizer.param_groups[0]["lr"]
            stats, grad_norm = self.optimizer_step(module, optimizer, mini_batch, denominators)
            rows.append((index, update_metrics(stats, grad_norm, learning_rate)))
            if grad_norm is not None:
                step_schedulers(trainer, "step", self.scheduler_monitors)
                module.rollouts.weights_changed()  # an engine's copy takes them before the next rollout
            if 0 <= max_steps <= module.global_step:  # the run ends here, part-way through the rollout
                break
        return stats, rows

    def optimizer_step(
        self,
        module: L.LightningModule,
        optimizer,
        mini_batch: Trajectory,
        denominators: tuple[Tensor, Tensor],
    ) -> tuple[dict[str, Tensor], Tensor | None]:
        """One optimizer step on `mini_batch`: its statistics, the gradient norm of a step taken (or None)."""
        optimizer.zero_grad()
        sums = MicroBatchSums()
        for loss in module.update.losses(module.policy, mini_batch, denominators, sums):
            module.manual_backward(loss)
        scaler = getattr(module.trainer.precision_plugin, "scaler", None)
        if scaler is not None:  # 16-mixed: clip the true gradients; fused AdamW would unscale only in step
            scaler.unscale_(optimizer.optimizer)
        params = [p for p in module.policy.parameters() if p.requires_grad]
        max_grad_norm = module.grpo.optimizer.max_grad_norm
        step = (optimizer, sums.loss, params, max_grad_norm, scaler is not None, module.global_step)
        return sums.values, self.step_guard.clip_and_step(*step)
