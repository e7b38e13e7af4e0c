"""Environments as TRL 1.16 runs them: an `environment_factory` whose `get_reward` is the only reward
(`reward_funcs` None or `[]`), a data set with only an `environment` column whose `reset` writes each prompt,
and a list result reaching the reward functions as the list itself (`grpo_agent.py`'s `query_reward` tests
`isinstance(result, list)`), through the module's whole training step on a scripted engine."""

import re

import pytest
import torch
from datasets import Dataset

from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.training.data import PromptDataModule
from grpo_lightning.training.module import GRPOModule
from grpo_lightning.training.tool_rollouts import EnvironmentReward
from tests.helpers import quiet_trainer
from tests.test_tool_rollouts import BuyingEngine, Metrics

RESETS = []  # every reset's keywords


class Counter:
    """TRL's docs' recipe shape: the environment owns the task; `reset` returns the prompt's text."""

    def reset(self, **row) -> str:
        RESETS.append(dict(row))
        self.target, self.total = 3, 0
        return f"Count to {self.target} (stock {self.target})."

    def buy(self, n: int) -> list:
        """Count up.

        Args:
            n: how much
        """
        self.total += n
        return [{"type": "text", "text": str(self.total)}]

    def get_reward(self) -> float:
        return float(self.total == self.target)


LISTS = []


def query_reward(completions, **kwargs):
    """`grpo_agent.py`'s test: a tool result that is a list (of content blocks) is a well-formed answer."""
    rewards = []
    for completion in completions:
        results = [m["content"] for m in completion if m["role"] == "tool"]
        LISTS.extend(results)
        rewards.append(0.5 if results and all(isinstance(r, list) for r in results) else 0.0)
    return rewards


def module_of(model_dir: str, reward_funcs, factory) -> tuple[GRPOModule, list]:
    grpo = GRPOConfig(num_generations=2, max_completion_length=160, preflight=False, log_completions_every=0)
    module = GRPOModule(model_dir, reward_funcs=reward_funcs, grpo=grpo, environment_factory=factory)
    engine = BuyingEngine(module.tokenizer)
    module.rollouts.build_engine = lambda: engine
    return module, engine.contexts


@pytest.mark.parametrize("reward_funcs", [None, []])
def test_an_environments_get_reward_is_the_reward_without_reward_functions(tiny_model_dir, reward_funcs):
    module, _ = module_of(tiny_model_dir, reward_funcs, Counter)
    assert module.reward_names == ["Counter"]  # not the GSM8K defaults
    [reward] = module.reward_funcs
    assert isinstance(reward, EnvironmentReward) and reward.cls is Counter


def test_a_data_set_of_environment_names_only_has_its_prompts_written_by_reset(tiny_model_dir):
    RESETS.clear()
    LISTS.clear()
    module, contexts = module_of(tiny_model_dir, [query_reward], {"counter": Counter})
    data = PromptDataModule(
        source=Dataset.from_list([{"environment": "counter"}] * 4), batch_size=2, val_size=1, seed=0
    )
    metrics = Metrics()
    trainer = quiet_trainer(max_steps=1, callbacks=[metrics], limit_val_batches=0)
    trainer.fit(module, data)
    assert RESETS and all(row == {} for row in RESETS)  # neither the routing column nor a prompt
    user_turns = [re.findall(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", c, re.DOTALL) for c in contexts]
    assert user_turns[0] == ["Count to 3 (stock 3)."]  # the empty user turn, written by reset
    assert LISTS and all(r == [{"type": "text", "text": "3"}] for r in LISTS)  # the list itself
    assert metrics.logged["train/rewards/query_reward"] == 0.5
    assert metrics.logged["train/rewards/Counter"] == 1.0
    assert torch.isfinite(torch.tensor(metrics.logged["train/loss"]))
