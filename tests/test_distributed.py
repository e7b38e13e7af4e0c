"""DDP and FSDP2 on CPU with 2 processes (gloo): no hang, global loss normalisation, sharded checkpoints.
Per-rank data and exact resume on the real data module: `tests/test_distributed_resume.py`.

The 2-process runs are made with the other distributed test files' in one launch (`two_rank_jobs` below;
`launch` and tests/two_ranks.py): a script that Lightning re-launches once per rank, started in its own
process group, the whole group killed on a timeout, so that a hung rank-1 child never outlives the test.

`fit_and_record` compares updates with one process: its first training step uses fixed rollouts
(completions and rewards a function of the prompt only) on a hand-sharded loader, so a 1-process run over 4
prompts and a 2-process run over 2 + 2 prompts see the same global batch and must make the same update.
Later steps sample for real, with a different completion length on each rank.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

from grpo_lightning.cli import build_cli
from grpo_lightning.core.algorithm.batches import micro_batches
from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.generation.logprobs import completion_logprobs
from grpo_lightning.core.rewards.verifiable import completion_text
from grpo_lightning.core.types import Rollout
from grpo_lightning.io.distributed import (
    call_in_root_forward,
    close_process_group,
    consolidate_checkpoint,
    gathered_for_generation,
    is_sharded,
    shard_model,
)
from grpo_lightning.io.export import export_policy
from grpo_lightning.io.models import LoraOptions, apply_lora
from grpo_lightning.io.rows import collate_rows
from grpo_lightning.training.callbacks.export_best import ExportBestCallback
from grpo_lightning.training.module import GRPOModule
from tests.helpers import quiet_trainer

NUM_ROWS = 8
NUM_GENERATIONS = 3
PROMPT_TOKENS = 6


# ----------------------------------------------------------------------------------------- worker
def fixed_reward(completions: list[str], **kwargs) -> list[float]:
    """A deterministic reward of the text alone, varied enough that groups have non-zero advantages."""
    return [float(len(completion_text(c)) % 5) for c in completions]


def _seed_of(text: str) -> int:
    return int(hashlib.sha256(text.encode()).hexdigest()[:8], 16)


def full_weights(module: GRPOModule) -> dict[str, torch.Tensor]:
    # full_tensor() is a collective: every rank calls it, in the same order.
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in module.policy.named_parameters()
    }


def strategy_for(cfg: dict):
    devices = cfg["devices"]
    return {
        "single": "auto",
        "ddp": "ddp",
        "fsdp": ModelParallelStrategy(
            data_parallel_size=devices, tensor_parallel_size=1, process_group_backend="gloo"
        ),
    }[cfg["strategy"]]


def fit_and_record(cfg: dict) -> None:
    out = cfg["out"]
    os.makedirs(out, exist_ok=True)

    class FixedFirstStep(GRPOModule):
        """Step 0: completions fixed by the prompt. Later steps: real sampling, length set by the rank."""

        def configure_optimizers(self):
            # Plain SGD: the update is -lr * gradient, so comparing updates compares gradients.
            sgd = torch.optim.SGD([p for p in self.policy.parameters() if p.requires_grad], lr=cfg["lr"])
            return [sgd], [torch.optim.lr_scheduler.ConstantLR(sgd, factor=1.0)]

        def on_fit_start(self):
            super().on_fit_start()
            self.real_sample, self.rollouts.sample = self.rollouts.sample, self.sample
            self.real_micro_batches, self.update.micro_batches = self.update.micro_batches, self.micro_batches

        def sample(self, prompts, num_generations, do_sample=True):
            if self.global_step > 0 or cfg.get("resume"):
                self.grpo.max_completion_length = 3 + 5 * self.global_rank
                rollout, completions = self.real_sample(prompts, num_generations, do_sample)
            else:
                vocab = len(self.tokenizer) - 3  # random ordinary tokens (ids 0-2 are the special ones)
                rows = []
                for prompt in prompts:
                    g = torch.Generator().manual_seed(_seed_of(prompt[-1]["content"]))
                    prompt_ids = torch.randint(3, vocab, (PROMPT_TOKENS,), generator=g)
                    for _ in range(num_generations):
                        length = int(torch.randint(2, 12, (1,), generator=g))
                        rows.append((prompt_ids, torch.randint(3, vocab, (length,), generator=g)))
                T = max(len(c) for _, c in rows)
                completion_ids = torch.full((len(rows), T), self.tokenizer.pad_token_id)
                completion_mask = torch.zeros(len(rows), T, dtype=torch.long)
                for i, (_, c) in enumerate(rows):
                    completion_ids[i, : len(c)], completion_mask[i, : len(c)] = c, 1
                prompt_ids = torch.stack([p for p, _ in rows])
                rollout = Rollout(
                    prompt_ids,
                    torch.ones_like(prompt_ids),
                    completion_ids,
                    completion_mask,
                    torch.zeros(len(rows), dtype=torch.bool),
                )
                completions = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
            self.record.setdefault("prompts", []).append([p[-1]["content"] for p in prompts])
            self.record.setdefault("tokens", []).append(int(rollout.completion_mask.sum()))
            self.record.setdefault("lengths", []).append(rollout.completion_ids.size(1))
            return rollout, completions

        def micro_batches(self, rollout):
            parts = self.real_micro_batches(rollout)
            if self.grpo.max_tokens_per_micro_batch is not None:  # this rank's own count, and the one run
                budget, group = self.grpo.max_tokens_per_micro_batch, self.grpo.num_generations
                own = len(micro_batches(rollout, None, budget, group if self.rollouts.shares_prompt else 1))
                self.record.setdefault("micro_batches", []).append([own, len(parts)])
            return parts

        def train_dataloader(self):
            # Rank r takes rows r, r + world, ...: 2 ranks x 2 prompts hold the 4 prompts of 1 rank x 4.
            rows = [
                {"question": f"What is {i} plus {i + 1}?", "answer": f"#### {2 * i + 1}"}
                for i in range(NUM_ROWS)
            ]
            return DataLoader(
                rows[self.global_rank :: self.trainer.world_size],
                batch_size=cfg["batch_size"],
                collate_fn=functools.partial(collate_rows, system_prompt=None),
            )

        def on_train_start(self):
            super().on_train_start()
            self.record["start_step"] = self.global_step
            if cfg.get("resume"):
                weights = full_weights(self)
                if self.global_rank == 0:
                    torch.save(weights, os.path.join(out, "resumed.pt"))

        def on_train_batch_start(self, batch, batch_idx):
            if self.global_step == 0 and not cfg.get("resume"):
                self.initial = full_weights(self)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.record.setdefault("losses", []).append(float(outputs["loss"]))
            if self.global_step == 1 and not cfg.get("resume"):
                weights = full_weights(self)
                if self.global_rank == 0:
                    update = {k: weights[k] - self.initial[k] for k in weights}
                    torch.save(update, os.path.join(out, "update.pt"))

    module = FixedFirstStep(
        cfg["model"],
        reward_funcs=[fixed_reward],
        grpo=GRPOConfig(
            num_generations=NUM_GENERATIONS,
            max_completion_length=8,
            beta=0.04,
            loss_type="dapo",
            max_grad_norm=None,
            preflight=False,
            share_prompt=cfg.get("share_prompt", True),
            max_tokens_per_micro_batch=cfg.get("max_tokens"),
        ),
    )
    module.record = {}
    trainer = quiet_trainer(
        devices=cfg["devices"],
        strategy=strategy_for(cfg),
        precision=cfg.get("precision", "32-true"),
        max_steps=cfg["steps"],
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,
    )
    trainer.fit(module, ckpt_path=cfg.get("resume"))
    if cfg.get("checkpoint"):
        trainer.save_checkpoint(cfg["checkpoint"])
    weights = full_weights(module)
    if trainer.global_rank == 0:
        torch.save(weights, os.path.join(out, "final.pt"))
    with open(os.path.join(out, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(module.record, f)


# ----------------------------------------------------------------------------------------- tests
@pytest.fixture
def one_process_group(tmp_path):
    """A gloo process group of world size 1 in this process: enough for fully_shard's code paths."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        close_process_group()


