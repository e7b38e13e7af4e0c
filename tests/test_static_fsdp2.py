"""The static engine under FSDP2: the module on one gloo rank under `bf16-mixed`, its copy equal to the
trained shards gathered; and two gloo ranks, without and with LoRA, whose copy, refreshed one FSDP2 unit at
a time, equals the gathered weights and never has more than one unit unsharded beside it.

The two-rank test runs this file as a script (`python tests/test_static_fsdp2.py '<json>'`), which spawns
two gloo ranks.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from grpo_lightning.core.generation.logprobs import completion_logprobs
from grpo_lightning.io.distributed import (
    call_in_root_forward,
    close_process_group,
    full_weights_by_unit,
    gathered_for_generation,
    shard_model,
)
from grpo_lightning.io.models import LoraOptions, apply_lora
from tests.helpers import arithmetic_data, quiet_trainer, static_module
from tests.test_static_engine import engine, prompts, tiny


def test_fsdp2_module_generates_on_a_copy_of_the_trained_weights(tiny_model_dir):
    """The module under FSDP2 (one gloo rank) and bf16-mixed: the copy is bf16 (FSDP2 gathers every weight in
    bf16, as the scorer computes with them) and, refreshed after two optimizer steps, equals the float32
    shards gathered and cast."""
    module = static_module(tiny_model_dir, max_completion_length=4)
    data = arithmetic_data(20)
    strategy = ModelParallelStrategy(
        data_parallel_size=1, tensor_parallel_size=1, process_group_backend="gloo"
    )
    trainer = quiet_trainer(
        max_steps=2, strategy=strategy, devices=1, precision="bf16-mixed", limit_val_batches=0
    )
    try:
        trainer.fit(module, data)
        module.rollouts.engine.refresh(module.policy, torch.device("cpu"))  # the last step's weights
        weights = {n: v.full_tensor() for n, v in module.policy.named_parameters()}
    finally:
        close_process_group()
    copy = dict(module.rollouts.engine.copy.model.named_parameters())
    assert set(copy) == set(weights)
    for name, value in weights.items():
        assert copy[name].dtype == torch.bfloat16
        assert torch.equal(copy[name], value.to(torch.bfloat16)), name


def fsdp_rank(rank: int, cfg: dict) -> None:
    """One of two gloo ranks: a sharded tiny policy (bf16 all-gathers, as `bf16-mixed`), without and with
    LoRA, two optimizer steps on rank-specific data each, the copy refreshed unit by unit after each."""
    dist.init_process_group("gloo", init_method=f"file://{cfg['out']}/store", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    records = {}
    for lora in (False, True):
        model = tiny()
        if lora:
            model = apply_lora(model, LoraOptions(r=4, alpha=8))
        shard_model(model, mesh, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
        records["lora" if lora else "full"] = fsdp_steps(model, rank)
    with open(os.path.join(cfg["out"], f"rank{rank}.json"), "w") as f:
        json.dump(records, f)
    dist.barrier()
    dist.destroy_process_group()
    # DTensor's sharding caches still hold the mesh, so the gloo group and its threads outlive
    # `destroy_process_group` (no `del` or `gc.collect()` frees them); a rank tearing down its interpreter
    # with them running can abort ("terminate called without an active exception") after the results
    # above are written. The rank ends here instead, as multiprocessing ends a forked child.
    sys.stdout.flush()
    os._exit(0)


def fsdp_steps(model: torch.nn.Module, rank: int) -> dict:
    """Rollouts on the copy, each followed by an optimizer step; the copy refreshed from the weights one
    FSDP2 unit gathered at a time, counting the weights unsharded at once while it does."""
    rollouts = engine(weights=UnitCounter(full_weights_by_unit))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-2)
    ids, mask = prompts(2, seed=rank)
    record = {"max_difference": [], "moved": [], "most_gathered": 0}
    for _ in range(2):
        rollout = rollouts.generate(model, ids, mask, num_generations=2)  # no gathering around it
        T = rollout.completion_ids.size(1)
        logprobs, _ = call_in_root_forward(
            model, completion_logprobs, model, rollout.input_ids, rollout.attention_mask, T
        )
        (-(logprobs * rollout.completion_mask).sum()).backward()
        optimizer.step()
        optimizer.zero_grad()
        rollouts.weights_changed()
        before = {n: p.clone() for n, p in rollouts.copy.model.named_parameters()}
        rollouts.refresh(model, torch.device("cpu"))
        copy = dict(rollouts.copy.model.named_parameters())
        with torch.no_grad(), gathered_for_generation(model):
            inner = model.get_base_model() if hasattr(model, "get_base_model") else model
            gathered = dict(inner.named_parameters())
            assert not any(isinstance(v, DTensor) for v in gathered.values())
            difference = max(
                (copy[n].float() - v.to(copy[n].dtype).float()).abs().max() for n, v in gathered.items()
            )
            record["max_difference"].append(difference.item())
        record["moved"].append(sum(not torch.equal(before[n], copy[n]) for n in copy) / len(copy))
        record["dtype"] = str(next(iter(copy.values())).dtype)
    record["most_gathered"] = rollouts.weights.most
    record["largest_unit"] = largest_unit(model)
    record["all"] = sum(p.numel() for p in model.parameters())
    return record


class UnitCounter:
    """A weight source that records the most weight elements unsharded at any one time while it runs."""

    def __init__(self, source) -> None:
        self.source, self.most = source, 0

    def __call__(self, model):
        for name, value in self.source(model):
            unsharded = sum(p.numel() for p in model.parameters() if not isinstance(p, DTensor))
            self.most = max(self.most, unsharded)
            yield name, value


def largest_unit(model) -> int:
    layers = model.get_decoder().layers
    per_layer = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    return max(sum(p.numel() for p in model.parameters()) - sum(per_layer), *per_layer)


@pytest.mark.long
def test_fsdp2_copy_equals_the_gathered_weights_on_every_rank(tmp_path):
    from tests.test_distributed import launch

    launch({"out": str(tmp_path), "strategy": "fsdp2 static rollout"}, timeout=180, script=__file__)
    for rank in range(2):
        records = json.load(open(tmp_path / f"rank{rank}.json"))
        for variant, moving in (("full", 0.9), ("lora", 0.3)):  # LoRA: its B (and A) tensors only
            record = records[variant]
            assert record["dtype"] == "torch.bfloat16"
            assert record["max_difference"] == [0.0, 0.0], (rank, variant, record)
            assert all(share > moving for share in record["moved"]), (rank, variant, record)
            # Refreshing never gathers more than one unit: no second full model beside the copy.
            assert 0 < record["most_gathered"] <= record["largest_unit"] < record["all"], record


if __name__ == "__main__":
    torch.multiprocessing.spawn(fsdp_rank, args=(json.loads(sys.argv[1]),), nprocs=2)
