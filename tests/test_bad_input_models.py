"""Broken or foreign files end in one line naming them: checkpoints (never advising unsafe loading),
safetensors weights, model folders that do not exist or lack their tokenizer, another model's tokenizer or
checkpoint, non-finite weights. A model whose attention is not full attention (a sliding window, however
its config declares it) keeps the padded, unshared path, with one warning."""

import io
import json
import math
import os
import shutil
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma2Config,
    Gemma3Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Qwen2Config,
    Starcoder2Config,
)

from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.generation.engines import EagerEngine
from grpo_lightning.core.generation.logprobs import completion_logprobs
from grpo_lightning.core.generation.model_abilities import not_full_attention
from grpo_lightning.core.generation.packing import packed_completion_logprobs
from grpo_lightning.core.types import Rollout
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


def saved(checkpoint: dict) -> bytes:
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    return buffer.getvalue()


FOREIGN = "lacks 'pytorch-lightning_version' and any weights under 'policy.' in its state_dict: it is not a "


@pytest.mark.parametrize(
    ("subcommand", "content", "why"),
    [
        pytest.param("fit", lambda good: saved({"state_dict": {}}), FOREIGN, id="fit-foreign"),
        pytest.param("validate", lambda good: saved({"state_dict": {}}), FOREIGN, id="validate-foreign"),
        pytest.param("export", lambda good: saved({"state_dict": {}}), FOREIGN, id="export-foreign"),
        # What ModelCheckpoint(save_weights_only=True) writes: the weights load, but no run resumes from it.
        pytest.param(
            "fit",
            lambda good: good,
            "lacks 'optimizer_states' and 'lr_schedulers': it holds the weights alone (ModelCheckpoint's "
            "save_weights_only) and cannot resume a run; to train on from them, export them",
            id="fit-weights-alone",
        ),
    ],
)
def test_a_foreign_checkpoint_is_one_line_naming_what_it_lacks(
    tiny_model_dir, good_checkpoint, tmp_path, capsys, no_weights, subcommand, content, why
):
    path = tmp_path / "foreign.ckpt"
    path.write_bytes(content(good_checkpoint))
    extra = [f"--out={tmp_path / 'export'}"] if subcommand == "export" else []
    args = [subcommand, *fit_args(tiny_model_dir, str(tmp_path), 1)[1:], f"--ckpt_path={path}", *extra]
    line = one_error_line(cli_error(args, capsys))  # no KeyError traceback from Lightning
    assert line.startswith(f"error: checkpoint {str(path)!r} {why}")
    assert not os.path.exists(tmp_path / "export")


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


