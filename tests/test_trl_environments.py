"""Environments as TRL 1.16 runs them: an `environment_factory` whose `get_reward` is the only reward
(`reward_funcs` None or `[]`), a data set with only an `environment` column whose `reset` writes each prompt,
no data set at all (`EnvironmentPromptDataModule`, TRL's `train_dataset=None`), an environment that sets a
signal handler (`environment_timeout: null`, TRL's way), and a list result reaching the reward functions as
the list itself (`grpo_agent.py`'s `query_reward` tests `isinstance(result, list)`), through the module's
whole training step on a scripted engine."""

import functools
import random
import re
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from datasets import Dataset

from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.tools.calls import ROLLOUT_THREAD
from grpo_lightning.training.data import PromptDataModule
from grpo_lightning.training.data.environment_prompts import EnvironmentPromptDataModule
from grpo_lightning.training.module import GRPOModule
from grpo_lightning.training.tool_rollouts import EnvironmentReward, _user_call
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


def module_of(model_dir: str, reward_funcs, factory, **options) -> tuple[GRPOModule, list]:
    grpo = GRPOConfig(
        num_generations=2, max_completion_length=160, preflight=False, log_completions_every=0, **options
    )
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


class IncrementEnv:
    """TRL's docs' environment that owns its data (`train_dataset=None`), as the docs write it."""

    def reset(self, **kwargs) -> str | None:
        RESETS.append(dict(kwargs))
        self.counter = 0
        self.target = random.randint(1, 6)
        return f"Increment the counter by {self.target}."

    def get_reward(self) -> float:
        return float(self.counter == self.target)

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter


class IncrementingEngine(BuyingEngine):
    """A scripted model that increments by the target its prompt names, then says it is done."""

    def turn(self, context: str) -> str:
        if "<tool_response>" in context:
            return "Done.<|im_end|>"
        step = re.findall(r"Increment the counter by (\d+)\.", context)[-1]
        return f'<tool_call>{{"name": "increment", "arguments": {{"step": {step}}}}}</tool_call><|im_end|>'


