import json
import os

import lightning as L
import pytest

from grpo_lightning.rewards import completion_text
from grpo_lightning.tiny import save_tiny

# GSM8K (MIT) ships with the repository: data/gsm8k/{train,test}.jsonl.
GSM8K_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "gsm8k")


def gsm8k_rows(split: str = "train", limit: int | None = None) -> list[dict]:
    with open(os.path.join(GSM8K_DIR, f"{split}.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    return rows[:limit]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A random 2-layer Llama and a BPE tokenizer trained on GSM8K text, saved with save_pretrained."""
    rows = gsm8k_rows("train", 2000)
    texts = [r["question"] + "\n" + r["answer"] for r in rows]
    return save_tiny(str(tmp_path_factory.mktemp("tiny")), texts, tokenizer_vocab=400)


def digit_reward(completions: list, **kwargs) -> list[float]:
    """A dense reward for random-weight models (which never solve anything): the share of digit characters."""
    texts = map(completion_text, completions)  # chat data: TRL's `[{"role": "assistant", "content": ...}]`
    return [sum(c.isdigit() for c in text) / max(1, len(text)) for text in texts]


def quiet_trainer(**kwargs) -> L.Trainer:
    """A CPU Trainer that logs, checkpoints and prints nothing unless the test asks for it."""
    quiet = {
        "accelerator": "cpu",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    return L.Trainer(**{**quiet, **kwargs})
