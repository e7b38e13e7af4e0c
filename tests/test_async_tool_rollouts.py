"""Multi-turn tool rollouts sampled ahead (`max_staleness: 1`) without vLLM: stand-in servers write a
calculator call, then an answer after its result, and record each completion request with the weight version
they held when it came. Every turn of every trained sample comes under one version, and the versions match
the groups' stamps one to one: a batch rolls out on the rollout thread through the engine pinned to the
version of its submission (`training.rollouts.PinnedRollouts`, `vllm_server.PinnedServerEngine`), with
validation pushing between steps. Against real servers, with the sampler's log-probs checked and
validation's push shown to wait for the batch in flight: `tests/vllm_backend/test_vllm_server_tools.py`."""

from __future__ import annotations

import re

import pytest
from datasets import Dataset

from grpo_lightning.core.tools.calculator import calculator
from grpo_lightning.offline.tool_caller import ANSWER, CALL
from grpo_lightning.training.data import PromptDataModule
from tests.helpers import length_reward, quiet_trainer, tiny_module
from tests.test_vllm_server_requests import StandIn


class Scripted(StandIn):
    """A stand-in server whose first turn calls the calculator and whose next turn answers; each request's
    row (the `row N` of its question), turn and the server's weight version at its arrival in `turns`."""

    def __init__(self, tokenizer) -> None:
        super().__init__(max_model_len=4096)
        self.tokenizer = tokenizer
        self.turns: list[tuple[str, int, str]] = []

    def completion(self, prompt: list[int]) -> list[int]:
        text = self.tokenizer.decode(prompt)
        turn = text.count("<|im_start|>assistant")
        self.turns.append((re.search(r"row \d+", text).group(), turn, self.version))
        return self.tokenizer.encode(CALL if turn == 1 else ANSWER, add_special_tokens=False)


@pytest.fixture
def scripted(tiny_model_dir):
    from transformers import AutoTokenizer

    server = Scripted(AutoTokenizer.from_pretrained(tiny_model_dir))
    yield server
    server.close()


@pytest.mark.long  # 10-20 s on 2 cores: the tools' schemas make every prompt long
def test_every_turn_of_a_batch_sampled_ahead_comes_under_the_version_it_is_stamped_with(
    scripted, tiny_model_dir, tmp_path
):
    module = tiny_module(
        tiny_model_dir,
        reward_funcs=[length_reward],
        module_options={"tools": [calculator]},
        max_completion_length=200,
        vllm_mode="server",
        vllm_server_base_url=scripted.url,
        vllm_server_weights_dir=str(tmp_path / "pushes"),
        max_staleness=1,
    )
    stamps: dict[str, int] = {}  # each trained row: the version its groups are stamped with
    source_next = module.group_source.next

    def next_groups(batch, state):
        groups = source_next(batch, state)
        for prompt in [] if groups is None else groups.prompts:
            stamps[re.search(r"row \d+", prompt[-1]["content"]).group()] = groups.policy_version
        return groups

    module.group_source.next = next_groups
    rows = [
        {"prompt": [{"role": "user", "content": f"What is 6 times 7? (row {i})"}], "answer": "42"}
        for i in range(10)
    ]
    data = PromptDataModule(
        source=Dataset.from_list(rows), batch_size=2, val_size=2, val_batch_size=2, seed=0
    )
    # Validation after every step: a push between the steps' own.
    trainer = quiet_trainer(
        default_root_dir=str(tmp_path), max_steps=3, val_check_interval=1, num_sanity_val_steps=0
    )
    trainer.fit(module, data)
    assert sorted(stamps.values()) == [0, 0, 0, 0, 1, 1], "the first 2 batches under the first weights"
    versions = {row: {v for r, _, v in scripted.turns if r == row} for row in stamps}
    later_turns = {row for row, turn, _ in scripted.turns if turn == 2}
    assert set(stamps) <= later_turns, "every trained sample went on after its tool turn"
    assert all(len(v) == 1 for v in versions.values()), versions  # every turn under one version
    served = {row: v.pop() for row, v in versions.items()}
    pairs = {(stamps[row], served[row]) for row in stamps}
    assert len(pairs) == len({s for s, _ in pairs}) == len({v for _, v in pairs}) == 2, pairs
    assert "val/accuracy" in trainer.callback_metrics
