"""Every option is range-checked where it is declared, and a resumed run never drops an option silently."""

import ast
import inspect
import math
import os
from dataclasses import fields
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_lightning.cli import build_cli
from grpo_lightning.cli.sections import sectioned_argv
from grpo_lightning.cli.trainer import GRPOTrainer
from grpo_lightning.core.config import FLAT_NAMES, GRPOConfig
from grpo_lightning.core.flat_names import default_at, section_at
from grpo_lightning.core.options import declared_rule
from grpo_lightning.io.models import LoraOptions, ModelOptions
from grpo_lightning.training.data import GSM8KDataModule
from grpo_lightning.training.module import GRPOModule
from tests.helpers import cli_error, digit_reward, quiet_trainer
from tests.test_interrupt import fit_args

# Each section of GRPOConfig by its place ("kl", "engine.vllm").
SECTIONS = {
    ".".join(e.path[:-1]): section_at(GRPOConfig, e.path) for e in FLAT_NAMES.values() if not e.switch
}
SWITCHED = {e.path[0] for e in FLAT_NAMES.values() if e.switch}

NAN_OR_INF = st.sampled_from([math.nan, math.inf, -math.inf])


def below(limit: float, inclusive: bool) -> st.SearchStrategy:
    """Finite numbers under `limit` (or equal to it when `inclusive`), and NaN / inf."""
    return (
        st.floats(max_value=limit, exclude_max=not inclusive, allow_nan=False, allow_infinity=False)
        | NAN_OR_INF
    )


def above(limit: float, inclusive: bool) -> st.SearchStrategy:
    return (
        st.floats(min_value=limit, exclude_min=not inclusive, allow_nan=False, allow_infinity=False)
        | NAN_OR_INF
    )


def ints_below(limit: int) -> st.SearchStrategy:
    return st.integers(max_value=limit - 1)


NOT_A_NUMBER = st.sampled_from(["1", True, False, [1], None])
NOT_A_FLAG = st.sampled_from([0, 1, "true", "yes", None, 1.0])

