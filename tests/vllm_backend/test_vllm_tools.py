"""Multi-turn rollouts with a tool on vLLM (`core.generation.multi_turn.ToolRollouts` over `VLLMEngine`), on
the vLLM tiny model taught to call the calculator (`tests.test_tool_rollouts.calling_model`): greedy turns
whose ids, masks and messages are the eager engine's, each later turn reading the earlier turns' KV from
vLLM's prefix cache; sampled turns whose log-probs are the scorer's on the model's tokens and 0 on the tool
turn's; a tool turn that fills the budget, or would reach vLLM's `max_model_len`, handled as TRL does; a
training step on vLLM whose loss leaves the tool turn out, and its validation through the same loop."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from datasets import Dataset

from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.generation import vllm_engine
from grpo_lightning.core.generation.engines import EagerEngine
from grpo_lightning.core.generation.multi_turn import ToolRollouts
from grpo_lightning.core.generation.prompts import PromptEncoder
from grpo_lightning.core.generation.sampling import SamplingSettings
from grpo_lightning.core.tools.calculator import calculator
from grpo_lightning.core.tools.calls import ToolRunner
from grpo_lightning.core.tools.schemas import tool_schema
from grpo_lightning.core.tools.turns import tool_messages, tool_suffix_ids
from grpo_lightning.io.distributed import close_process_group
from grpo_lightning.offline.tool_caller import ANSWER, CALL, QUESTION
from grpo_lightning.training.callbacks.results_writer import ValidationResultsWriter
from grpo_lightning.training.data import PromptDataModule
from grpo_lightning.training.module import GRPOModule
from tests.helpers import quiet_trainer
from tests.test_tool_rollouts import Trajectories, answered_42
from tests.test_tool_rollouts import calling_model as calling_model  # a fixture: on tiny_model_dir below
from tests.vllm_backend.helpers import engine_for, scored

BLOCK = 32  # tokens per KV block: the smallest vLLM's CPU attention takes, the unit prefix caching reuses
NEW_TOKENS = 128
OTHER = [{"role": "user", "content": "Hi"}]  # a prompt the model was not taught on


@pytest.fixture(scope="module")
def tiny_model_dir(vllm_model_dir):
    """The model `calling_model` teaches: vLLM's tiny one (2 heads of 32: vLLM's CPU attention has no 16)."""
    return vllm_model_dir


def settings_of(tokenizer, max_new_tokens: int = NEW_TOKENS) -> SamplingSettings:
    eos, pad = (tokenizer.eos_token_id,), tokenizer.pad_token_id
    return SamplingSettings(max_new_tokens=max_new_tokens, eos_token_ids=eos, pad_token_id=pad)


@pytest.fixture(scope="module")
def engine(calling_model):
    model, tokenizer = calling_model
    options = settings_of(tokenizer).__dict__
    engine = engine_for(model, engine={"max_model_len": 512, "block_size": BLOCK}, **options)
    yield engine
    engine.close()


def encoded(tokenizer, prompts: list[list[dict]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts' ids and mask `[N, P]`, the calculator shown to the template."""
    return PromptEncoder(tokenizer).encode(prompts, "cpu", tools=[[tool_schema(calculator)]] * len(prompts))


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def the_taught_turns(tokenizer) -> tuple[list[int], list[int], list[int]]:
    """The ids of the taught conversation's completion: the call, the tool turn with 42, the answer."""
    suffix = tool_suffix_ids(tokenizer, tool_messages([("calculator", "42")], True))
    return ids_of(tokenizer, CALL), suffix, ids_of(tokenizer, ANSWER)


def recorded_requests(engine, monkeypatch) -> list[tuple[int, int]]:
    """(prompt tokens, of them served from the prefix cache) of each request vLLM is handed from now on."""
    requests = []
    decoded = vllm_engine.decoded

    def recording(*args, **kwargs):
        outputs = decoded(*args, **kwargs)
        requests.extend((len(out.prompt_token_ids), out.num_cached_tokens) for out in outputs)
        return outputs

    monkeypatch.setattr(vllm_engine, "decoded", recording)
    return requests


