"""A module's hyper-parameters are plain values whoever built it (Hydra's containers, tuples, paths, partial
rewards), in the checkpoint and in what the loggers get; reward functions carry their names; what a
checkpoint cannot rebuild is named; a subclass that fixes a base argument loads from its checkpoint
(`training/hyperparameters.py`, `io/checkpoints.py`)."""

from __future__ import annotations

import enum
import functools
import io
import pathlib

import numpy
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from omegaconf import ListConfig, OmegaConf

from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.io.hparams import plain_value, resolve_callable, reward_recipe
from grpo_lightning.training.hyperparameters import own_arguments
from grpo_lightning.training.module import GRPOModule
from tests.helpers import arithmetic_data, digit_reward, length_reward, quiet_trainer

OPTIONS = GRPOConfig(num_generations=2, max_completion_length=4, preflight=False, log_completions_every=0)


def scaled_digits(completions: list, scale: float = 1.0, **kwargs) -> list[float]:
    """`digit_reward` times `scale`: a reward with an argument for `functools.partial` to bind."""
    return [scale * value for value in digit_reward(completions)]


def weights_only_load(hparams: dict) -> dict:
    """`hparams` through `torch.save` and `torch.load(weights_only=True)`, as a checkpoint's are read."""
    buffer = io.BytesIO()
    torch.save({"hyper_parameters": hparams}, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)["hyper_parameters"]


class Tagged(GRPOModule):
    """A subclass with arguments of its own in the forms Hydra and Python hand over."""

    def __init__(self, policy: str, folder: pathlib.Path, sizes: tuple, extra: dict, **kwargs) -> None:
        super().__init__(policy, **kwargs)


def test_hydra_containers_tuples_and_paths_are_stored_and_logged_plain(tiny_model_dir, tmp_path):
    extra = OmegaConf.create({"tags": ["a", "b"], "root": "${oc.env:HOME}"})
    module = Tagged(
        tiny_model_dir,
        folder=tmp_path,
        sizes=(1, 2),
        extra=extra,
        reward_funcs=(functools.partial(scaled_digits, scale=2.0), length_reward),
        reward_weights=ListConfig([1.0, 0.5]),
        grpo=OPTIONS,
    )
    expected = {
        "folder": str(tmp_path),
        "sizes": [1, 2],
        "extra": {"tags": ["a", "b"], "root": str(pathlib.Path.home())},  # interpolations resolved
        "reward_funcs": [
            {"_target_": f"{__name__}.scaled_digits", "_partial_": True, "scale": 2.0},
            "tests.helpers.length_reward",
        ],
        "reward_weights": [1.0, 0.5],
    }
    for hparams in (module.hparams, module.hparams_initial):  # the checkpoint's, the loggers'
        assert {key: hparams[key] for key in expected} == expected
        assert type(hparams["reward_weights"]) is list and type(hparams["extra"]["tags"]) is list
        assert weights_only_load(dict(hparams)) == dict(hparams)
    assert module.reward_names == ["scaled_digits", "length_reward"]
    logger = CSVLogger(tmp_path / "logs")
    logger.log_hyperparams(module.hparams_initial)  # Lightning's hparams.yaml: no object to represent
    logger.save()
    assert "scaled_digits" in (pathlib.Path(logger.log_dir) / "hparams.yaml").read_text()


def test_subclasses_of_plain_values_are_stored_as_the_plain_values():
    class Colour(str, enum.Enum):
        RED = "red"

    stored = plain_value({"ratio": numpy.float64(0.5), "colour": Colour.RED, "steps": numpy.int64(3)}, "x")
    assert stored == {"ratio": 0.5, "colour": "red", "steps": 3}
    assert weights_only_load(stored) == stored  # numpy's scalars would be globals weights_only refuses


def test_a_value_that_is_not_plain_is_refused_naming_its_argument(tiny_model_dir):
    with pytest.raises(ValueError, match=r"^extra\.device=device\(type='cpu'\) is a device: checkpoints"):
        Tagged(tiny_model_dir, folder=".", sizes=(), extra={"device": torch.device("cpu")}, grpo=OPTIONS)


def test_a_partial_rebuilds_from_its_recipe_with_its_bound_arguments():
    recipe = reward_recipe(functools.partial(scaled_digits, ["12ab"], scale=3.0))
    target = f"{__name__}.scaled_digits"
    assert recipe == {"_target_": target, "_partial_": True, "_args_": [["12ab"]], "scale": 3.0}
    rebuilt = resolve_callable(weights_only_load(recipe), "reward_funcs[0]")
    assert rebuilt.func is scaled_digits and rebuilt.keywords == {"scale": 3.0}
    assert rebuilt() == [3.0 * 0.5]


