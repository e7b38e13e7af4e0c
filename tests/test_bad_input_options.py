"""Bad options end in one line naming the option and its rule, before any weights load: the module's and
the data module's options, the Trainer's own knobs under manual optimisation (`training.trainer_options`),
and values of the wrong type on the command line or in a YAML config (`cli.py` exits with status 2, no
traceback)."""

import json
import math
import os
import shutil
import tempfile

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grpo_lightning.cli import build_cli
from grpo_lightning.cli import main as cli_main
from grpo_lightning.cli.config_checks import SECTIONS, check_config_files, strategy_class_path
from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.demo.cpu_budget import CPUTimeBudget
from grpo_lightning.training.data import GSM8KDataModule
from tests.helpers import (
    cli_error,
    one_error_line,
)
from tests.test_interrupt import fit_args


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
