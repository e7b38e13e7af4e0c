"""Bad options end in one line naming the option and its rule, before any weights load: the module's and
the data module's options, the Trainer's own knobs under manual optimisation (`training.trainer_options`),
and values of the wrong type on the command line or in a YAML config (`cli.py` exits with status 2, no
traceback)."""

import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile

import lightning as L
import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from grpo_lightning.cli import build_cli
from grpo_lightning.cli import main as cli_main
from grpo_lightning.cli.config_checks import SECTIONS, check_config_files, strategy_class_path
from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.rewards.scoring import (
    FLOAT32_MAX,
    RewardInputs,
    check_reward_weights,
    score_completions,
)
from grpo_lightning.demo.cpu_budget import CPUTimeBudget
from grpo_lightning.training.data import GSM8KDataModule
from tests.helpers import (
    arithmetic_data,
    cli_error,
    length_reward,
    one_error_line,
    quiet_trainer,
    tiny_module,
)
from tests.test_bad_input_rewards import digit_count_reward, nan_reward
from tests.test_interrupt import REPO, fit_args
from tests.test_own_optimizer import LR, OwnOptimizer, StepLearningRates, halving, sgd


# ------------------------------------------------------------------------------------------ options
# Each rule is checked where the option is built (tests/test_config.py checks the rules); the command line
# shows its one line before any weights load, as for these two (each command costs a parser build).
@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("--model.grpo.loss_type=ppo", "model.grpo.loss.loss_type='ppo': must be one of grpo, bnpo, dapo"),
        ("--model.policy=/no/such/model", "model path '/no/such/model' does not exist"),
    ],
)
def test_bad_option_is_one_line_before_weights_load(
    tiny_model_dir, tmp_path, capsys, no_weights, option, message
):
    err = cli_error(fit_args(tiny_model_dir, str(tmp_path), 1, option), capsys)
    assert f"error: {message}" in err


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"num_generations": 1}, "GRPOConfig.sampling.num_generations=1: must be >= 2"),
        ({"epsilon": 0.0}, "GRPOConfig.loss.epsilon=0.0: must be > 0"),
        ({"beta": -0.1}, "GRPOConfig.kl.beta=-0.1: must be >= 0"),
        ({"max_completion_length": 0}, "GRPOConfig.sampling.max_completion_length=0: must be > 0"),
    ],
)
def test_bad_option_names_itself_and_its_rule(options, message):
    with pytest.raises(ValueError) as error:
        GRPOConfig(**options)
    assert str(error.value).startswith(message)


def test_dr_grpo_without_a_length(tiny_model_dir, tmp_path, capsys, no_weights):
    with pytest.raises(ValueError, match="GRPOConfig.sampling.max_completion_length=None: must be > 0"):
        GRPOConfig(loss_type="dr_grpo", max_completion_length=None)
    err = cli_error(
        fit_args(
            tiny_model_dir,
            str(tmp_path),
            1,
            "--model.grpo.loss_type=dr_grpo",
            "--model.grpo.max_completion_length=null",
        ),
        capsys,
    )
    assert "max_completion_length" in err


def test_lora_targets_the_model_lacks_are_named_with_the_real_ones(tiny_model_dir, tmp_path, capsys):
    args = fit_args(tiny_model_dir, str(tmp_path), 1, "--model.lora.target_modules=[attn_q]")
    err = cli_error(args, capsys)
    assert "error: LoraOptions.target_modules=['attn_q'] does not match this model (LlamaForCausalLM)" in err
    assert "'q_proj'" in err  # the names it could have used


def test_missing_chat_template_fails_before_weights_load_with_the_fix(
    tiny_model_dir, tmp_path, capsys, no_weights
):
    model_dir = tmp_path / "no_template"
    shutil.copytree(tiny_model_dir, model_dir)
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    for name in os.listdir(model_dir):  # newer transformers keep the template in its own file
        if name.startswith("chat_template"):
            os.remove(model_dir / name)
    err = cli_error(fit_args(str(model_dir), str(tmp_path), 1), capsys)
    assert "error: the tokenizer has no chat template but the prompts are chat messages: set " in err
    assert "`tokenizer.chat_template`" in err


