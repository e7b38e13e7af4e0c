"""The optimizer and its learning-rate schedule: TRL's `optim` and Adam options reaching the optimizer, the
library schedulers against the closed form and against transformers' own schedules (TRL's
`lr_scheduler_type`), the run's length, and the rates a real fit logs (each step's `train/learning_rate` is
the rate its update used)."""

import dataclasses
import importlib.util
import math

import lightning as L
import pytest
import torch
import transformers

from grpo_lightning.core.algorithm.schedules import (
    OptimizerOptions,
    build_optimizer,
    build_scheduler,
    optimizer_steps_in_fit,
)
from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.training.data import GSM8KDataModule
from grpo_lightning.training.module import GRPOModule
from grpo_lightning.training.run_checks import check_run_length
from tests.helpers import quiet_trainer


def lr_multiplier(step: int, warmup_steps: int, total_steps: int, kind: str, min_ratio: float) -> float:
    """The schedule's closed form (`grpo_lightning.core.algorithm.schedules`' doc): warm-up s / w, then
    constant, or linear / cosine decay to the floor over the rest of the run."""
    if step < warmup_steps:
        return step / warmup_steps
    if kind == "constant":
        return 1.0
    if step >= total_steps:
        return min_ratio
    progress = (step - warmup_steps) / (total_steps - warmup_steps)
    decayed = 1.0 - progress if kind == "linear" else (1.0 + math.cos(math.pi * progress)) / 2
    return min_ratio + (1.0 - min_ratio) * decayed


def scheduled_rates(kind: str, warmup: int, total: int, floor: float, steps: int) -> list[float]:
    """The multipliers that `build_scheduler` gives `steps` optimizer steps (a base rate of 1)."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = build_scheduler(optimizer, warmup, total, kind, floor)
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


@pytest.mark.parametrize(
    ("kind", "step", "expected"),
    [
        # warm-up 2, 10 steps, floor 0.1: decay runs over steps 2..10, progress p = (step - 2) / 8
        ("constant", 0, 0.0),  # the warm-up's first update, at rate 0 as in transformers
        ("constant", 1, 0.5),
        ("constant", 2, 1.0),
        ("constant", 9, 1.0),
        ("linear", 0, 0.0),
        ("linear", 1, 0.5),
        ("linear", 2, 1.0),
        ("linear", 4, 0.1 + 0.9 * 0.75),
        ("linear", 10, 0.1),
        ("linear", 50, 0.1),  # past the end: the floor
        ("cosine", 1, 0.5),
        ("cosine", 2, 1.0),
        ("cosine", 4, 0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2),
        ("cosine", 6, 0.1 + 0.9 * 0.5),
        ("cosine", 10, 0.1),
    ],
)
def test_multiplier_matches_the_closed_form(kind, step, expected):
    assert scheduled_rates(kind, 2, 10, 0.1, step + 1)[step] == pytest.approx(expected, abs=1e-12)


def test_no_warmup_starts_at_the_full_rate():
    assert scheduled_rates("cosine", 0, 4, 0.0, 1) == [1.0]
    assert scheduled_rates("linear", 0, 4, 0.0, 3)[2] == 0.5


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
@pytest.mark.parametrize(("warmup", "total"), [(0, 1), (1, 7), (3, 3), (4, 50), (7, 200)])
def test_the_library_schedulers_give_the_closed_form_at_every_step(kind, warmup, total):
    rates = scheduled_rates(kind, warmup, total, 0.25, total + 3)  # past the end: the floor
    expected = [lr_multiplier(s, warmup, total, kind, 0.25) for s in range(total + 3)]
    assert rates == pytest.approx(expected, rel=1e-15, abs=0)


def transformers_rates(name: str, warmup: int, total: int, steps: int, **kwargs) -> list[float]:
    """The multipliers of transformers' `get_scheduler(name, ...)`, as TRL's Trainer builds it from
    `lr_scheduler_type`, `warmup_steps`, the run's optimizer steps and `lr_scheduler_kwargs`."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = transformers.get_scheduler(
        name, optimizer, num_warmup_steps=warmup, num_training_steps=total, scheduler_specific_kwargs=kwargs
    )
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


@pytest.mark.parametrize(
    ("ours", "floor", "theirs", "kwargs"),
    [
        ("constant", 0.0, "constant_with_warmup", {}),
        ("linear", 0.0, "linear", {}),
        ("cosine", 0.0, "cosine", {}),
        ("cosine", 0.1, "cosine_with_min_lr", {"min_lr_rate": 0.1}),
    ],
)
@pytest.mark.parametrize(("warmup", "total"), [(0, 5), (1, 6), (3, 10), (4, 4), (10, 137)])
def test_each_schedule_is_transformers_over_a_whole_run(ours, floor, theirs, kwargs, warmup, total):
    """Every update of a run (steps 0 .. n - 1), and the rate left after its last (step n) where the run
    decays after its warm-up (transformers' cosine is back at 1 at step n of a run all warm-up, its linear
    at 0; ours is at the floor)."""
    steps = total + (total > warmup)
    expected = transformers_rates(theirs, warmup, total, steps, **kwargs)
    assert scheduled_rates(ours, warmup, total, floor, steps) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_three_warmup_steps_are_transformers_multipliers():
    assert scheduled_rates("cosine", 3, 20, 0.0, 4) == pytest.approx([0.0, 1 / 3, 2 / 3, 1.0], abs=1e-15)
    assert transformers_rates("cosine", 3, 20, 4) == pytest.approx([0.0, 1 / 3, 2 / 3, 1.0], abs=1e-15)


