"""Options given the Lightning way and values met at the module's edges: the Trainer's knobs under manual
optimisation (`training.trainer_options`) map onto the module's options with the same result, or are one line;
reward weights that are not finite numbers, rewards beyond float32, a checkpoint of another model, a logger's
`dict_kwargs` its class does not take, and a wrong type given to the CLI entry point are one line each."""

import math
import subprocess
import sys

import lightning as L
import pytest
import torch
import yaml
from hypothesis import given
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from grpo_lightning.cli import build_cli
from grpo_lightning.core.rewards.scoring import (
    FLOAT32_MAX,
    RewardInputs,
    check_reward_weights,
    score_completions,
)
from tests.helpers import (
    cli_error,
    one_error_line,
)
from tests.test_bad_input_rewards import digit_count_reward, nan_reward
from tests.test_interrupt import REPO, fit_args


def cli_fit(args: list[str]):
    """`cli.py fit` in-process; the CLI object, with the trained module."""
    return build_cli(args)


def trained_weights(cli) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in cli.model.policy.state_dict().items()}


class TestOptionsTheLightningWay:
    def test_accumulate_and_clip_map_onto_the_module_options_with_the_same_result(
        self, tiny_model_dir, tmp_path
    ):
        common = ["--seed_everything=0", "--model.grpo.learning_rate=0.01"]
        lightning_way = cli_fit(
            fit_args(
                tiny_model_dir,
                str(tmp_path / "a"),
                1,
                *common,
                "--trainer.accumulate_grad_batches=2",
                "--trainer.gradient_clip_val=0.5",
            )
        )
        ours = cli_fit(
            fit_args(
                tiny_model_dir,
                str(tmp_path / "b"),
                1,
                *common,
                "--data.batch_size=4",
                "--model.grpo.micro_batch_size=4",  # one batch of 2 prompts x 2 samples per backward
                "--model.grpo.max_grad_norm=0.5",
            )
        )
        trainer, grpo = lightning_way.trainer, lightning_way.model.grpo
        assert trainer.accumulate_grad_batches == 1 and trainer.gradient_clip_val is None
        assert (
            lightning_way.datamodule.hparams.batch_size,
            grpo.update.micro_batch_size,
            grpo.optimizer.max_grad_norm,
        ) == (
            4,
            4,
            0.5,
        )
        assert trainer.global_step == ours.trainer.global_step == 1
        before = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
        for name, weight in trained_weights(lightning_way).items():
            assert torch.equal(weight, trained_weights(ours)[name]), name
        assert any(not torch.equal(w, before[n]) for n, w in trained_weights(ours).items())  # it trained

    @pytest.mark.parametrize(
        ("options", "message"),
        [
            (
                ["--trainer.gradient_clip_val=0.5", "--trainer.gradient_clip_algorithm=value"],
                "trainer.gradient_clip_algorithm='value': GRPOModule clips the gradients by their global "
                "norm only, with model.grpo.optimizer.max_grad_norm",
            ),
            (
                ["--trainer.gradient_clip_val=0.5", "--model.grpo.max_grad_norm=2.0"],
                "trainer.gradient_clip_val=0.5 and model.grpo.optimizer.max_grad_norm=2.0 disagree",
            ),
            (
                ["--trainer.max_steps=abc"],
                "error: trainer.max_steps=abc: expected an integer",
            ),
            (
                ["--model.reward_weights=[.inf]"],
                "model.reward_weights[0]=inf, the weight of reward function 'digit_reward': must be a finite",
            ),
            (
                ["--model.reward_weights=[.nan]"],
                "model.reward_weights[0]=nan, the weight of reward function ",
            ),
        ],
        ids=["clip-by-value", "clip-disagrees", "wrong-type", "inf-weight", "nan-weight"],
    )
    def test_options_no_counterpart_or_bad_values_are_one_line(
        self, tiny_model_dir, tmp_path, capsys, no_weights, options, message
    ):
        err = cli_error(fit_args(tiny_model_dir, str(tmp_path), 1, *options), capsys)
        assert message in one_error_line(err)

    @given(
        st.lists(
            st.one_of(st.floats(), st.integers(-5, 5), st.booleans(), st.none(), st.text(max_size=2)),
            min_size=2,
            max_size=2,
        )
    )
    def test_reward_weights_are_finite_numbers_named_with_their_function(self, weights):
        funcs = [digit_count_reward, nan_reward]
        try:
            check_reward_weights(weights, funcs)
        except ValueError as err:
            i = next(
                i
                for i, w in enumerate(weights)
                if isinstance(w, bool) or not isinstance(w, int | float) or not abs(w) <= FLOAT32_MAX
            )
            name = ["digit_count_reward", "nan_reward"][i]
            assert str(err) == (
                f"model.reward_weights[{i}]={weights[i]!r}, the weight of reward function {name!r}: must be "
                "a finite number"
            )
        else:
            assert all(
                not isinstance(w, bool) and isinstance(w, int | float) and math.isfinite(w) for w in weights
            )

    @given(st.floats(allow_nan=False, allow_infinity=False))
    def test_rewards_beyond_float32_name_the_function(self, value):
        def huge_reward(completions, **kwargs):
            return [0.0, value]

        inputs = RewardInputs(["q"] * 2, ["a", "b"])
        if abs(value) <= FLOAT32_MAX:
            scores = score_completions([huge_reward], inputs)
            assert torch.isfinite(scores.rewards).all()
            return
        with pytest.raises(RuntimeError) as error:
            score_completions([huge_reward], inputs)
        assert str(error.value).startswith(
            f"reward function 'huge_reward' returned {value} for completion 1 (beyond float32's range"
        )

    @pytest.mark.parametrize("subcommand", ["validate", "export", "fit"])
    def test_a_checkpoint_of_another_model_names_the_first_mismatched_tensor(
        self, tiny_model_dir, other_model_dir, tmp_path, capsys, subcommand
    ):
        state = AutoModelForCausalLM.from_pretrained(other_model_dir).state_dict()
        path = tmp_path / "other.ckpt"
        saved = {"state_dict": {"policy." + k: v for k, v in state.items()}, "global_step": 1}
        resumable = {"optimizer_states": [], "lr_schedulers": []}  # what fit reads besides the weights
        torch.save(saved | resumable | {"pytorch-lightning_version": L.__version__}, path)
        extra = [f"--out={tmp_path / 'export'}"] if subcommand == "export" else []
        args = [subcommand, *fit_args(tiny_model_dir, str(tmp_path), 1)[1:], f"--ckpt_path={path}", *extra]
        err = cli_error(args, capsys)
        assert (
            f"error: checkpoint '{path}' does not fit this model: policy.model.embed_tokens.weight has shape "
            "[600, 64] in the checkpoint but [400, 64] here; it was trained from another model" in err
        )
        one_error_line(err)