def test_greedy_tool_turns_are_the_eager_engines(calling_model, engine, monkeypatch):
    model, tokenizer = calling_model
    ids, mask = encoded(tokenizer, [QUESTION, OTHER])
    engine.refresh(model, torch.device("cpu"))  # started and pushed: its requests can be recorded
    requests = recorded_requests(engine, monkeypatch)
    runs = {}
    for name, rollout_engine in {"eager": EagerEngine(engine.settings), "vllm": engine}.items():
        rollouts = ToolRollouts(rollout_engine, tokenizer, ToolRunner([calculator]))
        runs[name] = rollouts.generate(model, ids, mask, num_generations=2, do_sample=False)
    (eager, eager_turns), (vllm, vllm_turns) = runs["eager"], runs["vllm"]
    for field in ("completion_ids", "completion_mask", "tool_mask", "truncated"):
        assert torch.equal(getattr(vllm, field), getattr(eager, field)), field
    assert vllm_turns.messages == eager_turns.messages
    assert vllm.sampler_logprobs is None and eager.sampler_logprobs is None  # greedy
    # The question's rows: the taught call, the calculator's 42 (the tool's, out of the loss), the answer.
    call, suffix, answer = the_taught_turns(tokenizer)
    for row in (0, 1):
        n = int(vllm.completion_mask[row].sum())
        assert vllm.completion_ids[row, :n].tolist() == call + suffix + answer
        assert vllm.tool_mask[row, :n].tolist() == [1] * len(call) + [0] * len(suffix) + [1] * len(answer)
    assert vllm_turns.messages[0][1] == {"role": "tool", "name": "calculator", "content": "42"}
    # Each later turn is its own request, its context the earlier turns' ids: vLLM serves the KV of every
    # whole block the earlier turn computed (all but its last token's) from its prefix cache.
    question = int(mask[0].sum())
    later = [cached for length, cached in requests if length == question + len(call) + len(suffix)]
    assert len(later) == 2, requests
    assert all(cached >= BLOCK * ((question + len(call) - 1) // BLOCK) > question for cached in later)


def test_sampled_logprobs_are_the_scorers_on_model_tokens_and_0_on_tool_tokens(calling_model, engine):
    model, tokenizer = calling_model
    ids, mask = encoded(tokenizer, [QUESTION])
    temperature = 0.7
    settings = SamplingSettings(**{**settings_of(tokenizer).__dict__, "temperature": temperature})
    rollouts = ToolRollouts(engine, tokenizer, ToolRunner([calculator]))
    torch.manual_seed(0)
    rollout, turns = rollouts.generate(model, ids, mask, num_generations=4, settings=settings)
    tool_tokens = rollout.completion_mask.bool() & ~rollout.tool_mask.bool()  # [4, T]
    model_tokens = rollout.model_mask.bool()  # [4, T]
    assert tool_tokens.any() and turns.counts.calls >= 1, "a sample called the calculator"
    assert (rollout.sampler_logprobs[~model_tokens] == 0).all(), "0 on tool tokens and after the end"
    gap = (rollout.sampler_logprobs - scored(model, rollout, temperature))[model_tokens]
    assert gap.abs().max() < 1e-5, "every turn's log-probs those of the policy over its whole context"
    assert (rollout.sampler_logprobs[model_tokens] < 0).any()


def test_a_tool_turn_that_fills_the_budget_ends_the_sample_there(calling_model, engine):
    """Room for the call and the tool turn, none for another token: the tool turn is kept and the sample
    ends truncated (TRL cuts the next turn to nothing), rather than vLLM refusing `max_tokens=0`."""
    model, tokenizer = calling_model
    call, suffix, _ = the_taught_turns(tokenizer)
    rollouts = ToolRollouts(engine, tokenizer, ToolRunner([calculator]))
    settings = settings_of(tokenizer, len(call) + len(suffix))
    rollout, turns = rollouts.generate(
        model, *encoded(tokenizer, [QUESTION]), num_generations=1, do_sample=False, settings=settings
    )
    assert rollout.completion_ids[0].tolist() == call + suffix
    assert rollout.tool_mask[0].tolist() == [1] * len(call) + [0] * len(suffix)
    assert bool(rollout.truncated[0]) and turns.counts.calls == 1


def test_a_tool_turn_that_would_reach_vllms_max_model_len_is_rolled_back(calling_model):
    """vLLM's context ceiling below the model's positions: the tool turn that would make the context
    `max_model_len` long is not appended (TRL's check under vLLM), the sample ends with the model's turn;
    vLLM would refuse that context."""
    model, tokenizer = calling_model
    ids, mask = encoded(tokenizer, [QUESTION])
    call, suffix, _ = the_taught_turns(tokenizer)
    ceiling = int(mask.sum()) + len(call) + len(suffix)
    assert ceiling < model.config.max_position_embeddings
    engine = engine_for(model, engine={"max_model_len": ceiling}, **settings_of(tokenizer).__dict__)
    try:
        rollouts = ToolRollouts(engine, tokenizer, ToolRunner([calculator]))
        rollout, turns = rollouts.generate(model, ids, mask, num_generations=1, do_sample=False)
    finally:
        engine.close()
    assert rollout.completion_ids[0].tolist() == call and rollout.tool_mask[0].all()
    assert not rollout.truncated[0] and [m["role"] for m in turns.messages[0]] == ["assistant"]


def test_a_training_step_with_tools_on_vllm_leaves_the_tool_turn_out_of_the_loss(calling_model, tmp_path):
    model, tokenizer = calling_model
    options = dict(num_generations=2, max_completion_length=NEW_TOKENS, temperature=0.3, learning_rate=1e-4)
    vllm = dict(generation_backend="vllm", vllm_kv_cache_gb=0.05, vllm_enforce_eager=True)
    grpo = GRPOConfig(**options, **vllm, preflight=False, log_completions_every=0)
    module = GRPOModule(
        copy.deepcopy(model), tokenizer, reward_funcs=[answered_42], grpo=grpo, tools=[calculator]
    )
    rows = [{"prompt": QUESTION, "answer": "42"}] * 3
    data = PromptDataModule(source=Dataset.from_list(rows), batch_size=2, val_size=1, val_batch_size=1)
    record, results = Trajectories(), ValidationResultsWriter(str(tmp_path / "val.jsonl"), overwrite=True)
    # The one training batch is the epoch's last, after which Lightning would validate (pushing the stepped
    # weights): this fit validates nothing, so that the push the step calls for is the validation's below.
    trainer = quiet_trainer(max_steps=1, callbacks=[record], num_sanity_val_steps=0, limit_val_batches=0)
    try:
        trainer.fit(module, data)
        assert module.rollouts.backend == "vllm" and module.rollouts.engine.refreshes == 1
        trajectory, logged = record.trajectory, record.logged
        rollout = trajectory.rollout
        tool_tokens = rollout.completion_mask.bool() & ~rollout.tool_mask.bool()  # [B, T]
        assert tool_tokens.any(dim=1).all(), "every sample has a tool turn"
        assert torch.equal(trajectory.loss_mask, rollout.model_mask.float())  # the tool turn out of the loss
        assert not trajectory.loss_mask[tool_tokens].any()
        assert (rollout.sampler_logprobs[tool_tokens] == 0).all()
        assert "42" in trajectory.completions[0] and logged["train/tools/call_frequency"] >= 1
        assert torch.isfinite(torch.tensor(logged["train/loss"]))
        assert logged["train/completion_length"] == float(rollout.model_mask.sum(1).float().mean())
        quiet_trainer(callbacks=[results]).validate(module, data)  # greedy, the step's weights pushed first
        assert module.rollouts.engine.refreshes == 2
    finally:
        close_process_group()
    [line] = (tmp_path / "val.jsonl").read_text().splitlines()
    transcript = json.loads(line)["transcript"]
    assert [m["role"] for m in transcript] == ["assistant", "tool", "assistant"]
    assert transcript[1]["content"] == "42" and json.loads(line)["correct"] is True
