"""A multi-turn tool rollout through a `vllm serve` process (`ToolRollouts` over `VLLMServerEngine`), on the
tiny model taught to call the calculator: greedy turns whose ids, masks and messages are the eager engine's
(which the colocated engine's equal: `test_vllm_tools.py`), each later turn sent to the server that holds
the earlier ones; sampled turns whose log-probs are the scorer's on the model's tokens and 0 on the tool
turn's. One server for the module."""

from __future__ import annotations

import pytest
import torch

from grpo_lightning.core.generation.engines import EagerEngine
from grpo_lightning.core.generation.multi_turn import ToolRollouts
from grpo_lightning.core.generation.sampling import SamplingSettings
from grpo_lightning.core.generation.vllm_server import VLLMServerEngine, VLLMServerOptions
from grpo_lightning.core.tools.calculator import calculator
from grpo_lightning.core.tools.calls import ToolRunner
from grpo_lightning.offline.tool_caller import QUESTION
from tests.test_tool_rollouts import calling_model as calling_model  # a fixture: on tiny_model_dir below
from tests.vllm_backend.helpers import running_servers, scored
from tests.vllm_backend.test_vllm_tools import OTHER, encoded, settings_of, the_taught_turns


@pytest.fixture(scope="module")
def tiny_model_dir(vllm_model_dir):
    return vllm_model_dir


@pytest.fixture(scope="module")
def engine(calling_model, vllm_model_dir):
    _, tokenizer = calling_model
    with running_servers(vllm_model_dir, count=2, max_model_len=512) as servers:
        options = VLLMServerOptions(base_url=[s.url for s in servers], timeout=30)
        engine = VLLMServerEngine(settings_of(tokenizer), options, max_len=512)
        yield engine
        engine.close()


def test_greedy_tool_turns_are_the_eager_engines(calling_model, engine):
    model, tokenizer = calling_model
    ids, mask = encoded(tokenizer, [QUESTION, OTHER])
    engine.refresh(model, torch.device("cpu"))
    picked = []
    pick = engine.router._pick

    def recorded(prompt):
        server = pick(prompt)
        picked.append((len(prompt), server.url))
        return server

    engine.router._pick = recorded
    runs = {}
    for name, rollout_engine in {"eager": EagerEngine(engine.settings), "server": engine}.items():
        rollouts = ToolRollouts(rollout_engine, tokenizer, ToolRunner([calculator]))
        runs[name] = rollouts.generate(model, ids, mask, num_generations=2, do_sample=False)
    (eager, eager_turns), (served, served_turns) = runs["eager"], runs["server"]
    for field in ("completion_ids", "completion_mask", "tool_mask", "truncated"):
        assert torch.equal(getattr(served, field), getattr(eager, field)), field
    assert served_turns.messages == eager_turns.messages
    call, suffix, answer = the_taught_turns(tokenizer)
    n = int(served.completion_mask[0].sum())
    assert served.completion_ids[0, :n].tolist() == call + suffix + answer
    question = int(mask[0].sum())
    first = next(url for length, url in picked if length == question)
    later = [url for length, url in picked if length == question + len(call) + len(suffix)]
    assert later and set(later) == {first}, "the question's next turn went to the server of its first"


def test_sampled_logprobs_are_the_scorers_on_model_tokens_and_0_on_tool_tokens(calling_model, engine):
    model, tokenizer = calling_model
    ids, mask = encoded(tokenizer, [QUESTION])
    temperature = 0.7
    settings = SamplingSettings(**{**settings_of(tokenizer).__dict__, "temperature": temperature})
    rollouts = ToolRollouts(engine, tokenizer, ToolRunner([calculator]))
    rollout, turns = rollouts.generate(model, ids, mask, num_generations=4, settings=settings)
    model_tokens = rollout.model_mask.bool()  # [4, T]
    assert (rollout.completion_mask.bool() & ~rollout.tool_mask.bool()).any() and turns.counts.calls >= 1
    assert (rollout.sampler_logprobs[~model_tokens] == 0).all(), "0 on tool tokens and after the end"
    gap = (rollout.sampler_logprobs - scored(model, rollout, temperature))[model_tokens]
    assert gap.abs().max() < 1e-5
