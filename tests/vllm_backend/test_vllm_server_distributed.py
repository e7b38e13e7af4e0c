"""The server engine under 2 CPU processes (gloo), DDP and FSDP2, against one `vllm serve` process: each
rank's rollouts sample the weights of their moment (the sampler's log-probs are the scorer's on every rank),
rank 0 alone pushes (the other rank reads the weights with it, FSDP2's gathers in lock-step, and waits), the
server ends on rank 0's last push, and the ranks hold the same weights after 2 steps; a push that fails on
rank 0 ends both ranks, each with one line.
Each strategy is one launch of this file as a script (`tests.test_distributed.launch`)."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.generation.vllm_client import ServerError, VLLMServer
from grpo_lightning.core.generation.vllm_push import DiskPlane
from grpo_lightning.io.distributed import close_process_group
from tests.helpers import arithmetic_data, digit_reward, quiet_trainer
from tests.test_distributed import launch, strategy_for
from tests.vllm_backend.helpers import running_servers
from tests.vllm_backend.test_vllm_module import CheckedModule


def train_on_rank(cfg: dict) -> None:
    """2 steps on this rank, every rollout checked (`CheckedModule`); writes `rank<r>.json`."""
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
    )
    module = CheckedModule(cfg["model"], reward_funcs=[digit_reward], grpo=grpo)
    trainer = quiet_trainer(strategy=strategy_for(cfg), devices=2, max_steps=2, limit_val_batches=0)
    if cfg["fail_push"]:  # rank 0's second push fails as a server that stopped answering would
        pushes, push = [], DiskPlane.push

        def failing(plane, weights, version):
            pushes.append(version)
            if len(pushes) == 2:
                list(weights)  # read in step with the other rank, as a real push reads them
                raise ServerError(f"vLLM server {cfg['url']}: POST /collective_rpc failed: stopped")
            return push(plane, weights, version)

        DiskPlane.push = failing
        try:
            trainer.fit(module, arithmetic_data(16))
        except ServerError as err:
            with open(os.path.join(cfg["out"], f"rank{trainer.global_rank}.json"), "w") as f:
                json.dump({"error": str(err), "step": trainer.global_step}, f)
        return
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
        "pushed": engine.plane is not None,
        "version": f"policy-{engine.run_id}-{engine.refreshes}",
        "weights": weights,
        "rank": trainer.global_rank,
    }
    close_process_group()
    with open(os.path.join(cfg["out"], f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(record, f)


@pytest.fixture(scope="module")
def server_url(vllm_tied_dir):
    with running_servers(vllm_tied_dir) as servers:
        yield servers[0].url


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_sample_rank_0s_pushes(strategy, server_url, vllm_tied_dir, tmp_path):
    cfg = {
        "strategy": strategy,
        "devices": 2,
        "model": vllm_tied_dir,
        "url": server_url,
        "out": str(tmp_path),
        "fail_push": False,
    }
    launch(cfg, timeout=400, script=__file__)
    records = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    for record in records:
        assert record["rollouts"] == 3 and record["pushes"] == 3, record
    assert [r["pushed"] for r in records] == [True, False], "rank 0 alone talks to the server"
    assert VLLMServer(server_url, 10).get("/weight_info")["weight_version"] == records[0]["version"]
    assert records[0]["weights"] == records[1]["weights"], "the ranks hold the same weights"


def test_a_failed_push_on_rank_0_ends_every_rank_in_one_line(server_url, vllm_tied_dir, tmp_path):
    cfg = {"strategy": "ddp", "devices": 2, "model": vllm_tied_dir, "url": server_url, "out": str(tmp_path)}
    cfg["fail_push"] = True
    launch(cfg, timeout=400, script=__file__)
    records = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    assert records[0] == {
        "error": f"vLLM server {server_url}: POST /collective_rpc failed: stopped",
        "step": 1,
    }
    assert records[1] == {
        "error": "rank 0's push of the weights to the vLLM servers failed (its error says why)",
        "step": 1,
    }, "the other rank ends too, rather than wait at its next collective"


if __name__ == "__main__":
    train_on_rank(json.loads(sys.argv[1]))