# Values each option must refuse, written from the docstrings (not from the rules under test).
REFUSED = {
    GRPOConfig: {
        "num_generations": ints_below(2) | NOT_A_NUMBER | st.just(4.0),
        "max_completion_length": ints_below(1) | st.just(None) | st.just("256"),
        "min_completion_length": ints_below(0) | st.integers(min_value=257) | st.just(None),
        "max_prompt_length": ints_below(1) | st.just(1.5),
        "truncate_prompts": st.sampled_from(["right", "LEFT", "", None]),
        "chat_template_kwargs": st.sampled_from(["enable_thinking=false", ["enable_thinking"], False, 1]),
        "temperature": below(0, inclusive=True) | NOT_A_NUMBER,
        "top_p": below(0, inclusive=True) | above(1, inclusive=False) | NOT_A_NUMBER,
        "top_k": ints_below(-1) | st.just(2.5),  # -1 and None are TRL's 0
        "min_p": below(0, inclusive=False) | above(1, inclusive=False) | st.just("0.1"),  # None is TRL's 0
        "repetition_penalty": below(0, inclusive=True) | NOT_A_NUMBER,
        "dynamic_sampling": st.sampled_from([0, 1, "true", "yes", 1.0]),  # None: off
        "dynamic_sampling_max_rounds": ints_below(0) | st.just(None),
        "dynamic_sampling_metric": st.sampled_from([1, ["accuracy_reward"]]),
        "scale_rewards": st.sampled_from(["std", "Group", None, 1]),  # true and false are TRL's
        "baseline": st.sampled_from(["median", "rloo", None]),
        "advantage_clip": below(0, inclusive=True),
        "step_credit": below(0, inclusive=False),
        "loss_type": st.sampled_from(["ppo", "GRPO", "dapo ", None]),
        "importance_sampling_level": st.sampled_from(["tokens", "seq", None]),
        "importance_sampling_correction": NOT_A_FLAG,
        "importance_sampling_cap": below(1, inclusive=False) | NOT_A_NUMBER,
        "epsilon": below(0, inclusive=True) | NOT_A_NUMBER,
        "epsilon_high": below(0, inclusive=True),
        "delta": below(1, inclusive=True),
        "beta": below(0, inclusive=False) | NOT_A_NUMBER,
        "kl_estimator": st.sampled_from(["k4", "kl", None]),
        "use_kl_in_reward": NOT_A_FLAG,
        "use_bias_correction_kl": NOT_A_FLAG,
        "entropy_coef": NAN_OR_INF | NOT_A_NUMBER,
        "num_iterations": ints_below(1) | NOT_A_NUMBER,
        "steps_per_generation": ints_below(1) | NOT_A_NUMBER,
        "mask_truncated_completions": NOT_A_FLAG,
        "top_entropy_quantile": below(0, inclusive=True) | above(1, inclusive=False) | NOT_A_NUMBER,
        "learning_rate": below(0, inclusive=True) | NOT_A_NUMBER,
        "weight_decay": below(0, inclusive=False) | NOT_A_NUMBER,
        "optim": st.sampled_from(["adamw", "AdamW", "sgd", "adamw_torch_4bit", "", None, 1]),
        "adam_beta1": below(0, inclusive=False) | above(1, inclusive=True) | NOT_A_NUMBER,
        "adam_beta2": below(0, inclusive=False) | above(1, inclusive=True) | NOT_A_NUMBER,
        "adam_epsilon": below(0, inclusive=False) | NOT_A_NUMBER,
        "warmup_steps": ints_below(0) | NOT_A_NUMBER,
        "warmup_ratio": below(0, inclusive=False) | above(1, inclusive=True) | NOT_A_NUMBER,
        "lr_scheduler_type": st.sampled_from(["inverse_sqrt", "Linear", "cosine_with_restarts", None]),
        "min_lr_ratio": below(0, inclusive=False) | above(1, inclusive=False) | NOT_A_NUMBER,
        "max_grad_norm": below(0, inclusive=False) | st.just("1.0"),  # 0 is TRL's None
        "micro_batch_size": ints_below(1),
        "max_tokens_per_micro_batch": ints_below(1) | st.just(2.5),
        "max_bad_steps": ints_below(1) | NOT_A_NUMBER,
        "log_completions_every": ints_below(0) | NOT_A_NUMBER,
        "preflight": NOT_A_FLAG,
        "logging_first_step": NOT_A_FLAG,
        "share_prompt": NOT_A_FLAG,
        "packed_sequences": NOT_A_FLAG,
        "sync_ref_model": NOT_A_FLAG,
        "ref_model_mixup_alpha": below(0, inclusive=False) | above(1, inclusive=False) | NOT_A_NUMBER,
        "ref_model_sync_steps": ints_below(1) | NOT_A_NUMBER,
        "cpu_offload": NOT_A_FLAG,
        "generation_backend": st.sampled_from(["VLLM", "Static", "compiled", "", None, True]),
        "importance_sampling_mode": st.sampled_from(["token", "sequence", "Token_Truncate", "", None]),
        "importance_sampling_floor": below(0, inclusive=True) | above(1, inclusive=False),
        "vllm_max_model_len": ints_below(1) | st.just(1.5) | st.just("512"),
        "vllm_kv_cache_gb": below(0, inclusive=True) | NOT_A_NUMBER.filter(lambda v: v is not None),
        "vllm_gpu_memory_utilization": below(0, inclusive=True) | above(1, inclusive=False) | NOT_A_NUMBER,
        "vllm_enable_sleep_mode": NOT_A_FLAG,
        "vllm_enforce_eager": NOT_A_FLAG,
        "vllm_mode": st.sampled_from(["Server", "colocated", "", True]),
        "vllm_server_base_url": st.sampled_from([1, True, [], [""], ["http://a:1", 2]]),
        "vllm_server_host": st.sampled_from([1, True, ["127.0.0.1"]]),
        "vllm_server_port": st.sampled_from([0, -1, 65536, 8000.0, "8000", None]),
        "vllm_server_timeout": below(0, inclusive=True) | NOT_A_NUMBER,
        "vllm_server_request_timeout": below(0, inclusive=True) | NOT_A_NUMBER,
        "vllm_group_port": st.sampled_from([0, 65536, "51216", None]),
        "vllm_server_trainer_host": st.sampled_from([1, True, ["a"]]),
        "vllm_server_weight_plane": st.sampled_from(["NCCL", "shm", "", None, True]),
        "vllm_server_weights_dir": st.sampled_from([1, True, ["/dev/shm"]]),
        "vllm_server_max_in_flight": ints_below(1) | NOT_A_NUMBER,
        "max_staleness": ints_below(0) | st.just(1.5) | st.just("1") | st.just(None),
        "stale_groups": st.sampled_from(["Drop", "resample", "", None, True]),
        "off_policy_correction": st.sampled_from(["tis", "off", "", None, False]),
        "max_tool_calling_iterations": ints_below(1) | st.just(2.5) | st.just("3"),
        "max_tool_response_length": ints_below(1) | st.just(2.5) | st.just("64"),
        "tool_call_format": st.sampled_from(["json", "Hermes", "", 1, True]),
        "check_tool_arguments": NOT_A_FLAG,
        # None: no bound, TRL's
        "tool_call_timeout": below(0, inclusive=True) | st.sampled_from(["1", True, False, [1]]),
        "environment_timeout": below(0, inclusive=True) | st.sampled_from(["1", True, False, [1]]),
    },
    ModelOptions: {
        "gguf_file": st.sampled_from([1, True]),
        "dtype": st.sampled_from(["fp16", "bf16", "float", "int8", "torch.float32", "", None]),
        "attn_implementation": st.sampled_from([1, ["sdpa"]]),
        "gradient_checkpointing": NOT_A_FLAG,
        "trust_remote_code": NOT_A_FLAG,
        "load_in_4bit": NOT_A_FLAG,
        "revision": st.sampled_from([1, True, ["main"]]),
        "init_kwargs": st.sampled_from([1, ["use_cache"], "use_cache=false", {"torch_dtype": "float16"}]),
        "chat_template": st.sampled_from([1, True, ["chat.jinja"]]),
    },
    LoraOptions: {
        "r": ints_below(1) | NOT_A_NUMBER,
        "alpha": below(0, inclusive=True) | NOT_A_NUMBER,
        "dropout": below(0, inclusive=False) | above(1, inclusive=True),
        "target_modules": st.sampled_from([[], None, 1, ["q_proj", 2], [""]]),
    },
}
OPTION_CLASSES = [GRPOConfig, ModelOptions, LoraOptions]


