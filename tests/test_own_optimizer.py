"""A subclass's own `configure_optimizers`, in each form Lightning accepts, stepped once per optimizer step:
the learning rate of every step asserted, with a torch optimizer other than AdamW."""

from __future__ import annotations

from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities.types import LRSchedulerConfig

from grpo_lightning.training.lr_schedulers import step_schedulers
from grpo_lightning.training.module import GRPOModule
from tests.helpers import arithmetic_data, length_reward, quiet_trainer, tiny_module

LR = 0.1


def sgd(module: GRPOModule) -> torch.optim.SGD:
    return torch.optim.SGD([p for p in module.policy.parameters() if p.requires_grad], lr=LR)


def halving(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.StepLR:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


def optimizer_alone(module: GRPOModule):
    return sgd(module)


def lists(module: GRPOModule):
    optimizer = sgd(module)
    return [optimizer], [halving(optimizer)]


def dict_with_scheduler(module: GRPOModule):
    optimizer = sgd(module)
    return {"optimizer": optimizer, "lr_scheduler": halving(optimizer)}


def dict_per_step(module: GRPOModule):
    optimizer = sgd(module)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": halving(optimizer), "interval": "step"}}


def dict_every_third_step(module: GRPOModule):
    optimizer = sgd(module)
    config = {"scheduler": halving(optimizer), "interval": "step", "frequency": 3}
    return {"optimizer": optimizer, "lr_scheduler": config}


class StepLearningRates(L.Callback):
    """The learning rate of each training step's optimizer step, as the step starts."""

    def __init__(self) -> None:
        self.rates: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.rates.append(trainer.optimizers[0].param_groups[0]["lr"])


class OwnOptimizer(GRPOModule):
    form = staticmethod(optimizer_alone)

    def configure_optimizers(self):
        return self.form(self)


@pytest.mark.parametrize(
    ("form", "rates"),
    [
        (optimizer_alone, [LR, LR, LR, LR]),
        (lists, [LR, LR, LR / 2, LR / 2]),  # Lightning's default interval: "epoch", of 2 batches here
        (dict_with_scheduler, [LR, LR, LR / 2, LR / 2]),
        (dict_per_step, [LR, LR / 2, LR / 4, LR / 8]),
        (dict_every_third_step, [LR, LR, LR, LR / 2]),
    ],
)
def test_each_form_steps_its_scheduler_once_per_optimizer_step(tiny_model_dir, form, rates):
    cls = type("Own", (OwnOptimizer,), {"form": staticmethod(form)})
    module = tiny_module(tiny_model_dir, cls, reward_funcs=[length_reward], max_completion_length=4)
    recorded = StepLearningRates()
    trainer = quiet_trainer(max_steps=4, limit_val_batches=0, callbacks=[recorded])
    trainer.fit(module, arithmetic_data(4))  # 4 training rows, 2 per step: 2 batches per epoch
    assert type(trainer.optimizers[0]) is torch.optim.SGD
    assert recorded.rates == pytest.approx(rates)


def two_optimizers(module: GRPOModule):
    return [sgd(module), torch.optim.Adam(module.policy.parameters())]


def test_two_optimizers_are_refused_in_one_line(tiny_model_dir):
    cls = type("Own", (OwnOptimizer,), {"form": staticmethod(two_optimizers)})
    module = tiny_module(tiny_model_dir, cls, reward_funcs=[length_reward])
    with pytest.raises(ValueError, match=r"^configure_optimizers returned 2 optimizers \(SGD, Adam\): "):
        quiet_trainer(max_steps=1, limit_val_batches=0).fit(module, arithmetic_data(6))


def test_step_schedulers_steps_only_those_due_at_this_interval():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    every_second = LRSchedulerConfig(halving(optimizer), interval="step", frequency=2)
    per_epoch = LRSchedulerConfig(torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.1), interval="epoch")
    trainer = SimpleNamespace(global_step=1, current_epoch=0, lr_scheduler_configs=[every_second, per_epoch])
    step_schedulers(trainer, "step", {})  # step 1: not a multiple of 2
    assert optimizer.param_groups[0]["lr"] == pytest.approx(LR)
    trainer.global_step = 2
    step_schedulers(trainer, "step", {})
    assert optimizer.param_groups[0]["lr"] == pytest.approx(LR / 2)
    step_schedulers(trainer, "epoch", {})
    assert optimizer.param_groups[0]["lr"] == pytest.approx(LR / 20)
