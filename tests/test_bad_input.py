"""Bad input ends in one clear message naming the option, file, row or function, before weights load where
it can, and `cli.py` prints it without a traceback (exit status 2)."""

import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from fractions import Fraction

import lightning as L
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from grpo_lightning.cli import build_cli, main
from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.metrics import GSM8KAccuracy
from grpo_lightning.core.rewards.scoring import (
    FLOAT32_MAX,
    RewardInputs,
    call_reward,
    check_reward_weights,
    score_completions,
)
from grpo_lightning.core.rewards.verifiable import completion_text, normalize_number, reference_answer
from grpo_lightning.io.export import ExportBestCallback, export_policy, read_checkpoint
from grpo_lightning.io.models import check_loaded_model
from grpo_lightning.io.rows import CHAT_ROLES, check_prompt, check_row, read_records
from grpo_lightning.training.audit_callback import RewardAuditCallback
from grpo_lightning.training.data import GSM8KDataModule, PromptDataModule
from grpo_lightning.training.module import GRPOModule
from tests.helpers import quiet_trainer
from tests.test_interrupt import REPO, fit_args

ROW = {"question": "Tom has 2 apples and gets 3 more. How many now?", "answer": "2 + 3 = 5\n#### 5"}


@pytest.fixture
def no_weights(monkeypatch):
    """The errors under test must come before the policy's weights load: loading them fails the test."""

    def load_model(*args, **kwargs):
        raise AssertionError("the policy's weights loaded before the error")

    monkeypatch.setattr("grpo_lightning.training.module.load_model", load_model)


def cli_error(args: list[str], capsys) -> str:
    """Run `cli.py` in-process; it must exit with status 2 and one message, no traceback."""
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


# ------------------------------------------------------------------------------------------ options
@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("--model.grpo.num_generations=1", "GRPOConfig.num_generations=1: must be >= 2"),
        ("--model.grpo.epsilon=0", "GRPOConfig.epsilon=0.0: must be > 0"),
        ("--model.grpo.beta=-0.1", "GRPOConfig.beta=-0.1: must be >= 0"),
        ("--model.grpo.loss_type=ppo", "GRPOConfig.loss_type='ppo': must be one of grpo, bnpo, dapo"),
        ("--model.grpo.max_completion_length=0", "GRPOConfig.max_completion_length=0: must be > 0"),
        ("--model.policy=/no/such/model", "model path '/no/such/model' does not exist"),
    ],
)
def test_bad_option_is_one_line_before_weights_load(
    tiny_model_dir, tmp_path, capsys, no_weights, option, message
):
    err = cli_error(fit_args(tiny_model_dir, str(tmp_path), 1, option), capsys)
    assert f"error: {message}" in err


def test_dr_grpo_without_a_length(tiny_model_dir, tmp_path, capsys, no_weights):
    with pytest.raises(ValueError, match="GRPOConfig.max_completion_length=None: must be > 0"):
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


# ------------------------------------------------------------------------------------------ data
def write_rows(path, rows: list) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([ROW, {"question": "q?"}], "rows.jsonl:2: missing field 'answer' (has ['question'])"),
        ([{"answer": "#### 1"}], "rows.jsonl:1: missing field 'question' (has ['answer'])"),
        ([ROW, ROW, {"question": "q?", "answer": "5"}], "rows.jsonl:3: field 'answer' has no final '#### "),
        ([{"question": "  ", "answer": "#### 1"}], "rows.jsonl:1: field 'question' is empty or not a string"),
        (
            [ROW, {**ROW, "answer": 5}],
            "rows.jsonl:2: field 'answer' is the number 5: the GSM8K preset reads ",
        ),
    ],
)
def test_bad_row_names_file_line_and_field(tiny_model_dir, tmp_path, capsys, no_weights, rows, message):
    source = write_rows(tmp_path / "rows.jsonl", rows)
    err = cli_error(fit_args(tiny_model_dir, str(tmp_path), 1, f"--data.source={source}"), capsys)
    assert f"error: {tmp_path}/{message}" in err


def test_missing_and_non_utf8_data_files(tiny_model_dir, tmp_path, capsys, no_weights):
    missing = tmp_path / "absent.jsonl"
    err = cli_error(fit_args(tiny_model_dir, str(tmp_path), 1, f"--data.source={missing}"), capsys)
    assert f"error: data file '{missing}' does not exist" in err

    latin1 = tmp_path / "latin1.jsonl"
    row = json.dumps({"question": "caf\u00e9?", "answer": "#### 1"}, ensure_ascii=False)
    latin1.write_bytes(row.encode("latin-1"))
    err = cli_error(fit_args(tiny_model_dir, str(tmp_path), 1, f"--data.source={latin1}"), capsys)
    assert f"error: {latin1}: not valid UTF-8 (invalid continuation byte at byte " in err


# ------------------------------------------------------------------------------------------ rewards
def wrong_count_reward(completions, **kwargs) -> list[float]:
    return [0.0] * (len(completions) - 1)


def nan_reward(completions, **kwargs) -> list[float]:
    return [math.nan] + [0.0] * (len(completions) - 1)


def inf_reward(completions, **kwargs) -> list[float]:
    return [0.0] * (len(completions) - 1) + [math.inf]


def none_reward(completions, **kwargs) -> list[None]:
    return [None] * len(completions)