def test_close_process_group_frees_the_group_once(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    close_process_group()
    assert not dist.is_initialized()
    close_process_group()  # no group: nothing to do, no error
    assert not dist.is_initialized()


@pytest.mark.parametrize("lora", [False, True])
def test_sharded_logprobs_and_generation_match_the_plain_model(one_process_group, tiny_model_dir, lora):
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    sharded = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    if lora:
        plain, sharded = apply_lora(plain, LoraOptions(r=4)), apply_lora(sharded, LoraOptions(r=4))
        sharded.load_state_dict(plain.state_dict())
    shard_model(sharded, one_process_group)
    assert is_sharded(sharded) and not is_sharded(plain)
    ids = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(0))  # [B, L]
    mask = torch.ones_like(ids)

    # Calling the decoder directly skips the root's all-gather: its embedding weight is still a shard.
    with pytest.raises(RuntimeError, match="DTensor"):
        sharded.get_decoder()(input_ids=ids, attention_mask=mask)
    expected, _ = completion_logprobs(plain, ids, mask, 5)
    got, _ = call_in_root_forward(sharded, completion_logprobs, sharded, ids, mask, 5)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)

    # Gradients reach the trainable weights through the root's hooks, as in the plain model.
    call_in_root_forward(sharded, completion_logprobs, sharded, ids, mask, 5)[0].sum().backward()
    completion_logprobs(plain, ids, mask, 5)[0].sum().backward()
    grads = {n: p.grad for n, p in sharded.named_parameters() if p.requires_grad}
    for name, p in plain.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(grads[name].full_tensor(), p.grad, rtol=1e-4, atol=1e-6, msg=name)

    with torch.no_grad(), gathered_for_generation(sharded):
        assert not any(isinstance(p, DTensor) for p in sharded.parameters()), "inside: full weights"
        out = sharded.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert all(isinstance(p, DTensor) for p in sharded.parameters()), "after: resharded"
    with torch.no_grad():
        torch.testing.assert_close(
            out, plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        )


