"""Asynchronous rollouts against a real `vllm serve` process (one, started once for the module on 127.0.0.1,
of the tiny model with its LM head tied, LoRA enabled): `GRPOModule` with `max_staleness: 2` on the server
engine.

- Each group's version stamp is the weights it was sampled with: its sampler log-probs equal, within 1e-5,
  the scorer's under a copy of the policy kept at that version, and differ from the policy's when it trains
  on them (the check can fail).
- No group older than 2 optimizer steps reaches the loss, and the stale ones are corrected: the anchor is
  computed, and the importance weights are logged.
- A run checkpointed after 2 updates (its batch in flight waited for and saved) and resumed trains the
  straight run's prompts in the same order with the same staleness, across an epoch's end.
- Every prompt the data loader handed is trained once or still in flight at the end, none twice; also under
  2 gloo DDP ranks (`max_staleness: 1`), each submitting its own prompts, rank 0 alone pushing, the ranks'
  weights equal at the end.
- Validation between updates samples the current weights, not the version the batch in flight was sampled
  under; a LoRA policy's groups are sampled by the adapter of their version, and after the last update the
  server samples the last adapter.

The source: `core.async_group_source`; the engine: `core.generation.vllm_server`."""

from __future__ import annotations

import copy
import json
import os
import sys

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from grpo_lightning.core.async_group_source import AsyncGroupSource
from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.io.distributed import close_process_group
from grpo_lightning.io.models import LoraOptions
from grpo_lightning.training.data import GSM8KDataModule
from grpo_lightning.training.module import GRPOModule
from tests.helpers import arithmetic_data, digit_reward, length_reward, quiet_trainer
from tests.test_distributed import launch, strategy_for
from tests.vllm_backend.helpers import VersionStamps, running_servers


@pytest.fixture(scope="module")
def url(vllm_tied_dir) -> str:
    with running_servers(vllm_tied_dir, count=1, lora_rank=8) as servers:
        yield servers[0].url


def test_max_staleness_2_trains_each_prompt_once_on_groups_stamped_with_their_weights(url, vllm_tied_dir):
    torch.manual_seed(0)
    grpo = GRPOConfig(
        num_generations=2,
        max_prompt_length=64,
        max_completion_length=8,
        learning_rate=1e-2,
        preflight=False,
        log_completions_every=0,
        vllm_mode="server",
        vllm_server_base_url=url,
        vllm_server_timeout=30,
        max_staleness=2,
    )
    module = GRPOModule(vllm_tied_dir, reward_funcs=[digit_reward], grpo=grpo)
    assert isinstance(module.group_source, AsyncGroupSource)
    stamps = VersionStamps(module)
    trainer = quiet_trainer(max_steps=4, limit_val_batches=0, callbacks=[stamps])
    trainer.fit(module, arithmetic_data(20))
    assert trainer.global_step == 4
    seen = stamps.updates
    assert [s.staleness for s in seen] == [0, 1, 2, 2], "the pipeline fills, then every batch is 2 steps old"
    assert max(s.then for s in seen) < 1e-5, [
        s.then for s in seen
    ]  # sampled by the version it is stamped with
    assert min(s.now for s in seen[1:]) > 1e-4, "a stale batch is not the policy's: the check can fail"
    assert [s.anchored for s in seen] == [False, True, True, True], "the stale batches' anchor is computed"
    metrics = trainer.callback_metrics
    assert float(metrics["train/async/staleness_max"]) == 2
    assert "rollout/is_weight_mean" in metrics and "rollout/is_weight_max" in metrics
    trained = [p for s in seen for p in s.prompts]
    in_flight = [str(p) for e in module.group_source.in_flight for p in e.batch["prompt"]]
    assert len(trained) == len(set(trained)) == 8, "each prompt trained once"
    assert sorted(trained + in_flight) == sorted(stamps.handed), "none lost: the rest wait in flight"
    assert sorted(stamps.weights) == [0, 1, 2, 3], "3 batches under the first weights, 1 after each update"
    assert module.rollouts.engine.refreshes == 4, "one push per version sampled under, the first included"