# ------------------------------------------------------------------------------------------ data options
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"val_size": -1}, "data.val_size=-1: must be >= 0"),
        ({"train_size": 0}, "data.train_size=0: must be >= 1"),
        ({"batch_size": 0}, "data.batch_size=0: must be >= 1"),
        ({"val_batch_size": -3}, "data.val_batch_size=-3: must be >= 1"),
        ({"arithmetic_size": 0}, "data.arithmetic_size=0: must be >= 1"),
        ({"num_workers": -1}, "data.num_workers=-1: must be >= 0"),
        ({"val_split": "train"}, "data.val_split='train': must be one of holdout, test"),
    ],
)
def test_bad_data_option_names_itself_and_its_rule(options, message):
    with pytest.raises(ValueError) as error:
        GSM8KDataModule(source="arithmetic", **options).setup("fit")
    assert str(error.value).startswith(message)


def test_a_bad_data_option_is_one_line_before_weights_load(tiny_model_dir, tmp_path, capsys, no_weights):
    err = cli_error(fit_args(tiny_model_dir, str(tmp_path), 1, "--data.batch_size=0"), capsys)
    assert one_error_line(err) == "error: data.batch_size=0: must be >= 1"


@given(st.integers(-5, 5), st.one_of(st.none(), st.integers(-5, 5)))
def test_data_sizes_are_accepted_exactly_in_range(val_size, train_size):
    try:
        GSM8KDataModule(source="arithmetic", val_size=val_size, train_size=train_size).check_options()
    except ValueError as err:
        bad = f"data.val_size={val_size}" if val_size < 0 else f"data.train_size={train_size}"
        assert str(err).startswith(f"{bad}: must be >= ")
        assert val_size < 0 or (train_size is not None and train_size < 1)
    else:
        assert val_size >= 0 and (train_size is None or train_size >= 1)


def test_validate_with_no_validation_rows_is_an_error(tiny_model_dir, tmp_path, capsys, no_weights):
    args = fit_args(tiny_model_dir, str(tmp_path), 1, "--data.val_size=0")
    err = cli_error(["validate", *args[1:]], capsys)
    assert "error: nothing to validate: data.val_size=0 gives no validation rows" in err


# ------------------------------------------------------------------------------------------ 3. options
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


# ------------------------------------------------------------------------------------------ noisy values
@pytest.fixture(scope="module")
def parser(tiny_model_dir):
    """The CLI's parser (built once: building it is the slow part of a command), without a subcommand."""
    return build_cli([f"--model.policy={tiny_model_dir}", "--trainer.logger=false"], run=False).parser


# What YAML reads as text, not as a float (`.inf`, `1e999` are floats, which the options' rules refuse).
NOT_FINITE = ["inf", "-inf", "nan", "NaN", "Infinity"]


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    option=st.sampled_from(
        [
            "model.grpo.optimizer.learning_rate",
            "model.grpo.sampling.temperature",
            "model.grpo.optimizer.max_grad_norm",
            "model.grpo.loss.delta",
        ]
        + ["trainer.gradient_clip_val", "model.grpo.advantages.clip", "data.batch_size", "trainer.max_steps"]
    ),
    value=st.sampled_from(NOT_FINITE),
)
def test_inf_and_nan_typed_on_the_command_line_are_one_plain_line(
    parser, tiny_model_dir, capsys, option, value
):
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args([f"--model.policy={tiny_model_dir}", f"--{option}={value}"])
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: {option}={value}: expected ")
    assert "<class" not in line and "Union" not in line and "Given value" not in line
    integer = option in ("data.batch_size", "trainer.max_steps")
    assert line.endswith("expected an integer") if integer else "a finite number" in line


def test_a_bad_callback_value_is_the_callbacks_own_line(tiny_model_dir, tmp_path, capsys, no_weights):
    budget = ["--trainer.callbacks+=grpo_lightning.demo.cpu_budget.CPUTimeBudget"]
    err = cli_error(
        fit_args(tiny_model_dir, str(tmp_path), 1, *budget, "--trainer.callbacks.max_cpu_seconds=-1"), capsys
    )
    assert one_error_line(err) == "error: CPUTimeBudget.max_cpu_seconds=-1.0: must be > 0 or None"


@given(st.one_of(st.none(), st.floats(), st.integers(-3, 3), st.booleans(), st.text(max_size=3)))
def test_the_budget_takes_exactly_a_finite_positive_number_or_none(value):
    try:
        CPUTimeBudget(max_wall_seconds=value)
    except ValueError as err:
        assert (
            str(err)
            == f"CPUTimeBudget.max_wall_seconds={value!r}: must be " + str(err).split(": must be ")[1]
        )
        assert not (value is None or (type(value) in (int, float) and math.isfinite(value) and value > 0))
    else:
        assert value is None or (type(value) in (int, float) and math.isfinite(value) and value > 0)


