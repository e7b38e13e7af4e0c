"""The schedulers of `configure_optimizers` stepped under manual optimisation, which Lightning leaves to the
module: after each optimizer step or at each epoch's end, as Lightning steps them under automatic
optimisation."""

from __future__ import annotations

import lightning as L


def step_schedulers(trainer: L.Trainer, interval: str) -> None:
    """Step the schedulers of `configure_optimizers` whose `interval` is `interval` ("step": after an
    optimizer step that changed the weights; "epoch": at a training epoch's end), each when the steps or
    epochs done are a multiple of its `frequency`, `ReduceLROnPlateau` with its `monitor`'s latest value:
    as Lightning steps them under automatic optimisation, which it leaves to a module that optimises
    manually."""
    done = trainer.global_step if interval == "step" else trainer.current_epoch + 1
    for config in trainer.lr_scheduler_configs:
        if config.interval != interval or done % config.frequency:
            continue
        if not config.reduce_on_plateau:
            config.scheduler.step()
            continue
        value = trainer.callback_metrics.get(config.monitor)
        if value is not None:
            config.scheduler.step(float(value))
        elif config.strict:
            raise ValueError(
                f"lr_scheduler {type(config.scheduler).__name__} monitors {config.monitor!r}, which is "
                f"not logged yet (logged: {', '.join(sorted(trainer.callback_metrics)) or 'nothing'}): "
                "monitor a metric logged before it steps, or set its 'strict': False to skip those steps"
            )