@pytest.mark.parametrize("options", OPTION_CLASSES, ids=lambda c: c.__name__)
def test_every_option_declares_its_rule_and_has_refused_values(options):
    names = set(FLAT_NAMES) if options is GRPOConfig else {f.name for f in fields(options)}
    for name in names - {n for n, e in FLAT_NAMES.items() if e.switch}:
        declared_rule(*leaf(options, name))  # an annotation that declares no rule raises TypeError
    assert set(REFUSED[options]) == names  # a new option without refused values fails here


def leaf(options: type, name: str) -> tuple[type, str]:
    """The class and field that declare option `name` of `options` (of a section, for a flat name)."""
    entry = FLAT_NAMES.get(name) if options is GRPOConfig else None
    if entry is None:
        return options, name
    if entry.switch:
        return GRPOConfig, entry.path[0]
    return section_at(GRPOConfig, entry.path), entry.path[-1]


def named(options: type, name: str) -> str:
    """How a message names option `name` of `options`: its place, and its flat name where that differs."""
    entry = FLAT_NAMES.get(name) if options is GRPOConfig else None
    return f"{options.__name__}.{name}" if entry is None else f"GRPOConfig.{entry.key}"


@pytest.mark.parametrize("options", OPTION_CLASSES, ids=lambda c: c.__name__)
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_a_refused_value_names_its_option_and_its_rule(options, data):
    option = data.draw(st.sampled_from(sorted(REFUSED[options])))
    value = data.draw(REFUSED[options][option])
    with pytest.raises(ValueError) as error:
        options(**{option: value})
    message = str(error.value)
    entry = FLAT_NAMES.get(option) if options is GRPOConfig else None
    alias = f" ({option})" if entry is not None and entry.path[-1] != option and not entry.switch else ""
    assert message.startswith(f"{named(options, option)}={value!r}{alias}: must "), message
    assert "\n" not in message