def digit_count_reward(completions, **kwargs) -> list[float]:
    """The number of digit characters of each completion (`helpers.digit_reward` is their share)."""
    return [float(sum(ch.isdigit() for ch in completion_text(c))) for c in completions]


class FailsAtStep:
    """A reward function with a bug that shows on the `step`-th batch it scores."""

    def __init__(self, step: int) -> None:
        self.step, self.calls = step, 0

    def __call__(self, completions, **kwargs) -> list[float]:
        self.calls += 1
        if self.calls == self.step:
            raise ZeroDivisionError("division by zero")
        return [0.0] * len(completions)


@pytest.fixture
def no_audit(monkeypatch):
    """No reward audit before training: these tests are about the training step scoring completions."""
    monkeypatch.setattr(RewardAuditCallback, "on_fit_start", lambda self, trainer, pl_module: None)


def train(model_dir: str, root, reward_funcs: list, steps: int = 1, **grpo) -> L.Trainer:
    grpo = {"num_generations": 2, "max_completion_length": 4, "preflight": False} | grpo
    module = GRPOModule(model_dir, reward_funcs=reward_funcs, grpo=GRPOConfig(**grpo))
    data = GSM8KDataModule(
        source="arithmetic", system_prompt=None, arithmetic_size=20, batch_size=2, val_size=2
    )
    trainer = quiet_trainer(max_steps=steps, limit_val_batches=0, default_root_dir=str(root))
    trainer.fit(module, data)
    return trainer


@pytest.mark.parametrize(
    ("reward", "message"),
    [
        (wrong_count_reward, "reward function 'wrong_count_reward' returned 3 values for 4 completions"),
        (nan_reward, "reward function 'nan_reward' returned nan for completion 0: '"),
        (inf_reward, "reward function 'inf_reward' returned inf for completion 3: '"),
        (none_reward, r"no reward function ['none_reward'] scored completion 0 (all returned None): '"),
    ],
    ids=["wrong-count", "nan", "inf", "all-none"],
)
def test_bad_reward_values_name_the_function(tiny_model_dir, tmp_path, no_audit, reward, message):
    with pytest.raises(RuntimeError) as error:
        train(tiny_model_dir, tmp_path, [reward])
    assert str(error.value).startswith(message)


def test_a_reward_that_is_none_everywhere_beside_a_working_one_only_warns(tiny_model_dir, tmp_path, no_audit):
    with pytest.warns(UserWarning, match="reward function 'none_reward' returned None for every completion"):
        trainer = train(tiny_model_dir, tmp_path, [digit_count_reward, none_reward])
    assert trainer.global_step == 1


def test_a_reward_that_raises_is_named_and_the_completed_steps_are_kept(
    tiny_model_dir, tmp_path, capsys, no_audit
):
    err = cli_error(
        fit_args(
            tiny_model_dir,
            str(tmp_path),
            5,
            "--model.reward_funcs=[{class_path: tests.test_bad_input.FailsAtStep, init_args: {step: 3}}]",
        ),
        capsys,
    )
    assert "error: reward function 'fails_at_step' raised ZeroDivisionError: division by zero; first " in err
    # The two steps before the error are not lost: a checkpoint of step 2 to resume from once it is fixed.
    saved = torch.load(
        tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "interrupted.ckpt", weights_only=True
    )
    assert saved["global_step"] == 2
    assert saved["GSM8KDataModule"] == {"epoch": 0, "batches_done": 2}


# ------------------------------------------------------------------------------------------ generation
def end_early(module: GRPOModule, eos_logit: float) -> None:
    """Give the policy an LM head whose logits are 0 for every token but EOS, which gets `eos_logit`."""
    head = torch.nn.Linear(module.policy.config.hidden_size, module.policy.config.vocab_size)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    head.bias.data[module.tokenizer.eos_token_id] = eos_logit
    module.policy.set_output_embeddings(head)


def test_every_completion_empty_warns(tiny_model_dir, tmp_path):
    module = GRPOModule(tiny_model_dir, grpo=GRPOConfig(num_generations=2, max_completion_length=4))
    module.configure_model()
    end_early(module, eos_logit=100.0)  # the policy ends every completion at once
    rollout, completions = module.sample([[{"role": "user", "content": "2 + 3?"}]], 2)
    assert completions == ["", ""]
    with pytest.warns(UserWarning, match="all 2 completions of this step are empty: the policy ends at once"):
        module._check_rollout(rollout, completions)


def test_completions_that_decode_to_nothing_warn_as_such(tiny_model_dir):
    # The model's vocabulary is larger than the tokenizer's and the policy writes only ids the tokenizer lacks
    # (as gpu_check's 151,936-token model with a 1,024-token tokenizer did): it did not end at once.
    module = GRPOModule(tiny_model_dir, grpo=GRPOConfig(num_generations=2, max_completion_length=4))
    module.configure_model()
    unknown = len(module.tokenizer)
    module.policy.resize_token_embeddings(unknown + 1)
    end_early(module, eos_logit=-100.0)
    module.policy.get_output_embeddings().bias.data[unknown] = 100.0  # always the unknown id
    rollout, completions = module.sample([[{"role": "user", "content": "2 + 3?"}]], 2)
    assert completions == ["", ""] and rollout.completion_mask.sum() == 8
    message = (
        f"all 2 completions of this step are empty: 2 have tokens (8 in all) that decode to nothing "
        f"(whitespace, special tokens, or ids past the tokenizer's {unknown}: the model's vocabulary has "
        f"{unknown + 1})"
    )
    with pytest.warns(UserWarning, match=re.escape(message) + "$"):
        module._check_rollout(rollout, completions)