YAML_VALUES = (
    st.one_of(
        st.integers(),
        st.floats(allow_nan=False),
        st.booleans(),
        st.lists(st.integers(), max_size=2),
        st.none(),
    )
    | st.text(max_size=3)
    | st.dictionaries(st.sampled_from(["a", "b"]), st.integers(), max_size=1)
)


@settings(max_examples=40, deadline=None)
@given(section=st.sampled_from(sorted(SECTIONS)), value=YAML_VALUES)
def test_a_yaml_section_of_the_wrong_type_is_named(section, value):
    """A section (`model:`, `model.grpo:`, ...) that holds a number, a boolean or a list is named with the
    file; a mapping, a string (a file holding the section, or a class path) or nothing passes on."""
    config = {section[0]: value} if len(section) == 1 else {section[0]: {section[1]: value}}
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "config.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(config, f)
        try:
            check_config_files(["fit", "--config", path])
        except ValueError as err:
            assert str(err).startswith(f"config {path}: {'.'.join(section)} is ")
            assert str(err).endswith(f"it must be a section, a mapping of {SECTIONS[section]}")
            assert not isinstance(value, dict | str | None)
        else:
            assert isinstance(value, dict | str | None)


def test_a_section_of_the_wrong_type_is_one_line_not_a_traceback(
    tiny_model_dir, tmp_path, capsys, no_weights
):
    path = tmp_path / "config.yaml"
    path.write_text("model:\n  grpo: 3\n")  # jsonargparse took it, then failed with a TypeError traceback
    err = cli_error([*fit_args(tiny_model_dir, str(tmp_path), 1), f"--config={path}"], capsys)
    assert one_error_line(err) == (
        f"error: config {path}: model.grpo is an integer (3): it must be a section, a mapping of GRPOConfig "
        "options"
    )
    path.write_text("- model\n")
    err = cli_error([*fit_args(tiny_model_dir, str(tmp_path), 1), f"--config={path}"], capsys)
    assert "holds a list: a config is a mapping of sections (model:, data:, trainer:)" in one_error_line(err)


def test_a_strategy_named_by_its_class_is_that_class(tiny_model_dir):
    from lightning.pytorch.strategies import ModelParallelStrategy

    assert (
        strategy_class_path("ModelParallelStrategy")
        == "lightning.pytorch.strategies.model_parallel.ModelParallelStrategy"
    )
    assert strategy_class_path("ddp") is None and strategy_class_path("NoSuchStrategy") is None
    # What the offload error advises, typed as it says: the class, not an unknown strategy name.
    cli = build_cli(
        [
            f"--model.policy={tiny_model_dir}",
            "--trainer.logger=false",
            "--trainer.strategy=ModelParallelStrategy",
        ],
        run=False,
    )
    assert isinstance(cli.trainer.strategy, ModelParallelStrategy)


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


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("r.yaml", "bf16: maybe\n", "r.yaml: bf16: 'maybe' is not true or false; correct it in the recipe"),
        (
            "r.yaml",
            "max_steps: many\n",
            "r.yaml: max_steps: 'many' is not an integer; correct it in the recipe",
        ),
        ("r.sh", "grpo.py --lora_r 8.5 --use_peft\n", "r.sh: lora_r: 8.5 is not an integer; correct it"),
        ("r.sh", "grpo.py --use_peft yes\n", "r.sh: use_peft: 'yes' is not true or false; correct it"),
        # A YAML recipe with a syntax error (and a `--` in a comment) is YAML's error, at its line.
        ("r.yaml", "beta: 0\n# like --beta\nlearning_rate: [1e-6\nseed: 1\n", "r.yaml:4: not valid YAML"),
        ("r.txt", "beta: 0\nlr: [1\n--x: 2\n", "r.txt:3: not valid YAML"),
    ],
)
def test_a_from_trl_recipe_value_of_the_wrong_type_is_refused_naming_it(
    name, content, message, tmp_path, capsys, monkeypatch
):
    """A recipe's value that TRL's type does not allow is refused in one line naming its key, never read
    as something else (`bf16: maybe` was bf16-mixed, `max_steps: many` -1); a broken YAML is YAML's error."""
    (tmp_path / name).write_text(content)
    monkeypatch.chdir(tmp_path)
    err = cli_error(["from-trl", name, "--out", "config.yaml"], capsys)
    assert one_error_line(err).startswith(f"error: {message}") and not (tmp_path / "config.yaml").exists()