def test_unimportable_rewards_are_named(tiny_model_dir, tmp_path, recwarn):
    unplain = functools.partial(scaled_digits, scale=torch.tensor(2.0))  # a tensor: no plain argument
    zero = lambda completions, **kwargs: [0.0] * len(completions)  # noqa: E731
    module = GRPOModule(tiny_model_dir, reward_funcs=[digit_reward, zero], grpo=OPTIONS)
    assert module.hparams["reward_funcs"] == [
        "tests.helpers.digit_reward",
        {"not_importable": f"{__name__}.test_unimportable_rewards_are_named.<locals>.<lambda>"},
    ]
    assert reward_recipe(unplain) == {"not_importable": f"functools.partial({__name__}.scaled_digits, ...)"}
    assert reward_recipe(module.configure_model) == {
        "not_importable": "grpo_lightning.training.module.GRPOModule.configure_model"
    }
    trainer = quiet_trainer(max_steps=1, limit_val_batches=0)
    trainer.fit(module, arithmetic_data(8))
    (warning,) = [str(w.message) for w in recwarn if "no import path" in str(w.message)]
    assert warning.startswith(f"reward_funcs[1] ({__name__}.test_unimportable_rewards_are_named")
    trainer.save_checkpoint(tmp_path / "lambda.ckpt")
    with pytest.raises(
        ValueError,
        match=r"^reward_funcs\[1\]: the checkpoint names .*test_hparams\..*"
        r"<lambda>, which has no import path: pass it again, e\.g\. load_from_checkpoint",
    ):
        GRPOModule.load_from_checkpoint(tmp_path / "lambda.ckpt")


def test_two_rewards_of_one_name_are_refused(tiny_model_dir):
    halves, doubles = functools.partial(scaled_digits, scale=0.5), functools.partial(scaled_digits, scale=2.0)
    with pytest.raises(
        ValueError,
        match=r"^model\.reward_funcs\[1\] is named 'scaled_digits', as "
        r"reward_funcs\[0\] is: each reward's metrics go by its name",
    ):
        GRPOModule(tiny_model_dir, reward_funcs=[halves, doubles])
    doubles.__name__ = "doubled_digits"  # a name of its own
    assert GRPOModule(tiny_model_dir, reward_funcs=[halves, doubles]).reward_names == [
        "scaled_digits",
        "doubled_digits",
    ]


class DigitsWithSGD(GRPOModule):
    """The documented subclass pattern: its own reward (a base argument fixed), its own optimizer with an
    option of its own, every other base argument passed on."""

    def __init__(self, policy: str, momentum: float = 0.9, **kwargs) -> None:
        super().__init__(policy, reward_funcs=[digit_reward], **kwargs)
        self.momentum = momentum

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in self.policy.parameters() if p.requires_grad]
        return torch.optim.SGD(params, lr=self.grpo.learning_rate, momentum=self.momentum)


class FrameOf(GRPOModule):
    """Records the frame of `GRPOModule.__init__` under a subclass that fixes `reward_funcs`."""

    def __init__(self, policy: str, momentum: float = 0.9, **kwargs) -> None:
        super().__init__(policy, reward_funcs=[digit_reward], **kwargs)

    def save_hyperparameters(self, *args, frame=None, **kwargs) -> None:
        self.own = own_arguments(frame, GRPOModule)
        super().save_hyperparameters(*args, frame=frame, **kwargs)


def test_own_arguments_are_the_most_specific_init_s_and_those_its_kwargs_pass_on(tiny_model_dir):
    module = FrameOf(tiny_model_dir, momentum=0.5, grpo=OPTIONS)
    assert {"policy", "momentum", "grpo"} <= module.own
    assert "reward_funcs" not in module.own  # fixed by the subclass: its __init__ takes it no more


def test_a_subclass_that_fixes_a_base_argument_loads_from_its_checkpoint(tiny_model_dir, tmp_path):
    module = DigitsWithSGD(tiny_model_dir, momentum=0.5, grpo=OPTIONS)
    assert "reward_funcs" not in module.hparams and module.hparams["momentum"] == 0.5
    trainer = quiet_trainer(max_steps=1, limit_val_batches=0)
    trainer.fit(module, arithmetic_data(8))
    assert type(trainer.optimizers[0]) is torch.optim.SGD
    trainer.save_checkpoint(tmp_path / "sub.ckpt")
    torch.load(tmp_path / "sub.ckpt", weights_only=True)

    loaded = DigitsWithSGD.load_from_checkpoint(tmp_path / "sub.ckpt")
    assert loaded.momentum == 0.5 and loaded.reward_funcs == [digit_reward]
    assert loaded.grpo.max_completion_length == 4
    for name, weight in module.policy.state_dict().items():
        assert torch.equal(weight, loaded.policy.state_dict()[name]), name
