"""`EnvironmentPromptDataModule` (TRL's `train_dataset=None`) on 2 DDP ranks (gloo, CPU): each rank takes its
own `batch_size` placeholder rows per step, its environments' `reset` writes the prompts its policy reads,
their `get_reward` is the reward that moves the weights, and the weights move alike on both ranks.

The run is one job of the shared 2-process launch (tests/two_ranks.py, `two_rank_jobs`).
"""

from __future__ import annotations

import json
import os
import re

import lightning as L
import pytest
import torch
import torch.distributed as dist

from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.training.data.environment_prompts import EnvironmentPromptDataModule
from grpo_lightning.training.module import GRPOModule
from tests.helpers import quiet_trainer
from tests.test_tool_rollouts import BuyingEngine

BATCH_SIZE, G, STEPS = 2, 2, 2

WRITTEN: list[str] = []  # this process's resets: the prompt each wrote
KEYWORDS: list[dict] = []  # and the keywords each was called with
REWARDS: list[float] = []  # this process's get_reward answers, in order


class RankCounter:
    """An environment that owns its task: `reset` writes a prompt naming its rank and its place among the
    rank's resets, with a target that changes from one reset to the next (so a group's rewards differ)."""

    def reset(self, **kwargs) -> str:
        KEYWORDS.append(dict(kwargs))
        self.target, self.total = 1 + len(WRITTEN) % 4, 0
        WRITTEN.append(f"Rank {dist.get_rank()} prompt {len(WRITTEN)}: add up to {self.target}.")
        return WRITTEN[-1]

    def add(self, n: int) -> int:
        """Add to the total.

        Args:
            n: how much
        """
        self.total += n
        return self.total

    def get_reward(self) -> float:
        REWARDS.append(-abs(self.total - self.target))
        return REWARDS[-1]


class AddingEngine(BuyingEngine):
    """A scripted model that adds 2 whatever its prompt asks, then says it is done."""

    def turn(self, context: str) -> str:
        if "<tool_response>" in context:
            return "Done.<|im_end|>"
        return '<tool_call>{"name": "add", "arguments": {"n": 2}}</tool_call><|im_end|>'


class Recorder(L.Callback):
    """Each step's rewards and advantages as the module scored them, and the weights before training."""

    def __init__(self) -> None:
        self.steps: list[dict] = []

    def on_train_start(self, trainer, pl_module) -> None:
        self.initial = {n: p.detach().clone() for n, p in pl_module.policy.named_parameters()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        record = pl_module.last_rollout
        self.steps.append(
            {
                "rewards": record.rewards_per_func[:, 0].tolist(),
                "advantages": record.advantages.tolist(),
                "loss": float(outputs["loss"]),
            }
        )


def fit_environment_prompts(cfg: dict) -> None:
    """One rank of the run: `STEPS` steps of `BATCH_SIZE` environment-written prompts, G samples each."""
    WRITTEN.clear(), KEYWORDS.clear(), REWARDS.clear()
    grpo = GRPOConfig(num_generations=G, max_completion_length=160, preflight=False, log_completions_every=0)
    module = GRPOModule(cfg["model"], reward_funcs=None, grpo=grpo, environment_factory=RankCounter)
    engine = AddingEngine(module.tokenizer)
    module.rollouts.build_engine = lambda: engine
    recorder = Recorder()
    trainer = quiet_trainer(
        devices=2, strategy="ddp", max_steps=STEPS, num_sanity_val_steps=0, callbacks=[recorder]
    )
    trainer.fit(module, EnvironmentPromptDataModule(batch_size=BATCH_SIZE))
    first_turns = [c for c in engine.contexts if "<tool_response>" not in c]
    rank = trainer.global_rank
    weights = {n: p.detach() for n, p in module.policy.named_parameters()}
    torch.save({"initial": recorder.initial, "final": weights}, os.path.join(cfg["out"], f"weights{rank}.pt"))
    record = {
        "written": WRITTEN,
        "keywords": KEYWORDS,
        "get_reward": REWARDS,
        "user_turns": [
            re.findall(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", c, re.DOTALL) for c in first_turns
        ],
        "steps": recorder.steps,
        "global_step": trainer.global_step,
    }
    with open(os.path.join(cfg["out"], f"rank{rank}.json"), "w") as f:
        json.dump(record, f)


def two_rank_jobs(model: str, out: str) -> list[dict]:
    """This file's run in the launch of tests/two_ranks.py, into `out`."""
    cfg = {"strategy": "ddp", "model": model, "out": out}
    return [{"call": "tests.test_environment_prompts_ranks:fit_environment_prompts", "cfg": cfg}]


@pytest.fixture
def ranks(two_rank_runs) -> tuple[list[dict], list[dict]]:
    """What each rank of this file's run recorded, and its weights before and after."""
    out = os.path.join(two_rank_runs, "test_environment_prompts_ranks")
    records = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]
    return records, [torch.load(os.path.join(out, f"weights{r}.pt")) for r in range(2)]


def test_each_rank_resets_its_own_rows_and_trains_on_their_prompts(ranks):
    records, _ = ranks
    per_rank = STEPS * BATCH_SIZE * G  # not the world's rows on every rank, nor none
    for rank, record in enumerate(records):
        assert record["global_step"] == STEPS
        assert len(record["written"]) == per_rank and record["keywords"] == [{}] * per_rank
        assert all(text.startswith(f"Rank {rank} prompt ") for text in record["written"])
        # The policy read the prompts reset wrote on this rank, each alone in its user turn, in order.
        assert record["user_turns"] == [[text] for text in record["written"]]


def test_get_reward_is_the_reward_each_rank_trained_on(ranks):
    records, _ = ranks
    for record in records:
        targets = [1 + i % 4 for i in range(STEPS * BATCH_SIZE * G)]
        assert record["get_reward"] == [-abs(2 - t) for t in targets]  # each sample added 2 once
        per_step = BATCH_SIZE * G
        scored = [reward for step in record["steps"] for reward in step["rewards"]]
        assert scored == record["get_reward"]
        assert all(any(a != 0 for a in step["advantages"]) for step in record["steps"])
        assert all(torch.isfinite(torch.tensor(step["loss"])) for step in record["steps"])
        assert len(scored) == STEPS * per_step


def test_the_weights_move_alike_on_both_ranks(ranks):
    _, weights = ranks
    for name, final in weights[0]["final"].items():
        torch.testing.assert_close(weights[1]["final"][name], final, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(weights[1]["initial"][name], weights[0]["initial"][name], rtol=0, atol=0)
    moved = sum(float((weights[0]["final"][n] - p).abs().sum()) for n, p in weights[0]["initial"].items())
    assert moved > 1e-4