def staleness_1_config(url: str, **options) -> GRPOConfig:
    """`max_staleness: 1` against the server at `url`: 2 samples of 4 tokens per prompt, `options` over."""
    defaults = dict(num_generations=2, max_prompt_length=64, max_completion_length=4, learning_rate=1e-2)
    return GRPOConfig(
        **{**defaults, **options},
        preflight=False,
        log_completions_every=0,
        vllm_mode="server",
        vllm_server_base_url=url,
        vllm_server_timeout=30,
        max_staleness=1,
    )


def moving_config(url: str) -> GRPOConfig:
    """`staleness_1_config` whose every update moves the weights: groups of 4 whose lengths differ (with
    `length_reward`), and weight decay."""
    return staleness_1_config(url, num_generations=4, weight_decay=0.1)


def sampled_gap(module: GRPOModule, model, rollout) -> float:
    """The largest |sampler - scorer| log-prob of `rollout` under `model`, on its completion tokens."""
    with torch.no_grad():
        logprobs = module.rollouts.scorer(model, rollout, slice(None))[0]
    mask = rollout.completion_mask.bool()
    return float((rollout.sampler_logprobs - logprobs)[mask].abs().max())


def test_validation_between_updates_samples_the_current_weights(url, vllm_tied_dir):
    torch.manual_seed(0)
    module = GRPOModule(
        vllm_tied_dir, reward_funcs=[length_reward], grpo=moving_config(url), num_generations_eval=2
    )
    stamps = VersionStamps(module)
    validated = []  # per validation: the step, the gap to the policy now, to the version before
    sample = module.rollouts.sample

    def recorded(prompts, num_generations, do_sample=True):
        rollout, completions = sample(prompts, num_generations, do_sample)
        step = module.trainer.global_step
        earlier = copy.deepcopy(module.policy)
        earlier.load_state_dict(stamps.weights[max(0, step - 1)])
        validated.append(
            (step, sampled_gap(module, module.policy, rollout), sampled_gap(module, earlier, rollout))
        )
        return rollout, completions

    module.rollouts.sample = recorded  # what validation samples with (training submits batches instead)
    trainer = quiet_trainer(
        max_steps=3, val_check_interval=1, limit_val_batches=1, num_sanity_val_steps=0, callbacks=[stamps]
    )
    trainer.fit(module, arithmetic_data(20))
    assert [u.staleness for u in stamps.updates] == [0, 1, 1]
    assert [v[0] for v in validated] == [0, 1, 2, 3], "after each training step, the filling one included"
    assert max(v[1] for v in validated) < 1e-5, validated  # the policy as it is when validation runs
    assert min(v[2] for v in validated[1:]) > 1e-4, "the version before differs: the check can fail"
    assert "val/accuracy" in trainer.callback_metrics


def test_a_lora_policy_samples_ahead_with_each_versions_adapter(url, vllm_tied_dir):
    torch.manual_seed(0)
    lora = LoraOptions(r=4, alpha=8, target_modules=["q_proj", "v_proj", "up_proj"])
    module = GRPOModule(vllm_tied_dir, reward_funcs=[length_reward], grpo=moving_config(url), lora=lora)
    stamps = VersionStamps(module)
    trainer = quiet_trainer(max_steps=3, limit_val_batches=0, callbacks=[stamps])
    trainer.fit(module, arithmetic_data(20))
    seen = stamps.updates
    assert [u.staleness for u in seen] == [0, 1, 1]
    assert max(u.then for u in seen) < 1e-5, [u.then for u in seen]  # each group: its version's adapter
    assert min(u.now for u in seen[1:]) > 1e-4, "a stale batch is not the policy's: the check can fail"
    engine = module.rollouts.engine
    assert type(engine.plane).__name__ == "LoRAPlane" and engine.refreshes == 3
    rollout, _ = module.rollouts.sample(["1 + 2 =", "3 + 4 ="], 2)  # the adapter after the last step
    assert engine.refreshes == 4 and sampled_gap(module, module.policy, rollout) < 1e-5
    first = copy.deepcopy(module.policy)
    first.load_state_dict(stamps.weights[0])
    assert sampled_gap(module, first, rollout) > 1e-4, "the first adapter differs: the check can fail"