def test_a_quoted_from_trl_value_starting_with_dashes_is_a_value(tmp_path, capsys):
    """In a command-line recipe a quoted `"--x"` is the value of the option before it, as a shell reads it;
    unquoted, `--x` is an option."""
    recipe = tmp_path / "cmd.sh"
    recipe.write_text(
        "accelerate launch grpo.py --dataset_name \"--odd name\" --output_dir='--out dir' --beta 0.1\n"
    )
    cli_main(["from-trl", str(recipe)])
    out, err = capsys.readouterr()
    config = yaml.safe_load(out)
    assert config["data"]["init_args"]["source"] == "--odd name"
    assert config["trainer"]["default_root_dir"] == "--out dir"
    assert config["model"]["grpo"]["kl"]["beta"] == 0.1


@pytest.mark.parametrize(
    ("options", "message"),
    [
        # A flat name and its section's key on one command line: refused as in a config file, whichever
        # comes first (the last won in silence).
        (
            ["--model.grpo.beta=0.1", "--model.grpo.kl.beta=0.2"],
            "command line: model.grpo: beta and kl.beta are one option, given twice: give one",
        ),
        (
            ["--model.grpo.kl.beta", "0.2", "--model.grpo.beta", "0.1"],
            "command line: model.grpo: beta and kl.beta are one option, given twice: give one",
        ),
        (
            ["--model.grpo.num_generations=4", "--model.grpo.sampling.num_generations=2"],
            "model.grpo: num_generations and sampling.num_generations are one option, given twice",
        ),
        # transformers' warm-up share, by its flat name: pointed to warmup_ratio.
        (
            ["--model.grpo.warmup_steps", "0.5"],
            "model.grpo.warmup_steps=0.5: a count of optimizer steps; for a share of the run, as "
            "transformers reads warmup_steps below 1, give --model.grpo.warmup_ratio 0.5",
        ),
    ],
)
def test_an_option_given_under_two_names_on_the_command_line_is_one_line(
    tiny_model_dir, tmp_path, capsys, no_weights, options, message
):
    err = cli_error(fit_args(tiny_model_dir, str(tmp_path), 1, *options), capsys)
    line = one_error_line(err)
    assert line.startswith(f"error: {message}") or line.startswith(f"error: command line: {message}")


def test_a_flat_name_given_twice_on_the_command_line_is_its_last_value(tiny_model_dir, tmp_path):
    """Only two names of one option are refused: one name given twice is the last, as any option."""
    args = fit_args(tiny_model_dir, str(tmp_path), 1, "--model.grpo.beta=0.1", "--model.grpo.beta=0.2")
    cli = build_cli(args[1:], run=False)  # without the subcommand
    assert cli.model.grpo.kl.beta == 0.2


def templated_args(model_dir: str, folder) -> list[str]:
    """A command line (without a subcommand) whose free-text options YAML would read as a mapping and a
    list: `--data.prompt_template "Solve: {question}"` (the docs' example) and a system prompt, in both
    spellings of an option's value."""
    rows = folder / "rows.jsonl"
    rows.write_text(
        "".join(json.dumps({"question": f"{i}+1?", "answer": str(i + 1)}) + "\n" for i in range(4))
    )
    return [
        f"--model.policy={model_dir}",
        "--data=grpo_lightning.training.data.PromptDataModule",
        f"--data.source={rows}",
        "--data.prompt_template=Solve: {question}",
        "--data.system_prompt",
        "Be: {brief}, [short]",
        "--trainer.logger=false",
    ]


TYPED = ("Solve: {question}", "Be: {brief}, [short]")  # what `templated_args` typed


def test_the_documented_prompt_template_is_taken_as_typed_on_the_command_line(tiny_model_dir, tmp_path):
    """Text that YAML would read as a mapping is the text typed."""
    data = build_cli(templated_args(tiny_model_dir, tmp_path), run=False).datamodule.hparams
    assert (data.prompt_template, data.system_prompt) == TYPED


def test_print_config_shows_free_text_as_typed_and_its_yaml_loads_again(tiny_model_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        build_cli([*templated_args(tiny_model_dir, tmp_path), "--print_config"], run=False)
    assert not done.value.code
    printed = capsys.readouterr().out
    data = yaml.safe_load(printed)["data"]["init_args"]
    assert (data["prompt_template"], data["system_prompt"]) == TYPED  # "!text Solve: {question}" before
    (tmp_path / "printed.yaml").write_text(printed)
    loaded = build_cli(["--config", str(tmp_path / "printed.yaml")], run=False).datamodule.hparams
    assert (loaded.prompt_template, loaded.system_prompt) == TYPED
    misplaced = "--model.prompt_template=Solve: {question}"  # the data's option, given to the model
    said = one_error_line(cli_error(["fit", *templated_args(tiny_model_dir, tmp_path), misplaced], capsys))
    assert "Solve: {question}" in said and "!text" not in said  # an error shows it as typed too
