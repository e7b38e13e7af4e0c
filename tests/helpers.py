"""What several test files share: the GSM8K rows, dense rewards for random-weight models, a quiet CPU
Trainer, a small GRPO module on the tiny model, a model that is not all full attention, the CLI's one-line
errors, the accuracy metric's names and the prompt ids the policy is given."""

import json
import os
import shutil

import lightning as L
import pytest
from transformers import PreTrainedModel, Qwen2Config, Qwen2ForCausalLM

from grpo_lightning.cli import main
from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.generation.prompts import PromptEncoder
from grpo_lightning.core.rewards.verifiable import completion_text
from grpo_lightning.training.data import GSM8KDataModule
from grpo_lightning.training.module import GRPOModule

# What `GSM8KAccuracy` reports, written out here so that a renamed or lost metric fails the tests.
ACCURACY_KEYS = (
    "accuracy",
    "accuracy_strict",
    "pass_at_k",
    "pass_at_k_strict",
    "maj_at_k",
    "maj_at_k_strict",
    "format",
)

# GSM8K (MIT) ships with the repository: data/gsm8k/{train,test}.jsonl.
GSM8K_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "gsm8k")


def gsm8k_rows(split: str = "train", limit: int | None = None) -> list[dict]:
    with open(os.path.join(GSM8K_DIR, f"{split}.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    return rows[:limit]


def digit_reward(completions: list, **kwargs) -> list[float]:
    """A dense reward for random-weight models (which never solve anything): the share of digit characters."""
    texts = map(completion_text, completions)  # chat data: TRL's `[{"role": "assistant", "content": ...}]`
    return [sum(c.isdigit() for c in text) / max(1, len(text)) for text in texts]


def length_reward(completions: list, **kwargs) -> list[float]:
    """Dense: a random model's completions differ in length within every group, so every group teaches and
    every step really changes the weights."""
    return [len(completion_text(c)) / 10 for c in completions]


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


def tiny_module(
    path: str, cls: type[GRPOModule] = GRPOModule, reward_funcs=None, module_options=None, **grpo
) -> GRPOModule:
    """A `cls` on the tiny model: groups of 2, 8 new tokens, no pre-flight, no completion panels, unless
    `grpo` says otherwise; `module_options` go to the module (e.g. `lora`)."""
    options = dict(num_generations=2, max_completion_length=8, preflight=False, log_completions_every=0)
    grpo_config = GRPOConfig(**{**options, **grpo})
    funcs = None if reward_funcs is None else list(reward_funcs)
    return cls(path, reward_funcs=funcs, grpo=grpo_config, **(module_options or {}))


def static_module(path: str, cls: type[GRPOModule] = GRPOModule, **grpo) -> GRPOModule:
    """A `cls` sampling through the static engine, with `digit_reward`, groups of 2, a learning rate of 1e-2
    (the weights move in one step) and no pre-flight, unless `grpo` says otherwise."""
    options = dict(num_generations=2, generation_backend="static", learning_rate=1e-2, preflight=False)
    return cls(path, reward_funcs=[digit_reward], grpo=GRPOConfig(**{**options, **grpo}))


def arithmetic_data(size: int) -> GSM8KDataModule:
    """`size` built-in arithmetic problems without a system prompt, 2 per step, 2 held out."""
    return GSM8KDataModule(
        source="arithmetic", system_prompt=None, arithmetic_size=size, batch_size=2, val_size=2
    )


def sliding_window_model(vocab: int) -> PreTrainedModel:
    """A 2-layer Qwen2 whose second layer attends over a sliding window of 4 tokens: what the static engine,
    shared prompts and packed passes cannot serve."""
    layers = ["full_attention", "sliding_attention"]
    window = {"use_sliding_window": True, "sliding_window": 4, "layer_types": layers}
    sizes = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4}
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, num_hidden_layers=2, **sizes, **window))


def cli_error(args: list[str], capsys) -> str:
    """Run `cli.py` in-process; it must exit with status 2 and one message, no traceback."""
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def one_error_line(err: str) -> str:
    """The CLI's one `error:` line: the last thing it writes but its debug hint (no usage, no dump after it;
    `cli_error` checked that no traceback came before it)."""
    lines = err.strip().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("error: "))
    assert lines[first + 1 :] in ([], ["(GRPO_DEBUG=1 shows the traceback)"]), lines[first:]
    return lines[first]


def write_rows(path, rows: list) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def copy_model(tiny_model_dir: str, folder) -> str:
    shutil.copytree(tiny_model_dir, folder)
    return str(folder)


def recorded_prompt_ids(monkeypatch) -> list[list[int]]:
    """Each prompt's token ids (padding dropped) as the encoder hands them to the policy, as they come."""
    seen: list[list[int]] = []
    encode = PromptEncoder.encode

    def recording(self, prompts, device, tools=None):
        ids, mask = encode(self, prompts, device, tools)
        seen.extend([row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)])
        return ids, mask

    monkeypatch.setattr(PromptEncoder, "encode", recording)
    return seen


def files_of(folder) -> dict[str, bytes]:
    """Every file under `folder`, by relative path, with its bytes."""
    found = {}
    for parent, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(parent, name)
            found[os.path.relpath(path, folder)] = open(path, "rb").read()
    return found
