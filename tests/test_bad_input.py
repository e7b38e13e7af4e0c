"""Bad input ends in one clear message naming the option, file, row or function, before weights load where
it can, and `cli.py` prints it without a traceback (exit status 2)."""

import io
import json
import math
import os
import re
import shutil

import lightning as L
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grpo_lightning.audit import RewardAuditCallback
from grpo_lightning.cli import main
from grpo_lightning.config import GRPOConfig
from grpo_lightning.data import GSM8KDataModule
from grpo_lightning.export import export_policy, read_checkpoint
from grpo_lightning.module import GRPOModule
from grpo_lightning.rewards import completion_text
from grpo_lightning.scoring import RewardInputs, call_reward, score_completions
from tests.conftest import quiet_trainer
from tests.test_interrupt import fit_args

ROW = {"question": "Tom has 2 apples and gets 3 more. How many now?", "answer": "2 + 3 = 5\n#### 5"}


@pytest.fixture
def no_weights(monkeypatch):
    """The errors under test must come before the policy's weights load: loading them fails the test."""

    def load_model(*args, **kwargs):
        raise AssertionError("the policy's weights loaded before the error")

    monkeypatch.setattr("grpo_lightning.module.load_model", load_model)


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


def digit_reward(completions, **kwargs) -> list[float]:
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
        trainer = train(tiny_model_dir, tmp_path, [digit_reward, none_reward])
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
        trainer = train(tiny_model_dir, tmp_path, [digit_reward], min_completion_length=4)
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
        ("--data.val_size=-1", "data.val_size=-1: must be an integer >= 0"),
        ("--data.train_size=0", "data.train_size=0: must be an integer >= 1"),
        ("--data.batch_size=0", "data.batch_size=0: must be an integer >= 1"),
        ("--data.val_batch_size=-3", "data.val_batch_size=-3: must be an integer >= 1"),
        ("--data.arithmetic_size=0", "data.arithmetic_size=0: must be an integer >= 1"),
        ("--data.num_workers=-1", "data.num_workers=-1: must be an integer >= 0"),
        ("--data.val_split=train", "data.val_split='train': must be 'holdout' or 'test'"),
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
        assert str(err).startswith(f"{bad}: must be an integer >= ")
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
        data = ["--data=grpo_lightning.data.PromptDataModule"]
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
