"""Broken or foreign files end in one line naming them: checkpoints (never advising unsafe loading),
safetensors weights, model folders that do not exist or lack their tokenizer, another model's tokenizer or
checkpoint, non-finite weights."""

import io
import json
import math
import os
import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from grpo_lightning.io.checkpoints import read_checkpoint
from grpo_lightning.io.export import export_policy
from grpo_lightning.io.models import check_loaded_model
from grpo_lightning.training.module import GRPOModule
from tests.helpers import cli_error, copy_model, one_error_line
from tests.test_interrupt import fit_args


# ------------------------------------------------------------------------------------------ broken files
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
        pytest.param("fit", lambda good: with_unsafe_global(), UNSAFE, id="fit-pickle"),
        pytest.param("fit", lambda good: tensor_file(), NOT_LIGHTNING, id="fit-tensor"),
        pytest.param("validate", lambda good: good[:-1], DAMAGED, id="validate-cut"),
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
