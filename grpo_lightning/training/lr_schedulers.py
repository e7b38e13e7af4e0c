"""The schedulers of `configure_optimizers` stepped under manual optimisation, which Lightning leaves to the
module: after each optimizer step or at each epoch's end, as Lightning steps them under automatic
optimisation.

Lightning drops a scheduler's `monitor` and `strict` under manual optimisation and checks neither its
`interval` nor its `frequency`; `scheduler_monitors` reads and checks them from what `configure_optimizers`
returned, so that each scheduler is stepped as configured or refused in one line.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning as L
from lightning.pytorch.core.optimizer import _configure_optimizers
from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch.optim.lr_scheduler import ReduceLROnPlateau

INTERVALS = ("step", "epoch")  # after each optimizer step; at each training epoch's end


@dataclass(frozen=True)
class Monitored:
    """A `ReduceLROnPlateau`'s metric, and whether its absence is an error (`strict`) or a skipped step."""

    monitor: str
    strict: bool = True


def _refused(problem: str) -> ValueError:
    return ValueError(f"configure_optimizers {problem}")


def _check_optimizer_dicts(configured: Any) -> None:
    dicts = [configured] if isinstance(configured, dict) else []
    if isinstance(configured, list | tuple):
        if not configured:
            raise _refused(
                "returned an empty list: return the optimizer over the policy's trainable weights (alone, in "
                "a list, or in a dict with its 'lr_scheduler')"
            )
        dicts = [entry for entry in configured if isinstance(entry, dict)]
    for entry in dicts:
        if "optimizer" not in entry:
            keys = ", ".join(map(repr, entry)) or "none"
            raise _refused(f"returned a dict without 'optimizer' (its keys: {keys}): add the optimizer to it")


def scheduler_monitors(configured: Any) -> dict[int, Monitored]:
    """Check the schedulers of `configured` (what `configure_optimizers` returned) as manual optimisation
    steps them: an `interval` of "step" or "epoch", a positive whole `frequency`, a `ReduceLROnPlateau`
    with the metric it monitors. Returns each `ReduceLROnPlateau`'s `Monitored`, by the scheduler's `id`."""
    if configured is None:  # Lightning warns and runs without an optimizer
        return {}
    _check_optimizer_dicts(configured)
    _, schedulers, top_monitor = _configure_optimizers(configured)
    monitors: dict[int, Monitored] = {}
    for entry in schedulers:
        options = entry if isinstance(entry, dict) else {"scheduler": entry}
        scheduler = options.get("scheduler")
        name = f"lr_scheduler {type(scheduler).__name__}"
        interval, frequency = options.get("interval", "epoch"), options.get("frequency", 1)
        if interval not in INTERVALS:
            raise _refused(
                f"returned {name} with interval {interval!r}, which a GRPOModule never reaches: use 'step' "
                "(after each optimizer step) or 'epoch' (at each training epoch's end)"
            )
        if isinstance(frequency, bool) or not isinstance(frequency, int) or frequency < 1:
            raise _refused(
                f"returned {name} with frequency {frequency!r}: give a whole number of {interval}s of 1 or "
                "more between its steps"
            )
        if isinstance(scheduler, ReduceLROnPlateau):
            monitor = options.get("monitor", top_monitor)
            if monitor is None:
                raise _refused(
                    f"returned {name} without the metric it reduces on: return it in a dict with its "
                    "'monitor', e.g. {'scheduler': ..., 'monitor': 'train/reward', 'interval': 'step'}"
                )
            monitors[id(scheduler)] = Monitored(monitor, bool(options.get("strict", True)))
    return monitors


def reading_schedulers(configure: Callable[[L.LightningModule], Any]) -> Callable[[L.LightningModule], Any]:
    """`configure` (a `configure_optimizers`), its return checked and its monitors kept on the module."""

    @functools.wraps(configure)
    def configure_optimizers(module: L.LightningModule) -> Any:
        configured = configure(module)
        module.optimization.scheduler_monitors = scheduler_monitors(configured)
        return configured

    return configure_optimizers


def step_schedulers(trainer: L.Trainer, interval: str, monitors: dict[int, Monitored]) -> None:
    """Step the schedulers of `configure_optimizers` whose `interval` is `interval` ("step": after an
    optimizer step that changed the weights; "epoch": at a training epoch's end), each when the steps or
    epochs done are a multiple of its `frequency`: as Lightning steps them under automatic optimisation, which
    it leaves to a module that optimises manually. A `ReduceLROnPlateau` stepped per optimizer step waits for
    its training step's metrics (`step_monitored`)."""
    done = trainer.global_step if interval == "step" else trainer.current_epoch + 1
    for config in trainer.lr_scheduler_configs:
        deferred = interval == "step" and id(config.scheduler) in monitors
        if config.interval == interval and not done % config.frequency and not deferred:
            _step(trainer, config, monitors.get(id(config.scheduler)))


def step_monitored(trainer: L.Trainer, steps_before: int, monitors: dict[int, Monitored]) -> None:
    """At a training step's end, once its metrics are logged: step each `ReduceLROnPlateau` of interval
    "step" once if the optimizer steps this training step took reached a multiple of its `frequency` (as
    Lightning steps one after the training step under automatic optimisation)."""
    for config in trainer.lr_scheduler_configs:
        monitored = monitors.get(id(config.scheduler))
        due = trainer.global_step // config.frequency > steps_before // config.frequency
        if monitored is not None and config.interval == "step" and due:
            _step(trainer, config, monitored)


def _step(trainer: L.Trainer, config: LRSchedulerConfig, monitored: Monitored | None) -> None:
    if monitored is None:
        config.scheduler.step()
        return
    value = trainer.callback_metrics.get(monitored.monitor)
    if value is not None:
        config.scheduler.step(float(value))
    elif monitored.strict:
        raise ValueError(
            f"lr_scheduler {type(config.scheduler).__name__} monitors {monitored.monitor!r}, which is not "
            f"logged (logged: {', '.join(sorted(trainer.callback_metrics)) or 'nothing'}): monitor a metric "
            "the run logs, or set its 'strict': False to skip the steps without it"
        )