# Values each option accepts (beside the default), again from the docstrings.
ACCEPTED = {
    "top_p": st.floats(min_value=0, max_value=1, exclude_min=True),
    "temperature": st.floats(min_value=0, exclude_min=True, allow_infinity=False),
    "max_grad_norm": st.floats(min_value=0, exclude_min=True, allow_infinity=False) | st.none(),
    "top_k": st.integers(min_value=0),
    "min_p": st.floats(min_value=0, max_value=1),
    "repetition_penalty": st.floats(min_value=0, exclude_min=True, allow_infinity=False),
    "epsilon": st.floats(min_value=0, exclude_min=True, allow_infinity=False) | st.integers(min_value=1),
    "beta": st.floats(min_value=0, allow_infinity=False),
    "learning_rate": st.floats(min_value=0, exclude_min=True, allow_infinity=False),
    "adam_beta2": st.floats(min_value=0, max_value=1, exclude_max=True),
    "adam_epsilon": st.floats(min_value=0, allow_infinity=False),
    "entropy_coef": st.floats(allow_nan=False, allow_infinity=False),
    "num_generations": st.integers(min_value=2),
}


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_values_in_range_are_accepted(data):
    option = data.draw(st.sampled_from(sorted(ACCEPTED)))
    value = data.draw(ACCEPTED[option])
    assert getattr(GRPOConfig(**{option: value}), option) == value


def test_options_that_depend_on_each_other():
    with pytest.raises(
        ValueError, match=r"GRPOConfig.sampling.min_completion_length=9: must be <= max_completion_length"
    ):
        GRPOConfig(min_completion_length=9, max_completion_length=8)
    with pytest.raises(ValueError, match=r"GRPOConfig.loss.delta=1.2: must be > 1 \+ epsilon_high"):
        GRPOConfig(delta=1.2)
    with pytest.raises(
        ValueError, match=r"GRPOConfig.kl.in_reward=True \(use_kl_in_reward\): needs beta > 0"
    ):
        GRPOConfig(use_kl_in_reward=True)
    assert GRPOConfig(min_completion_length=8, max_completion_length=8, delta=1.5).delta == 1.5
    with pytest.raises(
        ValueError, match=r"GRPOConfig.reference_sync \(sync_ref_model: true\): needs beta > 0"
    ):
        GRPOConfig(sync_ref_model=True)
    with pytest.raises(
        ValueError, match="max_tokens_per_micro_batch=512: set it or micro_batch_size, not both"
    ):
        GRPOConfig(max_tokens_per_micro_batch=512, micro_batch_size=4)
    with pytest.raises(
        ValueError, match="max_tokens_per_micro_batch=100: must be >= max_completion_length=256"
    ):
        GRPOConfig(max_tokens_per_micro_batch=100)
    assert GRPOConfig(sync_ref_model=True, beta=0.04, max_tokens_per_micro_batch=256).sync_ref_model


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("--model.grpo.top_p=0", "GRPOConfig.sampling.top_p=0.0: must be > 0 and <= 1"),
        ("--model.grpo.top_p=1.5", "GRPOConfig.sampling.top_p=1.5: must be > 0 and <= 1"),
        ("--model.grpo.max_grad_norm=-1", "GRPOConfig.optimizer.max_grad_norm=-1.0: must be > 0 or None"),
        ("--model.grpo.temperature=0", "GRPOConfig.sampling.temperature=0.0: must be > 0"),
        ("--model.grpo.top_k=-2", "GRPOConfig.sampling.top_k=-2: must be >= 0"),
        (
            "--model.grpo.learning_rate=-1e-5",
            "GRPOConfig.optimizer.learning_rate=-1e-05: must be > 0 (at 0 no weight",
        ),
        ("--model.lora.r=0", "LoraOptions.r=0: must be >= 1"),
        ("--model.lora.dropout=1", "LoraOptions.dropout=1.0: must be >= 0 and < 1"),
        (
            "--model.model_options.dtype=fp16",
            "model.model_options.dtype='fp16': must be one of float32, bfloat16",
        ),
    ],
)
@pytest.mark.usefixtures("no_weights")
def test_the_cli_refuses_a_bad_option_before_weights_load(tiny_model_dir, tmp_path, capsys, option, message):
    err = cli_error(fit_args(tiny_model_dir, str(tmp_path), 1, option), capsys)
    assert f"error: {message}" in err
    assert "target_modules" not in err  # lora.r=0 used to be blamed on the target modules


