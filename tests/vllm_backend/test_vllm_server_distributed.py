"""The server engine under 2 CPU processes (gloo), DDP and FSDP2, against one `vllm serve` process: each
rank's rollouts sample the weights of their moment (the sampler's log-probs are the scorer's on every rank),
rank 0 alone pushes (the other rank reads the weights with it, FSDP2's gathers in lock-step, and waits), the
server ends on rank 0's last push, and the ranks hold the same weights after 2 steps. Never a hang: a push
that fails on rank 0, and a server killed while one rank's rollout is done and the other's is not, each end
both ranks at the same point with the same one line naming the server and the call, and a checkpoint of the
last completed step.
Each run is one launch of this file as a script (`tests.test_distributed.launch`)."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time

import pytest
import torch

from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.generation.vllm_client import ServerError, VLLMServer
from grpo_lightning.core.generation.vllm_push import DiskPlane
from grpo_lightning.core.generation.vllm_server import VLLMServerEngine
from grpo_lightning.core.ranks import AgreedFailure
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
    trainer = quiet_trainer(
        strategy=strategy_for(cfg), devices=2, max_steps=2, limit_val_batches=0, default_root_dir=cfg["out"]
    )
    failing = cfg.get("failing")
    if failing is not None:
        if failing == "push":
            fail_second_push(cfg)
        else:
            kill_in_second_rollout(cfg)
        try:
            trainer.fit(module, arithmetic_data(16))
        except Exception as err:  # what ended this rank, and when
            record = {"type": type(err).__name__, "error": str(err), "step": trainer.global_step}
            record["ended"] = time.time()
            with open(os.path.join(cfg["out"], f"rank{trainer.global_rank}.json"), "w") as f:
                json.dump(record, f)
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


def fail_second_push(cfg: dict) -> None:
    """Rank 0's second push fails as a server that stopped answering would."""
    pushes, push = [], DiskPlane.push

    def failing(plane, weights, version):
        pushes.append(version)
        if len(pushes) == 2:
            list(weights)  # read in step with the other rank, as a real push reads them
            raise ServerError(f"vLLM server {cfg['url']}: POST /collective_rpc failed: stopped")
        return push(plane, weights, version)

    DiskPlane.push = failing


def kill_in_second_rollout(cfg: dict) -> None:
    """In the second training rollout, rank 1 waits until rank 0's is in, then kills the server (its whole
    process group) and sends its own requests: rank 0 goes on to its step's collectives, rank 1's requests
    fail."""
    generate, calls = VLLMServerEngine.generate, []
    rank_0_done = os.path.join(cfg["out"], "rank0-sampled")

    def generate_then_kill(engine, *args, **kwargs):
        calls.append(None)
        rank = torch.distributed.get_rank()
        if len(calls) == 2 and rank == 1:
            deadline = time.monotonic() + 120
            while not os.path.exists(rank_0_done) and time.monotonic() < deadline:
                time.sleep(0.1)
            os.killpg(cfg["server_pid"], signal.SIGKILL)
            port = int(cfg["url"].rsplit(":", 1)[1])
            while time.monotonic() < deadline:  # until the server's socket is closed
                with socket.socket() as s:
                    if s.connect_ex(("127.0.0.1", port)) != 0:
                        break
                time.sleep(0.1)
            with open(os.path.join(cfg["out"], "killed"), "w") as f:
                f.write(str(time.time()))
        rollout = generate(engine, *args, **kwargs)
        if len(calls) == 2 and rank == 0:
            open(rank_0_done, "w").close()
        return rollout

    VLLMServerEngine.generate = generate_then_kill


@pytest.fixture(scope="module")
def server(vllm_tied_dir):
    with running_servers(vllm_tied_dir) as servers:
        yield servers[0]


@pytest.fixture(scope="module")
def server_url(server) -> str:
    return server.url


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_sample_rank_0s_pushes(strategy, server_url, vllm_tied_dir, tmp_path):
    cfg = {
        "strategy": strategy,
        "devices": 2,
        "model": vllm_tied_dir,
        "url": server_url,
        "out": str(tmp_path),
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
    cfg["failing"] = "push"
    launch(cfg, timeout=400, script=__file__)
    records = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    for record in records:  # the other rank ends too, rather than wait at its next collective
        assert record["type"] == AgreedFailure.__name__
        assert record["error"] == f"rank 0: vLLM server {server_url}: POST /collective_rpc failed: stopped"
        assert record["step"] == 1
    assert saved_step(tmp_path) == 1, "the checkpoint of the last completed step"


def saved_step(out) -> int:
    """The step of the checkpoint a run wrote when it stopped on an error."""
    checkpoint = torch.load(out / "checkpoints" / "interrupted.ckpt", map_location="cpu", weights_only=False)
    return checkpoint["global_step"]


def test_a_server_killed_mid_rollout_ends_every_rank_in_one_line(server, vllm_tied_dir, tmp_path):
    """Last: it kills the module's server. Rank 0's second rollout is in when rank 1's requests find the
    server gone: rank 1 fails, and rank 0, whose next collective rank 1 would never join, ends with it, both
    with rank 1's line, at once, after the checkpoint of step 1."""
    cfg = {"strategy": "ddp", "devices": 2, "model": vllm_tied_dir, "url": server.url, "out": str(tmp_path)}
    cfg.update(failing="kill", server_pid=server.process.pid)
    launch(cfg, timeout=400, script=__file__)
    killed = float((tmp_path / "killed").read_text())
    records = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    for record in records:
        assert record["type"] == AgreedFailure.__name__, record
        assert record["error"].startswith(f"rank 1: vLLM server {server.url}: POST /v1/completions failed: ")
        assert record["step"] == 1 and record["ended"] - killed < 60, record
    assert records[0]["error"] == records[1]["error"]
    assert saved_step(tmp_path) == 1


if __name__ == "__main__":
    train_on_rank(json.loads(sys.argv[1]))
