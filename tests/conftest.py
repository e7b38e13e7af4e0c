import io
import signal

import pytest
import torch

from grpo_lightning.offline.tiny import save_tiny
from tests.helpers import gsm8k_rows


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A random 2-layer Llama and a BPE tokenizer trained on GSM8K text, saved with save_pretrained."""
    rows = gsm8k_rows("train", 2000)
    texts = [r["question"] + "\n" + r["answer"] for r in rows]
    return save_tiny(str(tmp_path_factory.mktemp("tiny")), texts, tokenizer_vocab=400)


@pytest.fixture(scope="session")
def other_model_dir(tmp_path_factory) -> str:
    """Another tiny model: a larger vocabulary (600 tokens, the tiny model's 400), hence other shapes."""
    texts = [r["question"] + "\n" + r["answer"] for r in gsm8k_rows("train", 2000)]
    return save_tiny(str(tmp_path_factory.mktemp("other")), texts, tokenizer_vocab=600)


@pytest.fixture(scope="session")
def good_checkpoint(tiny_model_dir) -> bytes:
    """A checkpoint file as Lightning writes it (a torch zip of a dict with the policy's state_dict)."""
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    buffer = io.BytesIO()
    torch.save({"state_dict": {"policy." + k: v for k, v in state.items()}, "global_step": 1}, buffer)
    return buffer.getvalue()


@pytest.fixture
def no_weights(monkeypatch):
    """The errors under test must come before the policy's weights load: loading them fails the test."""

    def load_model(*args, **kwargs):
        raise AssertionError("the policy's weights loaded before the error")

    monkeypatch.setattr("grpo_lightning.training.module.load_model", load_model)


@pytest.fixture
def no_audit(monkeypatch):
    """No reward audit before training: for tests about the training step scoring completions."""
    from grpo_lightning.training.audit_callback import RewardAuditCallback

    monkeypatch.setattr(RewardAuditCallback, "on_fit_start", lambda self, trainer, pl_module: None)


@pytest.fixture(autouse=True)
def default_ctrl_c_handler():
    """Each test starts with Python's own SIGINT handler: a handler left by an earlier test's in-process
    run would otherwise take the Ctrl-C that the interrupt tests send."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