# ------------------------------------------------------------------------------- attention that is not full
TINY_SIZES = {
    "vocab_size": 50,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def qwen2_with_a_kept_window() -> Qwen2Config:
    """Qwen2 with `use_sliding_window: false` and a window value, as older transformers keep it (Qwen2.5's
    config.json: `"use_sliding_window": false, "sliding_window": 32768`)."""
    config = Qwen2Config(**TINY_SIZES)
    config.sliding_window = 4
    return config


# Tiny configs of the families transformers ships, with windows of 4 tokens (rows of 12 exceed them).
TINY_CONFIGS = {
    "Llama": lambda: LlamaConfig(**TINY_SIZES),
    "Mistral": lambda: MistralConfig(sliding_window=4, **TINY_SIZES),
    "Mistral, eager attention": lambda: MistralConfig(
        sliding_window=4, attn_implementation="eager", **TINY_SIZES
    ),
    "Mistral without a window": lambda: MistralConfig(sliding_window=None, **TINY_SIZES),
    "Phi-3": lambda: Phi3Config(sliding_window=4, **TINY_SIZES),
    "Phi-3 without a window": lambda: Phi3Config(**TINY_SIZES),
    "Starcoder2": lambda: Starcoder2Config(sliding_window=4, **TINY_SIZES),
    "Qwen2": lambda: Qwen2Config(**TINY_SIZES),
    "Qwen2, a window but use_sliding_window false": qwen2_with_a_kept_window,
    "Qwen2, use_sliding_window, every layer below max_window_layers": lambda: Qwen2Config(
        use_sliding_window=True, sliding_window=4, **TINY_SIZES
    ),
    "Qwen2, a window on its second layer": lambda: Qwen2Config(
        use_sliding_window=True, sliding_window=4, max_window_layers=1, **TINY_SIZES
    ),
    "Gemma2": lambda: Gemma2Config(sliding_window=4, head_dim=8, **TINY_SIZES),
    "Gemma3": lambda: Gemma3TextConfig(sliding_window=4, head_dim=8, **TINY_SIZES),
}


@pytest.mark.parametrize("make_config", TINY_CONFIGS.values(), ids=TINY_CONFIGS)
def test_the_attention_check_says_what_the_model_computes(make_config):
    """The check passes a model exactly when its logits on 12 tokens are those of full causal attention (a
    4-D causal mask, which replaces any window: what packed rows give it)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_config()).eval()
    ids = torch.randint(3, 50, (1, 12), generator=torch.Generator().manual_seed(0))
    causal = torch.ones(12, 12, dtype=torch.bool).tril()[None, None]  # [1, 1, 12, 12]
    with torch.no_grad():
        gap = (model(ids).logits - model(ids, attention_mask=causal).logits).abs().max()
    reason = not_full_attention(model.config)
    assert (reason is None) == (gap < 1e-6), (reason, float(gap))


BOTH_KINDS = "layer_types ['full_attention', 'sliding_attention']"


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (LlamaConfig(), None),
        (MistralConfig(), "MistralConfig.sliding_window=4096: every layer attends to its last 4096 tokens"),
        (Phi3Config(sliding_window=2047), "Phi3Config.sliding_window=2047"),  # Phi-3-mini's
        (Phi3Config(), None),
        (Qwen2Config(), None),
        (Qwen2Config(use_sliding_window=True, max_window_layers=21), BOTH_KINDS),
        (Gemma2Config(), BOTH_KINDS),
        (Gemma3Config(), BOTH_KINDS),  # multimodal: its text config's
    ],
    ids=["Llama", "Mistral", "Phi-3-mini", "Phi-3", "Qwen2", "Qwen2 with a window", "Gemma2", "Gemma3"],
)
def test_the_attention_check_on_the_shipped_configs(config, expected):
    reason = not_full_attention(config)
    assert reason is None if expected is None else expected in reason


def test_a_sliding_window_model_is_scored_on_padded_rows_with_one_warning(tiny_model_dir):
    """A tiny Mistral whose window (4 tokens) is shorter than its rows (10 + 8): the module scores padded
    rows, with one warning naming every option that needs full attention; packed rows would have scored it
    otherwise (the check is what keeps them apart)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    sizes = TINY_SIZES | {"vocab_size": len(tokenizer)}
    model = MistralForCausalLM(MistralConfig(**{**sizes, "sliding_window": 4})).eval()
    module = GRPOModule(
        model, tokenizer, grpo=GRPOConfig(num_generations=2, generation_backend="static", preflight=False)
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        decisions = module.rollouts.packs_sequences, module.rollouts.shares_prompt
        engine = module.rollouts.build_engine()
    assert decisions == (False, False) and isinstance(engine, EagerEngine)
    assert [str(w.message) for w in caught] == [
        "grpo.scoring.share_prompt, grpo.scoring.packed_sequences, grpo.engine.backend='static': its "
        "attention layers are not all full attention (MistralConfig.sliding_window=4: every layer attends to "
        "its last 4 tokens only); every prompt is encoded G times; the passes run padded rows; rollouts use "
        "eager decoding"
    ]

    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(3, len(tokenizer), (4, 10), generator=g)  # [B, P]
    prompt_mask = torch.ones(4, 10, dtype=torch.long)
    prompt_mask[2:, :3] = 0  # two prompts of 7 tokens, left-padded
    lengths = torch.tensor([8, 5, 8, 3])
    completion_mask = (torch.arange(8)[None] < lengths[:, None]).long()  # [B, T]
    completion_ids = torch.randint(3, len(tokenizer), (4, 8), generator=g) * completion_mask
    rollout = Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, lengths == 8)
    scored = completion_mask.bool()
    with torch.no_grad():
        got = module.rollouts.scorer(model, rollout, slice(None))[0]
        padded = completion_logprobs(model, rollout.input_ids, rollout.attention_mask, 8)[0]
        packed = packed_completion_logprobs(model, rollout, slice(None))[0]
    torch.testing.assert_close(got[scored], padded[scored], rtol=0, atol=1e-6)
    assert (packed - padded)[scored].abs().max() > 1e-2  # the window matters: packing would score it wrong