def test_the_run_length_in_optimizer_steps():
    assert optimizer_steps_in_fit(100, None, math.inf, 2) == 100  # max_steps already counts optimizer steps
    assert optimizer_steps_in_fit(-1, 3, 10, 2) == 60  # 3 epochs x 10 batches x 2 iterations
    assert optimizer_steps_in_fit(50, 3, 10, 2) == 50  # whichever ends first
    with pytest.raises(ValueError, match="set trainer.max_steps, or lr_scheduler_type: constant"):
        optimizer_steps_in_fit(-1, -1, 10, 1)


def test_trls_optimizer_defaults_are_ours():
    """TRL 1.16's `GRPOConfig` (transformers' `TrainingArguments`): optim, betas, epsilon, weight decay."""
    trl = pytest.importorskip("trl")
    defaults = {f.name: f.default for f in dataclasses.fields(trl.GRPOConfig)}
    ours = OptimizerOptions()
    assert (defaults["adam_beta1"], defaults["adam_beta2"], defaults["adam_epsilon"]) == (0.9, 0.999, 1e-8)
    assert (ours.beta1, ours.beta2, ours.epsilon) == (0.9, 0.999, 1e-8)
    assert (ours.name, ours.weight_decay, ours.learning_rate) == (
        defaults["optim"],  # "adamw_torch_fused" with torch >= 2.8
        defaults["weight_decay"],
        defaults["learning_rate"],
    )


@pytest.mark.parametrize(("optim", "fused"), [("adamw_torch_fused", True), ("adamw_torch", False)])
def test_trls_optimizer_options_reach_the_optimizer(optim, fused):
    grpo = GRPOConfig(
        optim=optim, adam_beta1=0.8, adam_beta2=0.99, adam_epsilon=1e-6, weight_decay=0.1, learning_rate=3e-6
    )
    optimizer = build_optimizer([torch.nn.Parameter(torch.zeros(2))], grpo.optimizer)
    assert type(optimizer) is torch.optim.AdamW and optimizer.defaults["fused"] is fused
    group = optimizer.param_groups[0]
    assert (group["betas"], group["eps"], group["weight_decay"], group["lr"]) == (
        (0.8, 0.99),
        1e-6,
        0.1,
        3e-6,
    )


def test_8bit_adamw_needs_bitsandbytes(monkeypatch):
    if importlib.util.find_spec("bitsandbytes") is not None:
        import bitsandbytes

        optimizer = build_optimizer([torch.nn.Parameter(torch.zeros(2))], OptimizerOptions(name="adamw_8bit"))
        assert isinstance(optimizer, bitsandbytes.optim.AdamW8bit)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else find_spec(name, *a)
    )
    for name in ("adamw_8bit", "adamw_bnb_8bit"):
        with pytest.raises(ValueError) as refused:
            GRPOConfig(optim=name)
        assert str(refused.value) == (
            f"GRPOConfig.optimizer.name={name!r} (optim): 8-bit AdamW needs bitsandbytes, which is not "
            "installed: pip install bitsandbytes, or use adamw_torch_fused"
        )


class LoggedRates(L.Callback):
    def __init__(self) -> None:
        self.rates: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rates.append(float(trainer.callback_metrics["train/learning_rate"]))


@pytest.mark.parametrize(("kind", "num_iterations"), [("cosine", 1), ("linear", 2)])
def test_fit_logs_the_rate_each_update_used(tiny_model_dir, tmp_path, kind, num_iterations):
    lr, warmup, steps, floor = 1e-3, 2, 6, 0.2
    grpo = GRPOConfig(
        num_generations=2,
        max_completion_length=4,
        learning_rate=lr,
        warmup_steps=warmup,
        lr_scheduler_type=kind,
        min_lr_ratio=floor,
        num_iterations=num_iterations,
        adam_beta2=0.99,
        preflight=False,
    )
    module = GRPOModule(tiny_model_dir, grpo=grpo)
    data = GSM8KDataModule(source="arithmetic", batch_size=2, val_size=2, arithmetic_size=20)
    logged = LoggedRates()
    trainer = quiet_trainer(
        max_steps=steps, limit_val_batches=0, callbacks=[logged], default_root_dir=str(tmp_path)
    )
    trainer.fit(module, data)
    # Each training step logs the rate of its last optimizer step (of num_iterations).
    last_steps = range(num_iterations - 1, steps, num_iterations)
    assert logged.rates == pytest.approx(
        [lr * lr_multiplier(s, warmup, steps, kind, floor) for s in last_steps]
    )
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(lr * floor)  # after the last step
    assert trainer.optimizers[0].param_groups[0]["betas"] == (
        0.9,
        0.99,
    )  # TRL's adam_beta2, as a fit builds it