def test_every_completion_truncated_warns(tiny_model_dir, tmp_path, no_audit):
    # EOS suppressed for all 4 tokens: every completion runs into the limit.
    with pytest.warns(UserWarning, match="all 4 completions of this step reached max_completion_length=4 "):
        trainer = train(tiny_model_dir, tmp_path, [digit_count_reward], min_completion_length=4)
    assert trainer.global_step == 1  # a warning, not a stop
    assert float(trainer.callback_metrics["train/frac_truncated"]) == 1.0


@pytest.mark.parametrize("mode", ["left", "error"])
def test_prompt_over_the_limit_is_cut_from_the_left_or_refused(tiny_model_dir, mode):
    grpo = GRPOConfig(num_generations=2, max_prompt_length=6, truncate_prompts=mode)
    module = GRPOModule(tiny_model_dir, grpo=grpo)
    prompts = [[{"role": "user", "content": "What is 12 + 30 + 7?"}], [{"role": "user", "content": "1?"}]]
    full = GRPOModule(tiny_model_dir, grpo=GRPOConfig(num_generations=2, max_prompt_length=None))
    full_ids, full_mask = full.encode_prompts(prompts)  # [2, P]
    longest = int(full_mask.sum(1).max())
    if mode == "error":
        with pytest.raises(ValueError, match=f"a prompt has {longest} tokens, over max_prompt_length=6"):
            module.encode_prompts(prompts)
        return
    with pytest.warns(UserWarning, match=f"prompt of {longest} tokens cut from the left to max_prompt_len"):
        ids, mask = module.encode_prompts(prompts)
    assert ids.shape == (2, 6)
    torch.testing.assert_close(ids, full_ids[:, -6:])  # the ends, where the generation prompt is, survive


# ------------------------------------------------------------------------------------------ reward types
def tensor_reward(completions, **kwargs):
    return torch.zeros(len(completions))


# Wrong return values, each with what the message says about it. One contract (`scoring._check_values`)
# checks them all, in training, validation, the audit and the pre-flight alike.
WRONG_RETURNS = {
    "strings": (lambda n: ["1.0"] * n, "value 0 is a str: '1.0', for completion 0: "),
    "None": (lambda n: None, "it returned None (return a list: [None] * len(completions) when"),
    "tensor": (
        lambda n: torch.zeros(n),
        "it returned a torch Tensor (return value.tolist()); first completion: ",
    ),
    "ndarray": (
        lambda n: np.zeros(n),
        "it returned a numpy ndarray (return value.tolist()); first completion: ",
    ),
    "generator": (
        lambda n: (0.0 for _ in range(n)),
        "it returned a generator (return a list, e.g. list(...))",
    ),
    "str": (lambda n: "1" * n, "it returned a str: '1111'; first completion: "),
    "dict": (lambda n: {i: 0.0 for i in range(n)}, "it returned a dict: "),
    "tensor items": (
        lambda n: list(torch.zeros(n)),
        "value 0 is a torch Tensor (return value.tolist()), for",
    ),
    "numpy strings": (lambda n: list(np.array(["a"] * n)), "value 0 is a numpy str_ (return value.tolist())"),
    "nested": (lambda n: [[0.0]] * n, "value 0 is a list: '[0.0]', for completion 0: "),
}


@pytest.mark.parametrize("case", list(WRONG_RETURNS))
def test_every_wrong_return_type_names_the_function_and_a_completion(case):
    make, detail = WRONG_RETURNS[case]

    def bad_reward(completions, **kwargs):
        return make(len(completions))

    inputs = RewardInputs(["q"] * 4, ["a", "b", "c", "d"])
    with pytest.raises(RuntimeError) as error:
        score_completions([bad_reward], inputs)
    message = str(error.value)
    assert message.startswith("reward function 'bad_reward' must return a list with one float (or None) per ")
    assert detail in message
    assert "'a'" in message  # the completion it was given


def test_numbers_of_any_kind_are_rewards():
    values = [np.float32(0.5), np.int64(2), True, None]
    scores = call_reward(lambda completions, **kwargs: tuple(values), RewardInputs(["q"] * 4, list("abcd")))
    assert scores == [0.5, 2.0, 1.0, None] and all(type(v) is float for v in scores[:3])


ELEMENTS = st.one_of(
    st.none(),
    st.floats(),
    st.integers(-10, 10),
    st.booleans(),
    st.text(max_size=3),
    st.lists(st.floats(), max_size=1),
)


@given(
    st.one_of(
        st.lists(ELEMENTS, min_size=0, max_size=5),
        st.tuples(ELEMENTS, ELEMENTS, ELEMENTS),
        st.none(),
        st.floats(),
        st.text(max_size=5),
        st.dictionaries(st.integers(0, 3), st.floats(), max_size=3),
    )
)
def test_any_return_value_is_a_reward_or_one_clear_error(returned):
    """Whatever a reward function returns: three valid rewards, or a `RuntimeError` naming it and a
    completion, never a raw `TypeError` from deeper down."""

    def any_reward(completions, **kwargs):
        return returned

    inputs = RewardInputs(["q"] * 3, ["first", "second", "third"])
    try:
        scores = call_reward(any_reward, inputs)
    except RuntimeError as err:
        assert str(err).startswith("reward function 'any_reward' ")
        assert any(repr(c) in str(err) for c in inputs.completions)
        return
    assert isinstance(returned, (list, tuple)) and len(returned) == 3
    for value, got in zip(returned, scores, strict=True):
        assert got == (None if value is None else float(value)) and (got is None or math.isfinite(got))


