import pytest

from grpo_lightning.offline.tiny import save_tiny
from tests.helpers import gsm8k_rows


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A random 2-layer Llama and a BPE tokenizer trained on GSM8K text, saved with save_pretrained."""
    rows = gsm8k_rows("train", 2000)
    texts = [r["question"] + "\n" + r["answer"] for r in rows]
    return save_tiny(str(tmp_path_factory.mktemp("tiny")), texts, tokenizer_vocab=400)