def staleness_1_fit(vllm_tied_dir, url, max_steps, save_dir=None, ckpt_path=None) -> list[tuple]:
    """`max_steps` updates at `max_staleness: 1` on 6 problems (3 batches an epoch); each update's (prompts,
    staleness)."""
    L.seed_everything(0)
    module = GRPOModule(vllm_tied_dir, reward_funcs=[digit_reward], grpo=staleness_1_config(url))
    updates = []
    source_next = module.group_source.next

    def next_groups(batch, state):
        groups = source_next(batch, state)
        if groups is not None:
            updates.append((list(map(str, groups.prompts)), state.global_step - groups.policy_version))
        return groups

    module.group_source.next = next_groups
    data = GSM8KDataModule(
        source="arithmetic", system_prompt=None, arithmetic_size=20, batch_size=2, train_size=6, val_size=2
    )
    saving = [ModelCheckpoint(dirpath=save_dir, every_n_train_steps=max_steps)] if save_dir else []
    trainer = quiet_trainer(
        max_steps=max_steps, limit_val_batches=0, enable_checkpointing=bool(saving), callbacks=saving
    )
    trainer.fit(module, data, ckpt_path=ckpt_path)
    assert trainer.global_step == max_steps
    return updates


def test_a_resumed_run_trains_the_straight_run_s_prompts_with_the_same_staleness(
    url, vllm_tied_dir, tmp_path
):
    straight = staleness_1_fit(vllm_tied_dir, url, 4)
    first = staleness_1_fit(vllm_tied_dir, url, 2, save_dir=str(tmp_path))
    resumed = staleness_1_fit(vllm_tied_dir, url, 4, ckpt_path=str(tmp_path / "epoch=0-step=2.ckpt"))
    assert [u[1] for u in straight] == [0, 1, 1, 1]
    assert first + resumed == straight, "the saved batch in flight is trained first, nothing twice"


def train_on_rank(cfg: dict) -> None:
    """3 updates of `max_staleness: 1` on this rank; writes `rank<r>.json`: the prompts handed, trained and
    in flight, each update's staleness, the pushes and the weights' sum."""
    torch.manual_seed(0)
    grpo = GRPOConfig(
        num_generations=2,
        max_prompt_length=64,
        max_completion_length=4,
        learning_rate=1e-2,
        preflight=False,
        log_completions_every=0,
        generation_backend="vllm_server",
        vllm_server_base_url=cfg["url"],
        vllm_server_timeout=30,
        max_staleness=1,
    )
    module = GRPOModule(cfg["model"], reward_funcs=[digit_reward], grpo=grpo)
    handed, trained, staleness = [], [], []
    source_next = module.group_source.next

    def next_groups(batch, state):
        handed.extend(map(str, batch["prompt"]))
        groups = source_next(batch, state)
        if groups is not None:
            trained.extend(map(str, groups.prompts))
            staleness.append(state.global_step - groups.policy_version)
        return groups

    module.group_source.next = next_groups
    trainer = quiet_trainer(strategy=strategy_for(cfg), devices=2, max_steps=3, limit_val_batches=0)
    trainer.fit(module, arithmetic_data(16))
    engine = module.rollouts.engine
    record = {
        "handed": handed,
        "trained": trained,
        "in_flight": [str(p) for e in module.group_source.in_flight for p in e.batch["prompt"]],
        "staleness": staleness,
        "pushes": engine.refreshes,
        "pushed": engine.plane is not None,
        "weights": sum(float(p.double().sum()) for p in module.policy.parameters()),
    }
    close_process_group()
    with open(os.path.join(cfg["out"], f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(record, f)


def test_two_ddp_ranks_train_every_prompt_once(url, vllm_tied_dir, tmp_path):
    cfg = {"strategy": "ddp", "devices": 2, "model": vllm_tied_dir, "url": url, "out": str(tmp_path)}
    launch(cfg, timeout=400, script=__file__)
    records = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    for record in records:
        assert record["staleness"] == [0, 1, 1], record["staleness"]
        assert record["pushes"] == 3, "the first weights and one push after each of the first 2 updates"
        assert len(record["trained"]) == len(set(record["trained"])) == 6
        assert sorted(record["trained"] + record["in_flight"]) == sorted(record["handed"]), "none lost"
    assert [r["pushed"] for r in records] == [True, False], "rank 0 alone talks to the server"
    assert not set(records[0]["trained"]) & set(records[1]["trained"]), "each rank its own prompts"
    assert records[0]["weights"] == records[1]["weights"], "the ranks hold the same weights"


if __name__ == "__main__":
    train_on_rank(json.loads(sys.argv[1]))
