"""Lightning's tools that do not apply to GRPOModule are refused when the Trainer attaches it, before any
step runs, in one line that says what to use instead."""

from __future__ import annotations

import types

import pytest
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.tuner import Tuner

from grpo_lightning.training.trainer_options import refuse_unsupported_tools
from tests.helpers import arithmetic_data, length_reward, quiet_trainer, tiny_module


@pytest.fixture
def module(tiny_model_dir, monkeypatch):
    """A module whose training step must never run: every refusal comes first."""
    built = tiny_module(tiny_model_dir, reward_funcs=[length_reward])
    monkeypatch.setattr(built, "training_step", lambda *a, **k: pytest.fail("a training step ran"))
    return built


def refusal(run) -> str:
    with pytest.raises(ValueError) as raised:
        run()
    message = str(raised.value)
    assert "\n" not in message
    return message


def test_a_compiled_module_is_refused_naming_what_to_compile(module):
    trainer = quiet_trainer(max_steps=1, limit_val_batches=0)
    message = refusal(lambda: trainer.fit(torch.compile(module), arithmetic_data(4)))
    assert message.startswith("torch.compile(module) would trace the rollout's generation")
    assert "compile the policy's forward alone" in message and "engine.backend: static" in message


def test_the_batch_size_finder_is_refused_naming_the_micro_batch_options(module):
    trainer = quiet_trainer(max_steps=1, limit_val_batches=0)
    message = refusal(lambda: Tuner(trainer).scale_batch_size(module, datamodule=arithmetic_data(4)))
    assert message.startswith("BatchSizeFinder (Tuner.scale_batch_size) cannot size a GRPO step")
    assert "model.grpo.update.micro_batch_size" in message


def test_the_learning_rate_finder_is_refused_naming_grpo_learning_rate(module):
    trainer = quiet_trainer(max_steps=1, limit_val_batches=0)
    message = refusal(lambda: Tuner(trainer).lr_find(module, datamodule=arithmetic_data(4)))
    assert (
        message.startswith("LearningRateFinder (Tuner.lr_find)")
        and "model.grpo.optimizer.learning_rate" in message
    )


def test_the_accumulation_scheduler_is_refused_naming_accumulate_grad_batches(module):
    trainer = quiet_trainer(
        max_steps=1, limit_val_batches=0, callbacks=[GradientAccumulationScheduler({0: 2})]
    )
    message = refusal(lambda: trainer.fit(module, arithmetic_data(4)))
    assert message.startswith("GradientAccumulationScheduler: GRPOModule optimises manually")
    assert "Trainer(accumulate_grad_batches=N) maps onto data.batch_size" in message


def test_fsdp1_is_refused_naming_model_parallel_strategy(module):
    # Lightning refuses FSDPStrategy on a CPU itself; on a GPU the Trainer attaches the module with it.
    trainer = types.SimpleNamespace(callbacks=[], strategy=FSDPStrategy())
    message = refusal(lambda: refuse_unsupported_tools(trainer, module))
    assert message.startswith("trainer.strategy FSDPStrategy (FSDP1) is not supported")
    assert "ModelParallelStrategy" in message