@pytest.mark.parametrize("reward_funcs", [None, []])
def test_no_data_set_the_environment_writes_every_prompt(tiny_model_dir, reward_funcs):
    """TRL's `GRPOTrainer(environment_factory=IncrementEnv, args=GRPOConfig(max_steps=...))` with no
    `train_dataset` and no `reward_funcs`: every step's prompts are empty user turns that `reset` writes, and
    `get_reward` is the reward."""
    RESETS.clear()
    random.seed(0)
    grpo = GRPOConfig(num_generations=2, max_completion_length=160, preflight=False, log_completions_every=0)
    module = GRPOModule(
        tiny_model_dir, reward_funcs=reward_funcs, grpo=grpo, environment_factory=IncrementEnv
    )
    engine = IncrementingEngine(module.tokenizer)
    module.rollouts.build_engine = lambda: engine
    metrics = Metrics()
    trainer = quiet_trainer(max_steps=3, callbacks=[metrics])  # no val_sets: no validation
    trainer.fit(module, EnvironmentPromptDataModule(batch_size=2))
    assert trainer.global_step == 3
    assert len(RESETS) == 3 * 2 * 2 and all(kwargs == {} for kwargs in RESETS)  # steps x prompts x G
    first_turns = [c for c in engine.contexts if "<tool_response>" not in c]
    user_turns = [re.findall(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", c, re.DOTALL) for c in first_turns]
    assert len(user_turns) == 12
    written = r"Increment the counter by [1-6]\."
    assert all(len(turns) == 1 and re.fullmatch(written, turns[0]) for turns in user_turns)
    assert metrics.logged["train/rewards/IncrementEnv"] == 1.0


def trainer_refusal(model_dir: str, factory, **trainer_options) -> str:
    grpo = GRPOConfig(num_generations=2, max_completion_length=8, preflight=False, log_completions_every=0)
    funcs = None if factory is not None else [query_reward]
    module = GRPOModule(model_dir, reward_funcs=funcs, grpo=grpo, environment_factory=factory)
    trainer = quiet_trainer(limit_val_batches=0, **trainer_options)
    with pytest.raises(ValueError) as refusal:
        trainer.fit(module, EnvironmentPromptDataModule(batch_size=2))
    assert module.policy is None  # refused before any weights load
    return str(refusal.value)


@pytest.mark.parametrize(
    ("factory", "trainer_options", "named"),
    [
        (IncrementEnv, {"max_epochs": 1}, "trainer.max_steps=-1"),
        ({"a": IncrementEnv, "b": IncrementEnv}, {"max_steps": 1}, "a dict of environments"),
        (None, {"max_steps": 1}, "set model.environment_factory"),
    ],
)
def test_environment_prompts_refuse_what_trl_refuses(tiny_model_dir, factory, trainer_options, named):
    """As TRL's `train_dataset=None`: `max_steps` is required, and one environment to write the prompts."""
    message = trainer_refusal(tiny_model_dir, factory, **trainer_options)
    assert named in message and "\n" not in message


class Expired(Exception):
    pass


def _expired(signum, frame):
    raise Expired


def alarmed(*methods: str) -> type:
    """A `Counter` whose `methods` bound their work with `SIGALRM`, as `grpo_agent.py` bounds its tool's
    query: Python takes signal handlers from the main thread only."""

    def wrap(method):
        @functools.wraps(method)
        def bounded(self, *args, **kwargs):
            previous = signal.signal(signal.SIGALRM, _expired)
            signal.alarm(30)
            try:
                return method(self, *args, **kwargs)
            finally:
                signal.alarm(0)
                signal.signal(signal.SIGALRM, previous)

        return bounded

    return type("AlarmCounter", (Counter,), {name: wrap(getattr(Counter, name)) for name in methods})


def test_an_environment_setting_signal_handlers_trains_with_no_environment_timeout(tiny_model_dir):
    """`environment_timeout: null`: the constructor, `reset` and `get_reward` run in the trainer's thread,
    as TRL runs them, and `get_reward` is the reward."""
    RESETS.clear()
    factory = alarmed("__init__", "reset", "get_reward")
    module, contexts = module_of(tiny_model_dir, None, factory, environment_timeout=None)
    rows = [{"prompt": [{"role": "user", "content": "Buy them all."}]}] * 2
    data = PromptDataModule(source=Dataset.from_list(rows), batch_size=2, val_size=0, seed=0)
    metrics = Metrics()
    trainer = quiet_trainer(max_steps=1, callbacks=[metrics], limit_val_batches=0)
    trainer.fit(module, data)
    assert len(RESETS) == 2 * 2  # rows x G, each reset under its alarm
    assert len(contexts) == 2 * 2 * 2 and all("Count to 3 (stock 3)." in c for c in contexts)  # 2 turns each
    assert metrics.logged["train/rewards/AlarmCounter"] == 1.0  # every get_reward ran


@pytest.mark.parametrize(
    ("method", "what"),
    [
        ("__init__", r"environment_factory .*AlarmCounter\(\)"),
        ("reset", r"AlarmCounter\.reset\(\*\*row\)"),
        ("get_reward", r"AlarmCounter\.get_reward\(\)"),
    ],
)
def test_under_environment_timeout_a_signal_setting_environment_says_what_to_set(
    tiny_model_dir, method, what
):
    """Under the default bound each call runs in a thread of its own, where Python refuses signal handlers:
    the run stops with one line naming the call and `tools.environment_timeout: null`."""
    factory = alarmed(method)
    rows = [{"prompt": [{"role": "user", "content": "Buy them all."}]}] * 2
    data = PromptDataModule(source=Dataset.from_list(rows), batch_size=2, val_size=0, seed=0)
    with pytest.raises(RuntimeError) as failure:
        module, _ = module_of(tiny_model_dir, None, factory)
        quiet_trainer(max_steps=1, limit_val_batches=0).fit(module, data)
    message = str(failure.value)
    # get_reward's line comes inside the reward scoring's own ("reward function 'AlarmCounter' raised ...")
    said = (
        rf"{what} raised ValueError: signal only works in main thread.*set tools\.environment_timeout: null"
    )
    assert re.search(said, message), message
    assert "\n" not in message


def test_on_the_rollout_thread_a_signal_setting_environment_says_to_set_max_staleness_0():
    """Rollouts sampled ahead (`max_staleness` > 0) build and reset environments on the rollout thread:
    with `environment_timeout: null` a signal-setting `reset` still fails there, and the line says so."""
    environment = alarmed("reset")()
    with ThreadPoolExecutor(1, thread_name_prefix=ROLLOUT_THREAD) as rollout_thread:
        job = rollout_thread.submit(_user_call, "AlarmCounter.reset(**row)", environment.reset, None)
        with pytest.raises(RuntimeError) as failure:
            job.result()
    message = str(failure.value)
    said = (
        r"AlarmCounter\.reset\(\*\*row\) raised ValueError: signal only works in main thread.*"
        r"set async_rollouts\.max_staleness: 0 and tools\.environment_timeout: null"
    )
    assert re.search(said, message), message
    assert "\n" not in message