# ------------------------------------------------------------------------------------------ resume
@pytest.fixture(scope="module")
def one_step_checkpoint(tiny_model_dir, tmp_path_factory) -> tuple[str, str]:
    """A checkpoint after one step trained with `fit_args` (num_generations 2, greedy evaluation)."""
    root = str(tmp_path_factory.mktemp("trained"))
    build_cli(fit_args(tiny_model_dir, root, 1))
    folder = os.path.join(root, "lightning_logs", "version_0", "checkpoints")
    (name,) = os.listdir(folder)
    return root, os.path.join(folder, name)


@pytest.mark.usefixtures("no_weights")
def test_resume_refuses_an_option_that_differs_from_the_checkpoint(
    tiny_model_dir, one_step_checkpoint, capsys
):
    root, ckpt = one_step_checkpoint
    args = fit_args(tiny_model_dir, root, 2, f"--ckpt_path={ckpt}", "--model.grpo.num_generations=6")
    err = cli_error([*args, "--model.grpo.top_p=0.9"], capsys)
    assert "error: --ckpt_path" in err
    assert "model.grpo.sampling.num_generations: checkpoint 2, this run 6" in err
    assert "model.grpo.sampling.top_p: checkpoint 1.0, this run 0.9" in err
    assert "options win on resume" in err


def test_resume_takes_the_options_left_at_their_defaults_from_the_checkpoint(
    tiny_model_dir, one_step_checkpoint
):
    root, ckpt = one_step_checkpoint
    # Without the grpo options: num_generations is at its default (8) here, 2 in the checkpoint.
    args = [a for a in fit_args(tiny_model_dir, root, 1, f"--ckpt_path={ckpt}") if "--model.grpo." not in a]
    cli = build_cli(args)  # max_steps 1: already reached, nothing more is trained
    assert cli.model.grpo.sampling.num_generations == 2
    assert cli.model.grpo.sampling.max_completion_length == 6
    assert cli.trainer.global_step == 1


def test_validate_applies_an_evaluation_option_over_the_checkpoint_and_says_so(
    tiny_model_dir, one_step_checkpoint
):
    root, ckpt = one_step_checkpoint
    args = ["validate", *fit_args(tiny_model_dir, root, 1)[1:], f"--ckpt_path={ckpt}"]
    args = [a.replace("--trainer.limit_val_batches=0", "--trainer.limit_val_batches=1") for a in args]
    with pytest.warns(
        UserWarning, match=r"model.num_generations_eval=2 from this run's config wins over .* 1"
    ):
        cli = build_cli([*args, "--model.num_generations_eval=2"])
    assert cli.model.validation.num_generations == 2
    assert cli.model.val_accuracy.k == 2


@pytest.mark.usefixtures("no_weights")
def test_validate_refuses_lora_options_the_checkpoint_was_not_trained_with(
    tiny_model_dir, one_step_checkpoint, capsys
):
    root, ckpt = one_step_checkpoint
    args = ["validate", *fit_args(tiny_model_dir, root, 1)[1:], f"--ckpt_path={ckpt}", "--model.lora.r=4"]
    err = cli_error(args, capsys)
    assert "model.lora: checkpoint None, this run {'r': 4" in err


