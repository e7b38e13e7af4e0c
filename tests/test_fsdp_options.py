"""FSDP2 with 2 gloo processes on CPU: reference sync mixes the local shards into exactly the closed-form
mixture, CPU offload (FSDP2's CPUOffloadPolicy; on CPU without pinned memory) trains the same weights as
without it, and each rank holds the shard sizes the memory estimate gives. Both runs are made in the
distributed tests' one launch of 2 processes (`two_rank_jobs` below and tests/two_ranks.py)."""

import json
import os

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import CPUOffloadPolicy

from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.memory import estimate_memory, footprint
from grpo_lightning.training.data import GSM8KDataModule
from grpo_lightning.training.module import GRPOModule
from tests.test_distributed import full_weights
from tests.test_reference_sync import ALPHA, syncing_config
from tests.test_resume import length_reward

STEPS = 3


def full_reference(module: GRPOModule) -> dict[str, torch.Tensor]:
    return {name: p.full_tensor().detach().clone() for name, p in module.reference.named_parameters()}


def local_bytes(tensors) -> int:
    return sum(
        t.to_local().numel() * t.element_size() if hasattr(t, "to_local") else t.numel() * t.element_size()
        for t in tensors
    )


def fit_and_record(cfg: dict) -> None:
    os.makedirs(cfg["out"], exist_ok=True)

    class Recorded(GRPOModule):
        def on_train_batch_start(self, batch, batch_idx):
            before, policy = full_reference(self), full_weights(self)  # collectives: every rank
            super().on_train_batch_start(batch, batch_idx)  # applies the sync due
            after = full_reference(self)
            self.worst = max(
                [self.worst]
                + [
                    float((after[n] - (ALPHA * policy[n] + (1 - ALPHA) * before[n])).abs().max())
                    for n in after
                ]
            )
            self.moved += sum(float((after[n] - before[n]).abs().sum()) for n in after)

    L.seed_everything(0)
    grpo = syncing_config(num_generations=2, max_completion_length=5, cpu_offload=cfg["offload"])
    module = Recorded(cfg["model"], reward_funcs=[length_reward], grpo=grpo)
    module.worst, module.moved = 0.0, 0.0
    data = GSM8KDataModule(
        source="arithmetic", system_prompt=None, arithmetic_size=20, batch_size=2, val_size=2
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(
            data_parallel_size=2, tensor_parallel_size=1, process_group_backend="gloo"
        ),
        max_steps=STEPS,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, data)

    policy = module.policy
    group = policy._get_fsdp_state()._fsdp_param_group  # the root unit's
    trainable = [p for p in policy.parameters() if p.requires_grad]
    optimizer_state = [t for s in trainer.optimizers[0].state.values() for t in s.values()]
    estimate = estimate_memory(
        footprint(policy), world=2, sharded=True, cpu_offload=cfg["offload"], reference=True
    )
    held = estimate.cpu if cfg["offload"] else estimate.gpu
    record = {
        "offloaded": isinstance(group.offload_policy, CPUOffloadPolicy),
        "worst": module.worst,
        "moved": module.moved,
        "syncs": module.reference_sync.syncs_done,
        "measured": {
            "weights": local_bytes(policy.parameters()),
            "gradients": local_bytes(p.grad for p in trainable),
            "optimizer": local_bytes(optimizer_state),
            "reference": local_bytes(module.reference.parameters()),
        },
        "estimate": {key: held[key] for key in ("weights", "gradients", "optimizer", "reference")},
        # Sharding splits each tensor's first dimension: a rank may hold one row more than the even share.
        "row_bytes": sum(p.numel() // p.size(0) * p.element_size() for p in policy.parameters()),
    }
    weights = full_weights(module)
    if trainer.global_rank == 0:
        torch.save(weights, os.path.join(cfg["out"], "final.pt"))
    with open(os.path.join(cfg["out"], f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(record, f)


def two_rank_jobs(model: str, out: str) -> list[dict]:
    """This file's runs in the launch of tests/two_ranks.py: with CPU offload, then without."""
    return [
        {
            "call": "tests.test_fsdp_options:fit_and_record",
            "cfg": {
                "strategy": "fsdp",
                "model": model,
                "out": os.path.join(out, name),
                "offload": name == "offload",
            },
        }
        for name in ("offload", "plain")
    ]


def test_sync_offload_and_shard_sizes_under_fsdp2(tiny_model_dir, two_rank_runs):
    out = os.path.join(two_rank_runs, "test_fsdp_options")
    offloaded, plain = (
        [json.load(open(os.path.join(out, name, f"rank{rank}.json"))) for rank in range(2)]
        for name in ("offload", "plain")
    )
    assert [r["offloaded"] for r in offloaded] == [True, True] and not plain[0]["offloaded"]
    for record in offloaded + plain:
        assert record["syncs"] == STEPS - 1  # the last step's sync waits for a rollout that never comes
        assert record["moved"] > 1e-3, "the reference never moved: the comparison would be empty"
        assert record["worst"] < 1e-6  # local shards mixed == the whole tensors mixed
    # Offloading changes where the states live, not the numbers.
    expected = torch.load(os.path.join(out, "plain", "final.pt"))
    for name, value in torch.load(os.path.join(out, "offload", "final.pt")).items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=name)
    # Each rank holds about half of every state, and the two halves are the whole.
    for key in ("weights", "gradients", "optimizer", "reference"):
        assert sum(r["measured"][key] for r in plain) >= 2 * plain[0]["estimate"][key]
        for record in plain:
            assert abs(record["measured"][key] - record["estimate"][key]) <= record["row_bytes"] * 3, key
    whole = footprint_weight_bytes(tiny_model_dir)
    assert sum(r["measured"]["weights"] for r in plain) == whole


def footprint_weight_bytes(model_dir: str) -> int:
    from transformers import AutoModelForCausalLM

    return footprint(AutoModelForCausalLM.from_pretrained(model_dir)).weight_bytes


def test_offload_without_fsdp2_is_refused_before_weights_load(tiny_model_dir, monkeypatch):
    import grpo_lightning.training.module as module_file

    monkeypatch.setattr(module_file, "load_model", lambda *args: pytest.fail("weights loaded"))
    module = GRPOModule(tiny_model_dir, grpo=GRPOConfig(cpu_offload=True))
    with pytest.raises(
        ValueError, match="^grpo.run.cpu_offload needs FSDP2: set trainer.strategy to ModelParallel"
    ):
        module.configure_model()
