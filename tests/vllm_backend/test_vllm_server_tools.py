"""A multi-turn tool rollout through a `vllm serve` process (`ToolRollouts` over `VLLMServerEngine`), on the
tiny model taught to call the calculator: greedy turns whose ids, masks and messages are the eager engine's
(which the colocated engine's equal: `test_vllm_tools.py`), each later turn sent to the server that holds
the earlier ones; sampled turns whose log-probs are the scorer's on the model's tokens and 0 on the tool
turn's. Sampled ahead (`max_staleness: 1`), with tools and an environment: every turn of a batch sampled by
the weights it is stamped with, each batch with environments of its own. Two servers for the module."""

from __future__ import annotations

import copy

import pytest
import torch
from datasets import Dataset

from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.generation.engines import EagerEngine
from grpo_lightning.core.generation.multi_turn import ToolRollouts
from grpo_lightning.core.generation.sampling import SamplingSettings
from grpo_lightning.core.generation.vllm_server import VLLMServerEngine
from grpo_lightning.core.generation.vllm_server_options import VLLMServerOptions
from grpo_lightning.core.tools.calculator import calculator
from grpo_lightning.core.tools.calls import ToolRunner
from grpo_lightning.offline.tool_caller import QUESTION
from grpo_lightning.training.data import PromptDataModule
from grpo_lightning.training.module import GRPOModule
from tests.helpers import length_reward, quiet_trainer
from tests.test_tool_rollouts import calling_model as calling_model  # a fixture: on tiny_model_dir below
from tests.vllm_backend.helpers import VersionStamps, running_servers, scored
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


class Ledger:
    """An environment that remembers the row it was reset with (its `id`) and counts its resets; every
    instance kept, in the order made."""

    made: list[Ledger] = []

    def __init__(self) -> None:
        self.row, self.resets = None, 0
        Ledger.made.append(self)

    def reset(self, **row) -> None:
        self.row, self.resets = row["id"], self.resets + 1

    def get_reward(self) -> float:
        return 0.0


SCORED: list[list[tuple[Ledger, int]]] = []  # per scored batch: each sample's environment and row id


def ledger_reward(completions, environments, id, **kwargs) -> list[float]:
    """Records what each scored sample's environment holds while its batch is scored."""
    SCORED.append(list(zip(environments, id, strict=True)))
    return [0.0] * len(completions)


def later_turn_rows(rollout) -> int:
    """The samples of `rollout` with a turn of the model's after a tool turn."""
    tool = rollout.completion_mask.bool() & ~rollout.tool_mask.bool()  # [B, T]
    positions = torch.arange(tool.size(1))  # [T]
    last_tool = torch.where(tool, positions, -1).max(dim=1).values  # [B]
    last_own = torch.where(rollout.model_mask.bool(), positions, -1).max(dim=1).values  # [B]
    return int(((last_tool >= 0) & (last_own > last_tool)).sum())


def test_tool_rollouts_sampled_ahead_are_stamped_with_their_weights_and_own_environments(
    calling_model, engine
):
    model, tokenizer = calling_model
    Ledger.made.clear()
    SCORED.clear()
    grpo = GRPOConfig(
        num_generations=4,  # 16 stale samples: each goes on after its tool turn about half the time
        max_completion_length=128,
        temperature=1.0,
        learning_rate=1e-3,
        weight_decay=1.0,  # every step moves every weight, whatever the rewards: stale is never current
        preflight=False,
        log_completions_every=0,
        vllm_mode="server",
        vllm_server_base_url=engine.options.urls,
        vllm_server_timeout=30,
        max_staleness=1,
    )
    module = GRPOModule(
        copy.deepcopy(model),
        tokenizer,
        reward_funcs=[length_reward, ledger_reward],
        grpo=grpo,
        tools=[calculator],
        environment_factory=Ledger,
    )
    made_before = len(Ledger.made)  # the probe the module builds
    rows = [{"prompt": QUESTION, "answer": "42", "id": i} for i in range(8)]
    data = PromptDataModule(source=Dataset.from_list(rows), batch_size=2, val_size=1, val_batch_size=1)
    stamps = VersionStamps(module)
    # Validation after every step, while the next batch rolls out: its push waits for that batch's end.
    trainer = quiet_trainer(max_steps=3, val_check_interval=1, num_sanity_val_steps=0, callbacks=[stamps])
    trainer.fit(module, data)
    seen = stamps.updates
    assert "val/accuracy" in trainer.callback_metrics
    assert [u.staleness for u in seen] == [0, 1, 1]
    later_turns = [later_turn_rows(u.rollout) for u in seen[1:]]
    assert sum(later_turns) >= 1, "the stale batches hold samples that went on after a tool turn"
    assert max(u.then for u in seen) < 1e-5, [u.then for u in seen]  # every turn: its stamped version
    assert min(u.now for u in seen[1:]) > 1e-4, "a stale batch is not the policy's: the check can fail"
    assert all(e.resets == 1 for e in Ledger.made[made_before:]), "a new environment for each sample"
    assert len(SCORED) == 3
    for batch in SCORED:  # while a batch is scored, its environments still hold its own rows
        assert all(e.row == row for e, row in batch)
    scored_environments = [id(e) for batch in SCORED for e, _ in batch]
    assert len(set(scored_environments)) == 3 * 2 * 4, "no environment serves two batches"