def wandb_config(tmp_path, model_dir: str) -> str:
    """A config whose logger is WandbLogger with `dict_kwargs` (wandb.init's own arguments)."""
    path = tmp_path / "wandb.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "trainer": {
                    "logger": {
                        "class_path": "lightning.pytorch.loggers.WandbLogger",
                        "init_args": {"save_dir": str(tmp_path / "runs"), "project": "grpo"},
                        "dict_kwargs": {"group": "gsm8k", "tags": ["baseline"]},
                    }
                },
                "model": {"policy": model_dir},
            }
        )
    )
    return str(path)


@pytest.mark.parametrize("logger", ["TensorBoardLogger", "CSVLogger"])
def test_switching_the_logger_class_drops_the_earlier_classs_dict_kwargs(tiny_model_dir, tmp_path, logger):
    """jsonargparse keeps WandbLogger's `dict_kwargs` for the class the command line names instead, which
    refused them (TensorBoardLogger's SummaryWriter with a TypeError traceback): they are dropped."""
    cli = build_cli(
        ["--config", wandb_config(tmp_path, tiny_model_dir), "--trainer.logger", logger], run=False
    )
    assert type(cli.trainer.logger).__name__ == logger
    assert cli.trainer.logger.save_dir == str(tmp_path / "runs")  # the options both classes take are kept
    assert cli.trainer.logger.experiment is not None  # made from its arguments: SummaryWriter's refused them


def test_dict_kwargs_for_a_logger_that_takes_none_are_one_line(tiny_model_dir, tmp_path, capsys, no_weights):
    args = fit_args(tiny_model_dir, str(tmp_path), 1, "--trainer.logger.dict_kwargs.group=gsm8k")
    assert one_error_line(cli_error(args, capsys)) == (
        "error: trainer.logger: CSVLogger takes no keyword arguments beyond its own, but its dict_kwargs "
        "give it group: remove them, or name a logger class that takes them"
    )


def test_the_cli_entry_point_prints_a_wrong_type_as_its_one_line(tiny_model_dir, tmp_path):
    """The real command, in a process of its own: jsonargparse's usage is not printed, only the error."""
    args = fit_args(tiny_model_dir, str(tmp_path), 1, "--data.batch_size=two")
    done = subprocess.run(
        [sys.executable, "cli.py", *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == ("error: data.batch_size=two: expected an integer"), (
        done.stderr
    )
    assert "usage:" not in done.stderr and "--help" not in done.stderr
