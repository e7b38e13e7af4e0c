"""The module's own optimizers and schedulers (`configure_optimizers` overridden): `ReduceLROnPlateau` steps
on its monitor per step or per epoch, and what the module cannot step (a scheduler's frequency that is not
whole or an unknown interval, `ReduceLROnPlateau` without its metric, no optimizer, weights outside the
policy, a frozen policy) is refused in one line before the first step."""

import re

import pytest
import torch

from tests.helpers import (
    arithmetic_data,
    length_reward,
    quiet_trainer,
    tiny_module,
)
from tests.test_own_optimizer import LR, OwnOptimizer, StepLearningRates, halving, sgd


def plateau(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.ReduceLROnPlateau:
    # "max" on the learning rate it lowers, no patience: halved at each step after the first it sees.
    return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", factor=0.5, patience=0)


def plateau_per_step(module):
    optimizer = sgd(module)
    config = {"scheduler": plateau(optimizer), "monitor": "train/learning_rate", "interval": "step"}
    return {"optimizer": optimizer, "lr_scheduler": config}


def plateau_per_epoch(module):  # the dict's own `monitor`, Lightning's other place for it
    optimizer = sgd(module)
    return {"optimizer": optimizer, "lr_scheduler": plateau(optimizer), "monitor": "train/learning_rate"}


@pytest.mark.parametrize(
    ("form", "rates"),
    [
        (plateau_per_step, [LR, LR, LR / 2, LR / 4, LR / 8, LR / 16]),  # after each step, on its metrics
        (plateau_per_epoch, [LR, LR, LR, LR, LR / 2, LR / 2]),  # 2 steps an epoch
    ],
)
def test_reduce_lr_on_plateau_steps_on_its_monitor_per_step_or_per_epoch(tiny_model_dir, form, rates):
    module = tiny_module(
        tiny_model_dir, own_optimizer(form), reward_funcs=[length_reward], max_completion_length=4
    )
    recorded = StepLearningRates()
    trainer = quiet_trainer(max_steps=6, limit_val_batches=0, callbacks=[recorded])
    trainer.fit(module, arithmetic_data(4))  # crashed: ReduceLROnPlateau.step() missing 'metrics'
    assert recorded.rates == pytest.approx(rates)


def own_optimizer(form) -> type[OwnOptimizer]:
    return type("Own", (OwnOptimizer,), {"form": staticmethod(form)})


def with_scheduler(scheduler=halving, **options):
    def form(module):
        optimizer = sgd(module)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler(optimizer), **options}}

    return form


def frozen_policy(module):
    module.policy.requires_grad_(False)  # held, but none trainable
    return torch.optim.SGD(module.policy.parameters())


REFUSED_OPTIMIZERS = [
    (
        with_scheduler(interval="step", frequency=0),
        "returned lr_scheduler StepLR with frequency 0: give a whole",
    ),
    (with_scheduler(frequency=1.5), "returned lr_scheduler StepLR with frequency 1.5: give a whole"),
    (
        with_scheduler(interval="batch"),
        "returned lr_scheduler StepLR with interval 'batch', which a GRPOModule",
    ),
    (
        with_scheduler(scheduler=plateau),
        "returned lr_scheduler ReduceLROnPlateau without the metric it reduces on",
    ),
    (lambda module: {"lr_scheduler": None}, "returned a dict without 'optimizer' (its keys: 'lr_scheduler')"),
    (lambda module: [{"optimizer": sgd(module)}, {}], "returned a dict without 'optimizer' (its keys: none)"),
    (lambda module: [], "returned an empty list: return the optimizer over the policy's trainable weights"),
    (lambda module: (), "returned an empty list"),
    (
        lambda module: torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))]),
        "returned SGD holding 1 of its 1 weights outside the policy: the GRPO loss gives them no gradient",
    ),
    (
        lambda module: torch.optim.SGD([*module.policy.parameters(), *module.reference.parameters()]),
        "returned SGD holding 21 of its 42 weights outside the policy",
    ),
    (
        frozen_policy,
        "returned SGD over none of the policy's trainable weights: give it [p for p in self.policy",
    ),
]


@pytest.mark.parametrize(("form", "message"), REFUSED_OPTIMIZERS)
def test_own_optimizers_that_cannot_train_are_refused_in_one_line(tiny_model_dir, form, message):
    # beta > 0: a reference model, whose weights the optimizer must not hold
    module = tiny_module(tiny_model_dir, own_optimizer(form), reward_funcs=[length_reward], beta=0.04)
    with pytest.raises(ValueError, match=f"^configure_optimizers {re.escape(message)}") as refused:
        quiet_trainer(max_steps=1, limit_val_batches=0).fit(module, arithmetic_data(4))
    assert "\n" not in str(refused.value)
