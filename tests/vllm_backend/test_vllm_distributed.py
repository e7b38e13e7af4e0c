"""vLLM on 2 CPU processes (gloo) under DDP and FSDP2: an engine on each rank joins the trainer's process
group, each rank's rollouts sample the weights of their moment (pushed once per rollout; under FSDP2 one
unit gathered at a time), the ranks hold the same weights after 2 steps, their engines' seeds differ, and
the engines close before the group. Under DDP the ranks are launched as SLURM launches them (no
`LOCAL_RANK`, `SLURM_LOCALID` set) and each engine's worker takes its rank's local index; under FSDP2 with
LoRA the pushes after the first gather no unit (the adapter's tensors alone).
Each strategy is one launch of this file as a script (`tests.test_distributed.launch`)."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from lightning.pytorch import Callback
from torch.distributed.fsdp import FSDPModule

from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.generation.vllm_engine import VLLMEngine
from grpo_lightning.io.distributed import close_process_group
from grpo_lightning.io.models import LoraOptions
from tests.helpers import arithmetic_data, digit_reward, quiet_trainer
from tests.test_distributed import launch, strategy_for
from tests.vllm_backend.test_vllm_module import CheckedModule


class SlurmLaunched(Callback):
    """Each rank's environment as `srun` leaves it: `SLURM_LOCALID`, no `LOCAL_RANK` (before any engine
    starts)."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        local = trainer.local_rank  # Lightning reads it from `LOCAL_RANK`
        os.environ.pop("LOCAL_RANK", None)
        os.environ["SLURM_LOCALID"] = str(local)


def train_on_rank(cfg: dict) -> None:
    """2 steps on this rank, every rollout checked (`CheckedModule`); writes `rank<r>.json`."""
    torch.manual_seed(0)
    grpo = GRPOConfig(
        num_generations=2,
        max_completion_length=4,
        learning_rate=1e-2,
        preflight=False,
        log_completions_every=0,
        generation_backend="vllm",
        vllm_kv_cache_gb=0.05,
        vllm_enforce_eager=True,
    )
    lora = LoraOptions(r=4, alpha=8, target_modules=["q_proj", "v_proj"]) if cfg["lora"] else None
    module = CheckedModule(cfg["model"], reward_funcs=[digit_reward], grpo=grpo, lora=lora)
    unshards, unshards_per_push = [0], []
    unshard, push = FSDPModule.unshard, VLLMEngine._push

    def counted_unshard(unit, *args, **kwargs):
        unshards[0] += 1
        return unshard(unit, *args, **kwargs)

    def counted_push(engine, model):
        before = unshards[0]
        push(engine, model)
        unshards_per_push.append(unshards[0] - before)

    FSDPModule.unshard, VLLMEngine._push = counted_unshard, counted_push
    callbacks = [SlurmLaunched()] if cfg["slurm"] else []
    trainer = quiet_trainer(
        strategy=strategy_for(cfg), devices=2, max_steps=2, limit_val_batches=0, callbacks=callbacks
    )
    trainer.fit(module, arithmetic_data(16))
    module.rollouts.sample(["1 + 1 =", "2 + 3 ="], 2)  # checked: the last step's weights
    engine = module.rollouts.engine
    weights = sum(
        float(p.full_tensor().double().sum()) if hasattr(p, "full_tensor") else float(p.double().sum())
        for p in module.policy.parameters()
    )
    record = {
        "rollouts": module.rollouts_sampled,
        "pushes": engine.refreshes,
        "weights": weights,
        "seed": engine.llm.llm_engine.vllm_config.model_config.seed,
        "local_rank": engine.llm.collective_rpc(lambda worker: worker.local_rank)[0],
        "rank": trainer.global_rank,
        "unshards_per_push": unshards_per_push,
    }
    close_process_group()
    record["closed"] = engine.llm is None
    with open(os.path.join(cfg["out"], f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(record, f)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "fsdp-lora"])
def test_two_ranks_sample_their_pushed_weights(strategy, vllm_model_dir, tmp_path):
    cfg = {
        "strategy": strategy.removesuffix("-lora"),
        "lora": strategy.endswith("-lora"),
        "slurm": strategy == "ddp",
        "devices": 2,
        "model": vllm_model_dir,
        "out": str(tmp_path),
    }
    launch(cfg, timeout=400, script=__file__)
    records = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    for record in records:
        assert record["rollouts"] == 3 and record["pushes"] == 3 and record["closed"], record
    assert records[0]["weights"] == records[1]["weights"], "the ranks hold the same weights"
    assert records[0]["seed"] != records[1]["seed"], "each rank's engine draws its own completions"
    assert [r["local_rank"] for r in records] == [0, 1], "each engine on its rank's device"
    if strategy == "fsdp-lora":
        for record in records:
            first, *later = record["unshards_per_push"]
            assert first > 0 and later == [0, 0], f"units gathered per push: {record['unshards_per_push']}"


if __name__ == "__main__":
    train_on_rank(json.loads(sys.argv[1]))