def test_export_best_names_the_command_for_a_sharded_policy(one_process_group, tiny_model_dir, tmp_path):
    module = GRPOModule(tiny_model_dir)
    module.configure_model()
    shard_model(module.policy, one_process_group)
    trainer = SimpleNamespace(
        checkpoint_callbacks=[], log_dir=None, default_root_dir=str(tmp_path), is_global_zero=True
    )
    with pytest.warns(UserWarning, match=r"sharded .* grpo-lightning export --config .* --out .*export"):
        ExportBestCallback().on_fit_end(trainer, module)
    assert not os.path.exists(tmp_path / "export"), "no half-written export of one shard"


DISTRIBUTED_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK")


def launch(cfg: dict, timeout: float = 120, script: str = __file__) -> None:
    """Run `script`'s worker in its own process group; kill the group (every rank) if it does not finish."""
    os.makedirs(cfg["out"], exist_ok=True)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # `tests.` imports in the workers
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    # A rendezvous of its own: an in-process FSDP2 test earlier in the session leaves MASTER_PORT set (and its
    # store listening), and workers inheriting it would fail with EADDRINUSE.
    env = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_ENV}
    # A rank that aborts in C++ prints its Python stack (every thread's) before it dies.
    env.update(
        {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": path, "PYTHONFAULTHANDLER": "1"}
    )
    proc = subprocess.Popen(
        [sys.executable, script, json.dumps(cfg)],
        start_new_session=True,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{cfg['strategy']} run hung for {timeout} s (process group killed):\n{output[-3000:]}")
    assert proc.returncode == 0, output[-5000:]


def records(out: str, devices: int = 2) -> list[dict]:
    """What `worker` wrote for a run into `out`, per rank."""
    return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(devices)]


@pytest.fixture(scope="module")
def single_run(tiny_model_dir, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("single"))
    fit_and_record(
        {
            "strategy": "single",
            "devices": 1,
            "batch_size": 4,
            "steps": 1,
            "lr": 0.05,
            "model": tiny_model_dir,
            "out": out,
            "share_prompt": False,  # the DDP and FSDP2 runs share each group's prompt: same update
        }
    )  # one process: no launch needed
    return out


def assert_same_update(single: str, distributed: str) -> None:
    expected = torch.load(os.path.join(single, "update.pt"))
    got = torch.load(os.path.join(distributed, "update.pt"))
    assert got.keys() == expected.keys()
    total = sum(float(u.abs().sum()) for u in expected.values())
    assert total > 1e-3, "the fixed rollout made no update: the comparison would be empty"
    for name, update in expected.items():
        torch.testing.assert_close(got[name], update, rtol=1e-4, atol=1e-7, msg=name)


def assert_ranks_differ(records: list[dict]) -> None:
    # Step 0: fixed rollouts with a different number of tokens per rank (a mean of per-rank means would
    # weight them differently from the global token mean). Later steps: different generated lengths.
    assert records[0]["tokens"][0] != records[1]["tokens"][0]
    assert records[0]["lengths"][1:] == [3] * (len(records[0]["lengths"]) - 1)
    assert records[1]["lengths"][1:] == [8] * (len(records[1]["lengths"]) - 1)
    for record in records:
        assert all(torch.isfinite(torch.tensor(record["losses"])))


def two_ranks(strategy: str, model: str, out: str, **extra) -> dict:
    """The worker's config for 2 ranks of 2 prompts each, 2 steps: the single run's 4 prompts, split."""
    base = {"strategy": strategy, "devices": 2, "batch_size": 2, "steps": 2, "lr": 0.05}
    return {**base, "model": model, "out": out, **extra}


def two_rank_jobs(model: str, out: str) -> list[dict]:
    """This file's runs in the launch of tests/two_ranks.py, into `out`: DDP with micro-batches of fixed
    rows, then by token budget; FSDP2 for 2 steps and a checkpoint, then a fresh module resumed from it."""
    ckpt = os.path.join(out, "fsdp.ckpt")
    runs = [
        two_ranks("ddp", model, os.path.join(out, "ddp_rows")),
        two_ranks("ddp", model, os.path.join(out, "ddp_budget"), max_tokens=80),
        two_ranks("fsdp", model, os.path.join(out, "fsdp"), checkpoint=ckpt),
        two_ranks("fsdp", model, os.path.join(out, "fsdp_resumed"), steps=3, resume=ckpt),
    ]
    return [{"call": "tests.test_distributed:fit_and_record", "cfg": run} for run in runs]


@pytest.fixture
def runs(two_rank_runs) -> str:
    """Where this file's 2-process runs wrote."""
    return os.path.join(two_rank_runs, "test_distributed")


def test_ddp_matches_single_process_and_survives_unequal_lengths(single_run, runs):
    out = os.path.join(runs, "ddp_rows")
    ranks = records(out)
    assert len(ranks[0]["losses"]) == len(ranks[1]["losses"]) == 2
    assert_ranks_differ(ranks)
    assert_same_update(single_run, out)


def test_ddp_with_a_token_budget_runs_as_many_micro_batches_on_every_rank(single_run, runs):
    """The ranks' rollouts differ in length, so a token budget cuts them into different numbers of
    micro-batches; every forward/backward synchronises the ranks, so each runs as many as the busiest
    (else the run hangs). The update is the single process's."""
    out = os.path.join(runs, "ddp_budget")
    counts = [record["micro_batches"] for record in records(out)]  # per pass: [own, run]
    assert all(a[1] == b[1] for a, b in zip(*counts, strict=True))
    assert any(a[0] != b[0] for a, b in zip(*counts, strict=True)), counts
    assert_same_update(single_run, out)


def test_fsdp_matches_single_process_resumes_and_exports(single_run, runs, tiny_model_dir, tmp_path):
    # 2 steps and a checkpoint, then a fresh module resumed from it in the same processes.
    out, ckpt, resumed_out = (os.path.join(runs, name) for name in ("fsdp", "fsdp.ckpt", "fsdp_resumed"))
    first, resumed = records(out), records(resumed_out)
    assert len(first[0]["losses"]) == 2
    assert_ranks_differ(first)
    assert_same_update(single_run, out)
    assert os.path.isdir(ckpt), "ModelParallelStrategy writes a sharded (distributed) checkpoint folder"

    # Resume: the sharded checkpoint loads into freshly sharded models, weights and step included.
    assert [r["start_step"] for r in resumed] == [2, 2]
    assert len(resumed[0]["losses"]) == 1
    saved = torch.load(os.path.join(out, "final.pt"))
    loaded = torch.load(os.path.join(resumed_out, "resumed.pt"))
    for name in saved:
        torch.testing.assert_close(loaded[name], saved[name], rtol=0, atol=0, msg=name)

    # Export in one process, no process group: straight from the folder (only the policy's tensors are read,
    # through the CLI as a user would), or from the whole checkpoint consolidated into one file.
    from_folder = str(tmp_path / "hf_folder")
    build_cli(["export", "--model.policy", tiny_model_dir, "--ckpt_path", ckpt, "--out", from_folder])
    consolidated = consolidate_checkpoint(ckpt)
    from_file = export_policy(GRPOModule(tiny_model_dir), str(tmp_path / "hf_file"), ckpt_path=consolidated)
    for hf_dir in (from_folder, from_file):
        model = AutoModelForCausalLM.from_pretrained(hf_dir)
        exported = dict(model.named_parameters())
        assert exported.keys() == saved.keys()
        for name, value in saved.items():
            torch.testing.assert_close(exported[name], value, rtol=0, atol=0, msg=name)
    untouched = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert not torch.equal(untouched.lm_head.weight, model.lm_head.weight), "export wrote the untrained model"


@pytest.mark.long
def test_gpu_check_script_runs_on_cpu():
    """The H200 check, on its CPU path: both runs (FSDP2 bf16 with a sharded reference, LoRA) finish, and the
    rollout comparison's engines each write the workload's tokens."""
    script = os.path.join(os.path.dirname(__file__), "..", "scripts", "gpu_check.sh")
    # This interpreter, whatever the checkout's venv; a rendezvous of its own, as in `launch`.
    env = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_ENV} | {"PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", script, "--cpu", "--tiny"], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["run", "params_M"])
    rows = {line.split()[0]: [float(v) for v in line.split()[1:]] for line in lines[header + 1 : header + 3]}
    assert set(rows) == {"fsdp2-bf16", "lora-bf16"}
    for values in rows.values():
        params, generate, reference, rest, step, *_ = values
        # Seconds printed to 2 decimals: the tiny model's reference pass can round to 0.00 on a quiet CPU.
        assert params > 0 and generate > 0 and reference >= 0 and rest > 0
        assert abs(generate + reference + rest - step) < 0.02 + 1e-3 * step
    # The rollout comparison: each engine wrote exactly 2 prompts x 2 completions x 8 tokens per call.
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["rollout", "backend"])
    table = [line.split() for line in lines[header + 1 : header + 5]]
    assert [(row[0], row[1]) for row in table] == [
        ("tiny", "eager"),
        ("tiny", "static"),
        ("tiny+lora", "eager"),
        ("tiny+lora", "static"),
    ]
    for _, _, warmup, tokens_per_s, _, _, tokens, recompiles, *_ in table:
        assert float(warmup) > 0 and float(tokens_per_s) > 0 and int(tokens) == 32 and int(recompiles) == 0