def test_a_wrong_return_type_ends_the_cli_with_one_line(tiny_model_dir, tmp_path, capsys):
    args = fit_args(
        tiny_model_dir, str(tmp_path), 1, "--model.reward_funcs=[tests.test_bad_input.tensor_reward]"
    )
    err = cli_error(args, capsys)
    assert "error: reward function 'tensor_reward' must return a list with one float (or None) per " in err
    assert "returned a torch Tensor (return value.tolist()); first completion: '" in err


# ------------------------------------------------------------------------------------------ data options
@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("--data.val_size=-1", "data.val_size=-1: must be >= 0"),
        ("--data.train_size=0", "data.train_size=0: must be >= 1"),
        ("--data.batch_size=0", "data.batch_size=0: must be >= 1"),
        ("--data.val_batch_size=-3", "data.val_batch_size=-3: must be >= 1"),
        ("--data.arithmetic_size=0", "data.arithmetic_size=0: must be >= 1"),
        ("--data.num_workers=-1", "data.num_workers=-1: must be >= 0"),
        ("--data.val_split=train", "data.val_split='train': must be one of holdout, test"),
    ],
)
def test_bad_data_option_is_one_line_before_weights_load(
    tiny_model_dir, tmp_path, capsys, no_weights, option, message
):
    err = cli_error(fit_args(tiny_model_dir, str(tmp_path), 1, option), capsys)
    assert f"error: {message}" in err


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


@pytest.mark.parametrize("preset", [True, False], ids=["gsm8k", "trl-format"])
def test_a_column_only_some_rows_carry_is_named_before_weights_load(
    tiny_model_dir, tmp_path, capsys, no_weights, preset
):
    if preset:
        rows = [ROW, ROW, {**ROW, "hint": "add"}]
        data = []
    else:
        row = {"prompt": "2 + 3?", "solution": "5"}
        rows = [row, {"prompt": "1 + 1?"}, row]
        data = ["--data=grpo_lightning.training.data.PromptDataModule"]
    source = write_rows(tmp_path / "rows.jsonl", rows)
    err = cli_error(fit_args(tiny_model_dir, str(tmp_path), 1, *data, f"--data.source={source}"), capsys)
    where = f"{source}:3: has column 'hint'" if preset else f"{source}:2: lacks column 'solution'"
    assert f"error: {where}, unlike the first row ({source}:1, columns [" in err
    assert "every row needs the same columns" in err


# ------------------------------------------------------------------------------------------ broken files
@pytest.fixture(scope="module")
def good_checkpoint(tiny_model_dir) -> bytes:
    """A checkpoint file as Lightning writes it (a torch zip of a dict with the policy's state_dict)."""
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    buffer = io.BytesIO()
    torch.save({"state_dict": {"policy." + k: v for k, v in state.items()}, "global_step": 1}, buffer)
    return buffer.getvalue()


def with_unsafe_global() -> bytes:
    buffer = io.BytesIO()
    torch.save({"state_dict": {}, "hook": os.path.join}, buffer)  # a function: what safe loading refuses
    return buffer.getvalue()


def tensor_file() -> bytes:
    buffer = io.BytesIO()
    torch.save(torch.ones(3), buffer)
    return buffer.getvalue()


def test_the_whole_checkpoint_reads(good_checkpoint, tmp_path):
    path = tmp_path / "good.ckpt"
    path.write_bytes(good_checkpoint)
    assert read_checkpoint(str(path), weights_only=True, mmap=True)["global_step"] == 1


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_broken_checkpoint_is_named_and_unsafe_loading_never_advised(good_checkpoint, tmp_path, data):
    content = data.draw(
        st.integers(0, len(good_checkpoint) - 1).map(lambda n: good_checkpoint[:n])  # cut off anywhere
        | st.binary(max_size=300)
        | st.sampled_from([b"", b'{"state_dict": {}}', with_unsafe_global(), tensor_file()])
    )
    path = tmp_path / "broken.ckpt"
    path.write_bytes(content)
    # Safe loading on any content; unsafe loading (what export used) only on cut checkpoints.
    unsafe = [{"weights_only": False}] if good_checkpoint.startswith(content) else []
    for kwargs in [{"weights_only": True, "mmap": True}, {"weights_only": True}, *unsafe]:
        with pytest.raises(ValueError) as error:
            read_checkpoint(str(path), **kwargs)
        message = str(error.value)
        assert message.startswith(f"checkpoint {str(path)!r} ")
        assert "weights_only" not in message and "\n" not in message


DAMAGED = "truncated, corrupt or not a PyTorch checkpoint"
UNSAFE = "it holds Python objects that safe loading refuses"
NOT_LIGHTNING = "is not a Lightning checkpoint: it has no state_dict"