def test_epochs_bound_the_schedule(tiny_model_dir, tmp_path):
    """No max_steps: 2 epochs of 10 rows in batches of 5 are 4 training steps, the length of the schedule."""
    grpo = GRPOConfig(
        num_generations=2,
        max_completion_length=4,
        learning_rate=1e-3,
        lr_scheduler_type="linear",
        preflight=False,
    )
    module = GRPOModule(tiny_model_dir, grpo=grpo)
    data = GSM8KDataModule(source="arithmetic", batch_size=5, val_size=2, arithmetic_size=10)
    logged = LoggedRates()
    trainer = quiet_trainer(
        max_epochs=2, limit_val_batches=0, callbacks=[logged], default_root_dir=str(tmp_path)
    )
    trainer.fit(module, data)
    assert logged.rates == pytest.approx([1e-3 * (1 - s / 4) for s in range(4)])


@pytest.mark.parametrize("warmup", [{"warmup_steps": 1}, {"warmup_ratio": 0.2}], ids=["steps", "ratio"])
def test_a_resumed_run_continues_the_schedule(tiny_model_dir, tmp_path, warmup):
    """Resumed from a checkpoint of step 2 of 5: the remaining steps use the uninterrupted run's rates (a
    warm-up of 1 step, given as steps or as 0.2 of the run)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def fit(max_steps: int, save: bool = False, ckpt_path: str | None = None) -> list[float]:
        grpo = GRPOConfig(
            num_generations=2,
            max_completion_length=4,
            learning_rate=1e-3,
            **warmup,
            lr_scheduler_type="cosine",
            min_lr_ratio=0.1,
            preflight=False,
        )
        logged = LoggedRates()
        every_2 = ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=2, save_top_k=-1)
        callbacks = [logged] + ([every_2] if save else [])
        trainer = quiet_trainer(
            max_steps=max_steps,
            max_epochs=None,
            limit_val_batches=0,
            callbacks=callbacks,
            enable_checkpointing=save,
            default_root_dir=str(tmp_path),
        )
        data = GSM8KDataModule(source="arithmetic", batch_size=2, val_size=2, arithmetic_size=20)
        trainer.fit(GRPOModule(tiny_model_dir, grpo=grpo), data, ckpt_path=ckpt_path)
        return logged.rates

    straight = fit(5, save=True)
    resumed = fit(5, ckpt_path=str(tmp_path / "epoch=0-step=2.ckpt"))
    assert resumed == pytest.approx(straight[2:])
    assert straight == pytest.approx([1e-3 * lr_multiplier(s, 1, 5, "cosine", 0.1) for s in range(5)])


def test_a_warmup_ratio_is_transformers_share_of_the_run(tiny_model_dir, tmp_path):
    """2 epochs of 2 batches are 4 optimizer steps; half of them warm up, as transformers rounds a share."""
    warmup = transformers.TrainingArguments(output_dir=str(tmp_path), warmup_steps=0.5).get_warmup_steps(4)
    assert warmup == GRPOConfig(warmup_ratio=0.5).optimizer.warmup_steps_of(4) == 2
    assert GRPOConfig(warmup_ratio=0.3).optimizer.warmup_steps_of(5) == 2  # ceil(1.5)
    grpo = GRPOConfig(num_generations=2, max_completion_length=4, learning_rate=1e-3, warmup_ratio=0.5)
    module = GRPOModule(tiny_model_dir, grpo=dataclasses.replace(grpo, preflight=False))
    data = GSM8KDataModule(source="arithmetic", batch_size=5, val_size=2, arithmetic_size=10)
    logged = LoggedRates()
    trainer = quiet_trainer(
        max_epochs=2, limit_val_batches=0, callbacks=[logged], default_root_dir=str(tmp_path)
    )
    trainer.fit(module, data)
    assert logged.rates == pytest.approx([0.0, 0.5e-3, 1e-3, 1e-3])  # constant after the warm-up


def test_a_warmup_is_given_once_and_a_share_needs_the_runs_length():
    with pytest.raises(ValueError) as both:
        GRPOConfig(warmup_steps=3, warmup_ratio=0.1)
    assert str(both.value) == (
        "GRPOConfig.optimizer.warmup_ratio=0.1: give the warm-up once: warmup_steps=3 is set too"
    )
    with pytest.raises(ValueError, match=r"warmup_ratio=0.1 is a share of the run, whose length is unknown"):
        check_run_length(quiet_trainer(max_steps=-1, max_epochs=-1), GRPOConfig(warmup_ratio=0.1))
    with pytest.raises(ValueError, match=r"TRL's warmup_steps 0.1 is warmup_ratio 0.1"):
        GRPOConfig(warmup_steps=0.1)
