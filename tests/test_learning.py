"""GRPO must learn: a regression guard against sign errors, zero advantages, masks that hide every token,
or a reference that moves. A tiny random model gets a short supervised warm start in which it ends its
answer in the rewarded `#### N` form only 30% of the time; GRPO with the format reward must raise that
share on held-out problems by a clear margin.
"""

import copy
import random

import pytest
import torch

from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.rewards.verifiable import format_reward, reference_answer
from grpo_lightning.io.arithmetic_task import arithmetic_problems
from grpo_lightning.io.rows import DEFAULT_SYSTEM_PROMPT, chat_prompt
from grpo_lightning.offline.tiny import build_model, build_tokenizer
from grpo_lightning.training.data import GSM8KDataModule
from grpo_lightning.training.module import GRPOModule
from tests.helpers import quiet_trainer


def warm_start(model, tokenizer, rows, steps: int = 120, hash_share: float = 0.3) -> None:
    """Supervised fine-tuning on answers that use `#### N` in `hash_share` of the examples."""
    rng = random.Random(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        batch = rng.sample(rows, 16)
        texts = []
        for row in batch:
            prompt = tokenizer.apply_chat_template(
                chat_prompt(row["question"], DEFAULT_SYSTEM_PROMPT),
                tokenize=False,
                add_generation_prompt=True,
            )
            n = reference_answer(row["answer"])
            answer = f"#### {n}" if rng.random() < hash_share else f"The answer is {n}."
            texts.append(prompt + answer + tokenizer.eos_token)
        tokenizer.padding_side = "right"
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
        loss = model(**enc, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    tokenizer.padding_side = "left"


@torch.no_grad()
def heldout_format_rate(module: GRPOModule, rows, samples: int = 8) -> float:
    torch.manual_seed(1)
    prompts = [chat_prompt(r["question"], DEFAULT_SYSTEM_PROMPT) for r in rows]
    _, completions = module.rollouts.sample(prompts, samples)
    return sum(format_reward(completions)) / len(completions)


@pytest.fixture(scope="module")
def warm_started():
    """The tokenizer and the warm-started model that both backends start from (the warm start is half of
    a run's work); each test trains a copy."""
    rows = arithmetic_problems(400, seed=0)
    texts = [r["question"] + "\n" + r["answer"] + "\nThe answer is 12." for r in rows]
    tokenizer = build_tokenizer(texts + [DEFAULT_SYSTEM_PROMPT] * 5, vocab_size=400)
    model = build_model(len(tokenizer), hidden_size=64, num_layers=2)
    model.config.eos_token_id = model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    warm_start(model, tokenizer, rows)
    return model, tokenizer


@pytest.mark.long
@pytest.mark.parametrize("backend", ["eager", "static"])
def test_grpo_raises_heldout_reward(warm_started, backend):
    model, tokenizer = (copy.deepcopy(x) for x in warm_started)
    module = GRPOModule(
        model,
        tokenizer,
        reward_funcs=[format_reward],
        grpo=GRPOConfig(
            num_generations=8,
            max_completion_length=12,
            learning_rate=2e-3,
            beta=0.04,
            generation_backend=backend,
        ),
    )
    heldout = arithmetic_problems(24, seed=99)
    before = heldout_format_rate(module, heldout)
    data = GSM8KDataModule(source="arithmetic", batch_size=4, val_size=4, arithmetic_size=400)
    # 12 steps: held-out 0.30 -> 0.88-0.92 (eager) and 0.31 -> 0.90-0.95 (static) after 10-15 steps.
    trainer = quiet_trainer(max_steps=12, limit_val_batches=0)
    trainer.fit(module, data)
    after = heldout_format_rate(module, heldout)
    print(f"{backend}: held-out format reward: before {before:.3f}, after {after:.3f}")
    assert 0.1 < before < 0.6, before  # the warm start left room to learn
    assert after >= before + 0.25, (before, after)