@pytest.mark.parametrize(
    ("subcommand", "content", "why"),
    [
        pytest.param("fit", lambda good: good[: len(good) // 2], DAMAGED, id="fit-cut-in-half"),
        pytest.param("fit", lambda good: b"", DAMAGED, id="fit-empty"),
        pytest.param("fit", lambda good: b"not a checkpoint\n", DAMAGED, id="fit-text"),
        pytest.param("fit", lambda good: with_unsafe_global(), UNSAFE, id="fit-pickle"),
        pytest.param("fit", lambda good: tensor_file(), NOT_LIGHTNING, id="fit-tensor"),
        pytest.param("validate", lambda good: good[:-1], DAMAGED, id="validate-cut"),
        pytest.param("export", lambda good: good[:-1], DAMAGED, id="export-cut"),
        pytest.param("export", lambda good: with_unsafe_global(), UNSAFE, id="export-pickle"),
    ],
)
def test_a_broken_ckpt_path_is_one_line_before_weights_load(
    tiny_model_dir, good_checkpoint, tmp_path, capsys, no_weights, subcommand, content, why
):
    path = tmp_path / "run.ckpt"
    path.write_bytes(content(good_checkpoint))
    extra = [f"--out={tmp_path / 'export'}"] if subcommand == "export" else []
    args = [subcommand, *fit_args(tiny_model_dir, str(tmp_path), 1)[1:], f"--ckpt_path={path}", *extra]
    err = cli_error(args, capsys)
    assert f"error: checkpoint {str(path)!r} " in err and why in err
    assert "weights_only" not in err


def test_export_policy_names_a_truncated_checkpoint(tiny_model_dir, good_checkpoint, tmp_path):
    module = GRPOModule(tiny_model_dir)
    path = tmp_path / "cut.ckpt"
    path.write_bytes(good_checkpoint[:-100])
    with pytest.raises(ValueError, match=f"checkpoint '{path}' cannot be read: truncated") as error:
        export_policy(module, str(tmp_path / "out"), ckpt_path=str(path))
    assert "weights_only" not in str(error.value)
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("keep", [0.0, 0.999])
def test_a_truncated_model_safetensors_is_named(tiny_model_dir, tmp_path, capsys, keep):
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    weights = model_dir / "model.safetensors"
    content = weights.read_bytes()
    weights.write_bytes(content[: int(len(content) * keep)])
    err = cli_error(fit_args(str(model_dir), str(tmp_path), 1), capsys)
    assert f"error: cannot load the model from '{model_dir}': {weights} is truncated or corrupt" in err


@pytest.mark.parametrize("policy", ["checkpoints/typo", "../typo", "typo/a/b"])
def test_a_relative_model_path_that_does_not_exist_is_no_such_folder(
    tiny_model_dir, tmp_path, capsys, no_weights, monkeypatch, policy
):
    monkeypatch.chdir(tmp_path)
    os.makedirs("checkpoints")  # "checkpoints/typo" is a path here, not a hub id "org/name"
    args = fit_args(tiny_model_dir, str(tmp_path), 1, f"--model.policy={policy}")
    err = cli_error(args, capsys)
    assert f"error: model path '{policy}' does not exist: no such folder (relative to {tmp_path})" in err
    assert "huggingface.co" not in err


# =========================================================================== round 3 (issue 24), by family
# Each family has its check where the thing enters: models and tokenizers as they load (models.py), data
# files as they are read (data.py), the Trainer's own options and option values as the CLI parses them
# (cli.py, trainer_options.py, scoring.py), checkpoints and outputs as they are read and written (export.py,
# resume.py, evaluation.py).


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory) -> str:
    """Another tiny model: a larger vocabulary (600 tokens, the tiny model's 400), hence other shapes."""
    from grpo_lightning.offline.tiny import save_tiny
    from tests.helpers import gsm8k_rows

    texts = [r["question"] + "\n" + r["answer"] for r in gsm8k_rows("train", 2000)]
    return save_tiny(str(tmp_path_factory.mktemp("other")), texts, tokenizer_vocab=600)


def one_error_line(err: str) -> str:
    """The CLI's one `error:` line: the last thing it writes but its debug hint (no usage, no dump after it;
    `cli_error` checked that no traceback came before it)."""
    lines = err.strip().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("error: "))
    assert lines[first + 1 :] in ([], ["(GRPO_DEBUG=1 shows the traceback)"]), lines[first:]
    return lines[first]


def copy_model(tiny_model_dir: str, folder) -> str:
    shutil.copytree(tiny_model_dir, folder)
    return str(folder)