def test_a_module_resumed_from_python_says_its_options_win(tiny_model_dir, one_step_checkpoint):
    _, ckpt = one_step_checkpoint
    grpo = GRPOConfig(num_generations=4, max_completion_length=6, preflight=False, top_p=0.9)
    module = GRPOModule(tiny_model_dir, reward_funcs=[digit_reward], grpo=grpo)
    data = GSM8KDataModule(source="arithmetic", system_prompt=None, batch_size=2, val_size=2)
    with pytest.warns(UserWarning, match="other options, this module's apply") as caught:
        quiet_trainer(limit_val_batches=1).validate(module, datamodule=data, ckpt_path=ckpt)
    message = next(str(w.message) for w in caught if "this module's apply" in str(w.message))
    assert "grpo.sampling.num_generations: checkpoint 2, this module 4" in message
    assert "grpo.sampling.top_p: checkpoint 1.0, this module 0.9" in message
    assert "max_completion_length" not in message  # the same on both sides


# ------------------------------------------------------------------------------------------ empty data
def test_validate_with_an_empty_validation_split_fails(tiny_model_dir, tmp_path, capsys):
    # Validation rows exist, but no batch is taken of them (an empty split is refused by the data module
    # before this: tests/test_bad_input_options.py::test_validate_with_no_validation_rows_is_an_error).
    args = ["validate", *fit_args(tiny_model_dir, str(tmp_path), 1)[1:]]
    err = cli_error(args, capsys)
    assert "error: validate: the validation data gives no batch" in err


def test_fit_without_a_training_batch_fails(tiny_model_dir, tmp_path):
    module = GRPOModule(
        tiny_model_dir, grpo=GRPOConfig(num_generations=2, max_completion_length=2, preflight=False)
    )
    trainer = GRPOTrainer(accelerator="cpu", logger=False, enable_progress_bar=False, max_steps=1)
    empty = torch.utils.data.DataLoader([], batch_size=1)
    with pytest.raises(ValueError, match="fit: the training data gives no batch"):
        trainer.fit(module, train_dataloaders=empty)


def test_fit_with_no_training_rows_exits_2(tiny_model_dir, tmp_path, capsys):
    err = cli_error(fit_args(tiny_model_dir, str(tmp_path), 1, "--data.train_size=0"), capsys)
    assert "train" in err.splitlines()[0]


def test_k1_in_the_loss_is_refused_when_the_config_is_built():
    with pytest.raises(ValueError, match=r"kl.estimator='k1' \(kl_estimator\).*regularises nothing"):
        GRPOConfig(beta=0.04, kl_estimator="k1")
    GRPOConfig(beta=0.04, kl_estimator="k1", use_kl_in_reward=True)  # k1 belongs in the reward
    GRPOConfig(beta=0.0, kl_estimator="k1")  # no KL term at all


def field_docstrings(cls: type) -> dict[str, str]:
    """`{field: docstring}` of the string literals right under each annotated field of `cls`'s source."""
    import ast
    import inspect
    import textwrap

    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    return {
        node.target.id: " ".join(after.value.value.split())
        for node, after in zip(body, body[1:], strict=False)
        if isinstance(node, ast.AnnAssign)
        and isinstance(after, ast.Expr)
        and isinstance(after.value, ast.Constant)
    }


