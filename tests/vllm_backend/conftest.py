"""The vLLM tests (`make test-vllm`): they need vLLM, which the default environment lacks. There they are
skipped with the reason; in the vLLM job (`GRPO_VLLM_TESTS=1`) a vLLM that does not import fails the run
instead, so that a broken install cannot pass as skipped tests."""

from __future__ import annotations

import os

import pytest

from grpo_lightning.core.generation.vllm_engine import vllm_unavailable
from grpo_lightning.offline.tiny import save_tiny
from tests.helpers import gsm8k_rows

PROBLEM = vllm_unavailable()


def pytest_runtest_setup(item) -> None:
    if PROBLEM is None:
        return
    if os.environ.get("GRPO_VLLM_TESTS") == "1":
        pytest.fail(f"GRPO_VLLM_TESTS=1 but {PROBLEM}", pytrace=False)
    pytest.skip(f"{PROBLEM}: `make test-vllm` runs these")


def _texts() -> list[str]:
    return [r["question"] + "\n" + r["answer"] for r in gsm8k_rows("train", 2000)]


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory) -> str:
    """The tiny model with 2 heads of 32 dimensions (vLLM's CPU attention has no 16), its LM head untied."""
    return save_tiny(str(tmp_path_factory.mktemp("vllm_tiny")), _texts(), tokenizer_vocab=400, num_heads=2)


@pytest.fixture(scope="session")
def vllm_tied_dir(tmp_path_factory) -> str:
    """The same with the LM head tied to the embedding, as SmolLM2's."""
    folder = str(tmp_path_factory.mktemp("vllm_tied"))
    return save_tiny(folder, _texts(), tokenizer_vocab=400, num_heads=2, tie_word_embeddings=True)