# ------------------------------------------------------------------------------------------ 1. models
class TestModelsCheckedAtLoad:
    def test_a_folder_without_tokenizer_files_is_refused_not_a_one_token_tokenizer(
        self, tiny_model_dir, tmp_path, capsys, no_weights
    ):
        folder = copy_model(tiny_model_dir, tmp_path / "no_vocab")
        os.remove(os.path.join(folder, "tokenizer.json"))
        # What transformers then builds from tokenizer_config.json alone: a tokenizer of the special tokens.
        config_path = os.path.join(folder, "tokenizer_config.json")
        config = json.loads(open(config_path).read()) | {"tokenizer_class": "GPT2Tokenizer"}
        open(config_path, "w").write(json.dumps(config))
        err = cli_error(fit_args(folder, str(tmp_path), 1), capsys)
        assert f"error: the tokenizer from '{folder}' has no vocabulary: 2 tokens, only special ones" in err
        assert "chat template" not in one_error_line(err)

        os.remove(config_path)  # no tokenizer file at all: transformers' own error, on one line
        err = cli_error(fit_args(folder, str(tmp_path), 1), capsys)
        assert one_error_line(err).startswith(
            f"error: cannot load the tokenizer from '{folder}': ValueError: "
        )

    def test_a_tokenizer_of_another_model_is_refused_before_the_first_step(
        self, tiny_model_dir, other_model_dir, tmp_path, capsys
    ):
        err = cli_error(
            fit_args(tiny_model_dir, str(tmp_path), 1, f"--model.tokenizer={other_model_dir}"), capsys
        )
        assert "error: the tokenizer's token ids reach 599, but the input embedding of the model " in err
        assert (
            "has 400 rows (ids 0 to 399): the tokenizer belongs to another model; set model.tokenizer" in err
        )
        assert not os.path.exists(tmp_path / "lightning_logs" / "version_0" / "metrics.csv")  # no step ran

    @pytest.mark.parametrize("poisoned", [["model.norm.weight"], ["lm_head.weight", "model.norm.weight"]])
    def test_non_finite_weights_name_the_first_tensor(self, tiny_model_dir, tmp_path, capsys, poisoned):
        from safetensors.torch import load_file, save_file

        folder = copy_model(tiny_model_dir, tmp_path / "nan")
        weights = load_file(os.path.join(folder, "model.safetensors"))
        for name in poisoned:
            weights[name][0] = math.nan
        save_file(weights, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        first = next(name for name in _state_names(tiny_model_dir) if name in poisoned)
        err = cli_error(fit_args(folder, str(tmp_path), 1), capsys)
        assert (
            f"error: the model '{folder}' has non-finite weights: {first} holds 1 NaN or inf values of "
            in err
        )


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_any_non_finite_weight_is_found_and_the_first_named(tiny_model_dir, data):
    """Whichever weights hold NaN or inf, wherever in them: the first tensor holding one is named, with how
    many it holds; a model with finite weights (as loaded) passes."""
    from transformers import AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    check_loaded_model(model, tokenizer, "tiny")
    state = model.state_dict()
    names = data.draw(st.lists(st.sampled_from(sorted(state)), min_size=1, max_size=3, unique=True))
    counts = {}
    for name in names:
        flat = state[name].view(-1)
        spots = data.draw(st.lists(st.integers(0, flat.numel() - 1), min_size=1, max_size=4, unique=True))
        flat[spots] = torch.tensor(
            [data.draw(st.sampled_from([math.nan, math.inf, -math.inf])) for _ in spots]
        )
        counts[name] = len(spots)
    first = next(name for name in state if name in names)
    with pytest.raises(ValueError) as error:
        check_loaded_model(model, tokenizer, "tiny")
    assert str(error.value).startswith(
        f"the model 'tiny' has non-finite weights: {first} holds {counts[first]} NaN or inf values of "
    )


def _state_names(folder: str) -> list[str]:
    from transformers import AutoModelForCausalLM

    return list(AutoModelForCausalLM.from_pretrained(folder).state_dict())


# ------------------------------------------------------------------------------------------ 2. data files
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=6,
)
GOOD_ROW = {"prompt": "2 + 3?", "answer": "5"}


def read_text(text: str, name: str = "rows.jsonl"):
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, name)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return read_records(path), path