def test_every_option_is_documented_where_it_is_declared_and_shown_by_help(tiny_model_dir, capsys):
    import dataclasses

    from grpo_lightning.cli.commands import main, shows_option_docs

    docs = field_docstrings(GRPOConfig)
    assert set(docs) == {f.name for f in dataclasses.fields(GRPOConfig)}
    with pytest.raises(SystemExit):
        main(["fit", f"--model.policy={tiny_model_dir}", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    for name, doc in docs.items():
        assert doc[:40] in shown, name
    # Only the commands that show the docs read them (4 of a command's 5 seconds).
    assert shows_option_docs(["fit", "-h"]) and not shows_option_docs(["fit", "--print_config"])
    assert shows_option_docs(["--trainer.callbacks.help", "X"])
    assert not shows_option_docs(["fit", "--model.policy=help_me"]) and not shows_option_docs(None)


# ------------------------------------------------------------------------------------------ one declaration
PACKAGE = Path(__file__).resolve().parents[1] / "grpo_lightning"
# String options that name something (a reward function, a file, a data set's column) rather than choose.
# metric: dynamic_sampling.metric
FREE_TEXT = {
    "metric",
    "gguf_file",
    "attn_implementation",
    "revision",
    "chat_template",
    "host",
    "trainer_host",
}
FREE_TEXT |= {"weights_dir"}  # the server engine's: a host name, a folder
DATA_FREE_TEXT = {"config_name", "system_prompt", "question_field", "answer_field"}


def option_tables(source: str) -> list[tuple[int, set[str]]]:
    """(line, the GRPOConfig options it names) of every module-level table (a dict display, bare or in a
    call) in the Python `source` that restates three or more options' own rules: a call (`Rule(...)`), a
    type, or a tuple of constants (a choice set) for each. Tables of rules between options (whose entries
    hold a test of the other options, a lambda) are what rule tables are for."""
    options = set(FLAT_NAMES) | {f.name for f in fields(GRPOConfig)}

    def restates(value: ast.expr) -> bool:
        if isinstance(value, ast.Tuple | ast.List):
            return all(isinstance(v, ast.Constant) for v in value.elts)
        return isinstance(value, ast.Call | ast.Name)

    tables = []
    for statement in ast.parse(source).body:
        if isinstance(statement, ast.Assign | ast.AnnAssign) and statement.value is not None:
            for node in ast.walk(statement.value):
                if isinstance(node, ast.Dict):
                    keys = {
                        k.value
                        for k, v in zip(node.keys, node.values, strict=True)
                        if isinstance(k, ast.Constant) and k.value in options and restates(v)
                    }
                    if len(keys) >= 3:
                        tables.append((statement.lineno, keys))
    return tables


def test_each_option_is_declared_in_one_place():
    """An option's type, choices and range are its annotation: no table beside the config restates options
    (the check can fail: it finds a table written like the old rule table), and every field's checks come
    from its annotation alone."""
    old_style = 'RULES = {"top_p": Rule(float), "top_k": Rule(int), "temperature": Rule(float)}\n'
    assert option_tables(old_style) == [(1, {"top_p", "top_k", "temperature"})]
    across = (
        'INERT = {"top_p": ("a", lambda c: c.x), "top_k": ("b", lambda c: c.y), "beta": ("c", lambda c: 1)}'
    )
    assert option_tables(across) == []  # a rule between options: allowed
    for path in sorted(PACKAGE.rglob("*.py")):
        tables = option_tables(path.read_text(encoding="utf-8"))
        assert tables == [], f"{path} restates GRPOConfig's options in a table"
    for name, entry in FLAT_NAMES.items():  # the default passes the rule that its annotation declares
        if not entry.switch:
            rule = declared_rule(*leaf(GRPOConfig, name))
            assert rule.problem(default_at(GRPOConfig, entry.path)) is None, name


def help_of(option_prefix: str, shown: str, name: str) -> str:
    """The help entry of `--<option_prefix><name>` in `shown` (whitespace made single spaces)."""
    start = shown.index(f" --{option_prefix}{name} ")
    end = shown.find(" --", start + 3)
    return shown[start:end]


def test_help_shows_the_choices_of_every_string_option_and_every_range(capsys):
    """Every string option of the option classes and the data module either lists its choices in `--help`
    or names something (FREE_TEXT); every range of the option classes is printed with its type. (The data
    module's ranges are checked, not printed: its `source` is annotated with types imported for type
    checkers only, and jsonargparse then reads the whole signature without `Annotated`.)"""
    with pytest.raises(SystemExit):
        build_cli(["fit", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit):
        build_cli(["fit", "--data.help", "GSM8KDataModule"])
    data_shown = " ".join(capsys.readouterr().out.split())
    # `source` (a string or a `datasets` object) and `val_sets` (objects) are checked by the data module.
    data_options = [
        n for n in inspect.signature(GSM8KDataModule).parameters if n not in ("source", "val_sets")
    ]
    owners = [
        *[
            (
                section,
                f"model.grpo.{place}.",
                shown,
                FREE_TEXT,
                [f.name for f in fields(section) if f.name not in ("vllm", "vllm_server")],
                False,
            )
            for place, section in SECTIONS.items()
            if place.split(".")[0] not in SWITCHED  # an optional section's options: shown once it is on
        ],
        (
            ModelOptions,
            "model.model_options.",
            shown,
            FREE_TEXT,
            [f.name for f in fields(ModelOptions)],
            True,
        ),
        (GSM8KDataModule.__init__, "data.", data_shown, DATA_FREE_TEXT, data_options, False),
    ]
    choices_seen = 0
    for owner, prefix, text, free_text, names, ranges_shown in owners:
        for name in names:
            rule, entry = declared_rule(owner, name), help_of(prefix, text, name)
            if rule.choices:
                literal = f"Literal[{', '.join(map(repr, rule.choices))}]"  # an Alias shows the Literal
                assert f"{{{','.join(rule.choices)}}}" in entry or literal in entry, name
                choices_seen += 1
            elif rule.kinds == (str,):
                assert name in free_text, f"{name}: a string option without choices"
            if rule.bounds and ranges_shown:
                assert ", ".join(b.strip() for b in rule.bounds.split(",")) + "]" in entry, name
    assert choices_seen >= 8  # loss_type, scale_rewards, ..., dtype, val_split


@pytest.mark.parametrize(
    ("flat", "trls", "path", "ours"),
    [
        ("scale_rewards", False, ("advantages", "scale_rewards"), "none"),
        ("scale_rewards", True, ("advantages", "scale_rewards"), "group"),
        ("lr_scheduler_type", "constant_with_warmup", ("optimizer", "lr_scheduler_type"), "constant"),
        ("lr_scheduler_type", "cosine_with_min_lr", ("optimizer", "lr_scheduler_type"), "cosine"),
        ("top_k", -1, ("sampling", "top_k"), 0),
        ("min_p", None, ("sampling", "min_p"), 0.0),
        ("max_grad_norm", 0, ("optimizer", "max_grad_norm"), None),
    ],
)
def test_trls_spellings_are_taken_by_trls_names_everywhere(tmp_path, flat, trls, path, ours):
    """In Python, in a config file and on the command line, TRL's name takes TRL's value; the section's key
    refuses it with a line saying what it is here."""
    section, option = path
    assert getattr(getattr(GRPOConfig(**{flat: trls}), section), option) == ours
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"model": {"grpo": {flat: trls}}}))
    (_, text) = sectioned_argv(["--config", str(config)])
    assert yaml.safe_load(text)["model"]["grpo"][section][option] == ours
    typed = yaml.safe_dump(trls).split("\n")[0]  # as typed on the command line: false, 0, cosine_with_min_lr
    argv = sectioned_argv([f"--model.grpo.{flat}", typed])
    assert argv == [f"--model.grpo.{section}.{option}={'null' if ours is None else ours}"]
    with pytest.raises(ValueError) as refused:
        GRPOConfig(**{section: {option: trls}})
    assert str(refused.value).endswith(f"; TRL's {trls!r} is {ours!r} here, which its flat name also takes")


def test_a_config_files_sections_inside_sections_reach_the_module(tiny_model_dir, tmp_path):
    """`grpo.engine.vllm_server` and `grpo.engine.vllm` given in a config file: their values, not their
    defaults, in the module's options."""
    config = tmp_path / "run.yaml"
    engine = {"vllm_mode": "server", "vllm_server": {"base_url": "http://127.0.0.1:9", "timeout": 60}}
    engine["vllm"] = {"gpu_memory_utilization": 0.5}
    grpo = {"engine": engine}
    model = {"policy": tiny_model_dir, "reward_funcs": ["tests.helpers.digit_reward"], "grpo": grpo}
    config.write_text(yaml.safe_dump({"model": model}))
    with pytest.warns(UserWarning):  # engine.vllm is inert with the server engine
        cli = build_cli(["--config", str(config), "--trainer.accelerator=cpu"], run=False)
    options = cli.model.grpo.engine
    assert (options.vllm_server.base_url, options.vllm_server.timeout) == ("http://127.0.0.1:9", 60)
    assert options.vllm.gpu_memory_utilization == 0.5