class TestDataFilesAsRead:
    @given(st.sampled_from(["rows.jsonl", "rows.json"]), JSON_VALUES, st.booleans())
    def test_valid_json_of_another_shape_is_named_never_invalid(self, name, document, pretty):
        text = json.dumps(document, indent=2 if pretty else None)
        try:
            records, _ = read_text(text, name)
        except ValueError as err:
            assert "not valid JSON" not in str(err)
            assert "a row must be a JSON object" in str(err)
        else:  # read: every record is a row object
            assert all(isinstance(row, dict) for _, row in records)

    @given(JSON_VALUES.filter(lambda v: not isinstance(v, dict)))
    def test_a_first_line_that_is_not_an_object_says_what_it_holds(self, first):
        text = json.dumps(first) + "\n" + json.dumps(GOOD_ROW) + "\n"
        with pytest.raises(ValueError) as error:
            read_text(text)
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(first))
        assert f"rows.jsonl:1: holds {kind or 'a number'}" in str(error.value)
        assert 'but a row must be a JSON object, {"column": value, ...}' in str(error.value)

    def test_broken_json_is_still_named_where_it_breaks(self):
        for text, line in [('{"a": 1}\n{"a": \n', 2), ('[\n {"a": 1},\n {"a": ]\n', 3)]:
            with pytest.raises(ValueError, match=rf"rows.jsonl:{line}: not valid JSON \("):
                read_text(text)

    @given(st.text(min_size=1, max_size=12))
    def test_chat_roles_outside_system_user_assistant_are_refused_with_the_row(self, role):
        prompt = [{"role": "system", "content": "Be brief."}, {"role": role, "content": "2 + 3?"}]
        if role in CHAT_ROLES:
            check_prompt(prompt, "rows.jsonl:7")
            return
        with pytest.raises(ValueError) as error:
            check_prompt(prompt, "rows.jsonl:7")
        assert str(error.value) == (
            f"rows.jsonl:7: field 'prompt', message 1 has role {role!r}: a chat role is one of system, user, "
            "assistant"
        )

    @given(st.integers(-(10**12), 10**12) | st.floats(allow_nan=False, allow_infinity=False, width=32))
    def test_numeric_reference_answers_are_read_as_the_number(self, number):
        assert Fraction(reference_answer(number)) == Fraction(repr(number))
        metric = GSM8KAccuracy()
        metric.update([f"#### {reference_answer(number)}"], [number])
        assert float(metric.compute()["accuracy"]) == 1.0

    @given(st.text(max_size=10))
    def test_a_final_line_that_is_not_a_number_is_refused_at_the_row(self, tail):
        answer = f"2 + 3 = 5\n#### {tail}"
        row = {"question": "2 + 3?", "answer": answer}
        if normalize_number(tail) is not None:
            check_row(row, "rows.jsonl:3")
            return
        with pytest.raises(ValueError) as error:
            check_row(row, "rows.jsonl:3")
        assert str(error.value).startswith("rows.jsonl:3: field 'answer' ")

    @pytest.mark.parametrize(
        ("rows", "message"),
        [
            (
                [ROW, {**ROW, "answer": "#### four"}],
                "rows.jsonl:2: field 'answer' ends in '#### four', which is not",
            ),
            (
                [ROW, {**ROW, "answer": "#### 5 apples"}],
                "rows.jsonl:2: field 'answer' ends in '#### 5 apples', ",
            ),
            ([[ROW], ROW], "rows.jsonl:1: holds an array [{"),
        ],
    )
    def test_the_cli_names_file_and_line_before_weights_load(
        self, tiny_model_dir, tmp_path, capsys, no_weights, rows, message
    ):
        source = write_rows(tmp_path / "rows.jsonl", rows)
        err = cli_error(fit_args(tiny_model_dir, str(tmp_path), 1, f"--data.source={source}"), capsys)
        assert f"error: {tmp_path}/{message}" in err

    def test_trl_rows_with_numbers_as_answers_are_accepted_and_bad_roles_refused(
        self, tiny_model_dir, tmp_path, capsys, no_weights
    ):
        chat = [{"role": "user", "content": "2 + 3?"}]
        good = write_rows(tmp_path / "good.jsonl", [{"prompt": chat, "answer": n} for n in (5, 2.5, -3)])
        data = PromptDataModule(good, val_size=1)
        data.setup("fit")
        assert sorted(r["answer"] for r in data.train_rows + data.val_rows) == [-3, 2.5, 5]

        bad = [{"prompt": chat, "answer": 5}, {"prompt": [{"role": "usr", "content": "2 + 3?"}], "answer": 5}]
        source = write_rows(tmp_path / "bad.jsonl", bad)
        args = fit_args(
            tiny_model_dir, str(tmp_path), 1, "--data=grpo_lightning.training.data.PromptDataModule"
        )
        err = cli_error([*args, f"--data.source={source}"], capsys)
        assert f"error: {source}:2: field 'prompt', message 0 has role 'usr': a chat role is one of " in err


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
        assert (lightning_way.datamodule.hparams.batch_size, grpo.micro_batch_size, grpo.max_grad_norm) == (
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
                "norm only, with model.grpo.max_grad_norm",
            ),
            (
                ["--trainer.gradient_clip_val=0.5", "--model.grpo.max_grad_norm=2.0"],
                "trainer.gradient_clip_val=0.5 and model.grpo.max_grad_norm=2.0 disagree",
            ),
            (
                ["--trainer.max_steps=abc"],
                "Parser key \"trainer.max_steps\": Expected a <class 'int'>. Got value: abc",
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
        torch.save(saved | {"pytorch-lightning_version": L.__version__}, path)
        extra = [f"--out={tmp_path / 'export'}"] if subcommand == "export" else []
        args = [subcommand, *fit_args(tiny_model_dir, str(tmp_path), 1)[1:], f"--ckpt_path={path}", *extra]
        err = cli_error(args, capsys)
        assert (
            f"error: checkpoint '{path}' does not fit this model: policy.model.embed_tokens.weight has shape "
            "[600, 64] in the checkpoint but [400, 64] here; it was trained from another model" in err
        )
        one_error_line(err)


# ------------------------------------------------------------------------------------------ 4. outputs
class TestOutputsThatOverwrite:
    def test_export_refuses_a_non_empty_folder_and_replaces_it_whole_when_asked(
        self, tiny_model_dir, tmp_path
    ):
        module = GRPOModule(tiny_model_dir)
        clean = export_policy(module, str(tmp_path / "clean"))
        out = tmp_path / "out"
        out.mkdir()
        for stale in ("adapter_config.json", "adapter_model.safetensors", "notes.txt"):
            (out / stale).write_text("{}")  # an earlier LoRA export, and a file of the user's
        with pytest.raises(ValueError, match=f"export folder '{out}' is not empty .*--overwrite true"):
            export_policy(module, str(out))
        assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors", "notes.txt"]

        export_policy(module, str(out), overwrite=True)
        assert sorted(os.listdir(out)) == sorted(os.listdir(clean))  # whole: nothing stale is left
        assert sorted(os.listdir(tmp_path)) == ["clean", "out"]  # no staging folder left beside it
        ids = torch.tensor([[5, 6, 7]])
        logits = [AutoModelForCausalLM.from_pretrained(d)(ids).logits for d in (clean, str(out))]
        assert torch.equal(*logits)

    def test_a_failed_export_leaves_the_folder_as_it_was(self, tiny_model_dir, tmp_path, monkeypatch):
        module = GRPOModule(tiny_model_dir)
        out = export_policy(module, str(tmp_path / "out"))
        before = {name: open(os.path.join(out, name), "rb").read() for name in os.listdir(out)}

        def disk_full(*args, **kwargs):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(module.tokenizer, "save_pretrained", disk_full)
        with pytest.raises(OSError, match="No space left"):
            export_policy(module, out, overwrite=True)
        assert {name: open(os.path.join(out, name), "rb").read() for name in os.listdir(out)} == before
        assert os.listdir(tmp_path) == ["out"]

    def test_export_into_the_policy_folder_is_refused_even_with_overwrite(self, tiny_model_dir, tmp_path):
        folder = copy_model(tiny_model_dir, tmp_path / "policy")
        before = open(os.path.join(folder, "model.safetensors"), "rb").read()
        with pytest.raises(ValueError, match="is the folder the policy was loaded from"):
            export_policy(GRPOModule(folder), folder + "/", overwrite=True)
        assert open(os.path.join(folder, "model.safetensors"), "rb").read() == before

    def test_cli_export_refuses_then_overwrites_and_names_a_model_folder_given_as_checkpoint(
        self, tiny_model_dir, good_checkpoint, tmp_path, capsys
    ):
        ckpt = tmp_path / "run.ckpt"
        ckpt.write_bytes(good_checkpoint)
        out = tmp_path / "export"
        out.mkdir()
        (out / "adapter_config.json").write_text("{}")
        args = ["export", *fit_args(tiny_model_dir, str(tmp_path), 1)[1:], f"--out={out}"]
        err = cli_error([*args, f"--ckpt_path={ckpt}"], capsys)
        assert f"error: export folder '{out}' is not empty (it holds ['adapter_config.json'])" in err
        main([*args, f"--ckpt_path={ckpt}", "--overwrite=true"])
        assert "adapter_config.json" not in os.listdir(out) and "model.safetensors" in os.listdir(out)

        err = cli_error([*args, f"--ckpt_path={out}", "--overwrite=true"], capsys)
        assert (
            f"error: checkpoint '{out}' is a model folder (save_pretrained, as export writes), not a " in err
        )

    def test_validate_results_work_for_trl_format_columns(self, tiny_model_dir, tmp_path):
        rows = [{"prompt": [{"role": "user", "content": f"{n} + 1?"}], "answer": n + 1} for n in range(6)]
        source = write_rows(tmp_path / "rows.jsonl", rows)
        results = tmp_path / "val.jsonl"
        args = fit_args(
            tiny_model_dir, str(tmp_path), 1, "--data=grpo_lightning.training.data.PromptDataModule"
        )
        build_cli(
            [
                "validate",
                *args[1:],
                f"--data.source={source}",
                "--data.val_size=3",
                "--trainer.limit_val_batches=1.0",
                f"--results.path={results}",
            ]
        )
        lines = [json.loads(line) for line in results.read_text().splitlines()]
        assert len(lines) == 3
        for line in lines:
            assert set(line) == {"prompt", "sample", "completion", "extracted", "answer", "correct"}
            assert line["answer"] == reference_answer(int(line["prompt"][0]["content"].split()[0]) + 1)
            assert line["correct"] == (line["extracted"] == line["answer"])

    def test_two_runs_without_a_logger_keep_their_own_checkpoints(self, tiny_model_dir, tmp_path):
        args = [a for a in fit_args(tiny_model_dir, str(tmp_path), 1) if not a.startswith("--trainer.logger")]
        for _ in range(2):
            build_cli([*args, "--trainer.logger=false"])
        folders = sorted(os.listdir(tmp_path / "checkpoints"))
        assert folders == ["version_0", "version_1"]
        for folder in folders:
            files = sorted(os.listdir(tmp_path / "checkpoints" / folder))
            assert files == ["config.yaml", "epoch=0-step=1.ckpt"]

    def test_export_best_callback_refuses_a_non_empty_folder_before_training(self, tmp_path):
        out = tmp_path / "export"
        out.mkdir()
        (out / "model.safetensors").write_text("an earlier run's")
        trainer = quiet_trainer(default_root_dir=str(tmp_path))
        with pytest.raises(ValueError, match=f"export folder '{out}' is not empty"):
            ExportBestCallback(str(out)).setup(trainer, None, "fit")
        ExportBestCallback(str(out), overwrite=True).setup(trainer, None, "fit")  # asked for: accepted
        ExportBestCallback(str(tmp_path / "new")).setup(trainer, None, "fit")


def test_the_cli_entry_point_prints_a_wrong_type_as_its_one_line(tiny_model_dir, tmp_path):
    """The real command, in a process of its own: jsonargparse's usage is not printed, only the error."""
    args = fit_args(tiny_model_dir, str(tmp_path), 1, "--data.batch_size=two")
    done = subprocess.run(
        [sys.executable, "cli.py", *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "error: Parser key \"data.batch_size\": Expected a <class 'int'>. Got value: two"
    ), done.stderr
    assert "usage:" not in done.stderr and "--help" not in done.stderr
