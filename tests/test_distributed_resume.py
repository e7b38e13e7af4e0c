"""Per-rank data and exact resume on 2 CPU processes (gloo), under DDP and FSDP2, trained as a user would:
on `GSM8KDataModule` with Lightning's default distributed sampling. A run stopped and resumed (under another
seed) is compared with one that went straight through, on every rank.

The runs are made in the distributed tests' one launch of 2 processes (`two_rank_jobs` below and
tests/two_ranks.py).
"""

from __future__ import annotations

import json
import os

import lightning as L
import pytest
import torch

from grpo_lightning.core.algorithm.advantages import AdvantageOptions, group_advantages
from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.rewards.verifiable import completion_text
from grpo_lightning.training.data import GSM8KDataModule
from grpo_lightning.training.evaluation import GSM8KAccuracyCallback
from grpo_lightning.training.module import GRPOModule
from tests.test_distributed import fixed_reward, full_weights, strategy_for, two_ranks

TRAIN_ROWS = 9  # 4 per rank and one that sits each epoch out: 2 batches of 2 per rank and epoch


def parity_reward(completions: list[str], **kwargs) -> list[float]:
    """1 for an odd number of characters: with 2 completions a group, about half the groups have no signal."""
    return [float(len(completion_text(c)) % 2) for c in completions]


class RecordingModule(GRPOModule):
    """Seeds each rank's generators differently when training starts (so that a rank restoring another's
    states would sample otherwise) and records every batch: its questions, epoch, completions, rewards and
    advantages (none while dynamic sampling waits)."""

    def __init__(self, *args, seed: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rank_seed, self.batches = seed, []
        sample = self.rollouts.sample

        def recording_sample(prompts, num_generations, do_sample=True):
            rollout, completions = sample(prompts, num_generations, do_sample)
            if self.training:
                self.batches.append({"epoch": self.current_epoch, "completions": completions})
            return rollout, completions

        self.rollouts.sample = recording_sample

    def on_train_start(self) -> None:
        torch.manual_seed(self.rank_seed + self.global_rank)  # then the checkpoint's states, if resuming
        super().on_train_start()

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        record, rollout = self.batches[-1], self.last_rollout
        record.update(questions=batch["question"], waiting=self.group_source.buffer.rounds > 0)
        if rollout is not None and not record["waiting"]:
            record.update(rewards=rollout.rewards.tolist(), advantages=rollout.advantages.tolist())


class SaveAndStop(L.Callback):
    """After `after` batches, at the first batch where dynamic sampling holds no update back (`waiting`
    False) or holds one (True), write a checkpoint and stop, as `InterruptCheckpoint` does on Ctrl-C."""

    def __init__(self, after: int, waiting: bool, path: str) -> None:
        self.after, self.waiting, self.path = after, waiting, path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        waiting = pl_module.group_source.buffer.rounds > 0  # the same on every rank: they update together
        if len(pl_module.batches) >= self.after and waiting == self.waiting and not trainer.should_stop:
            trainer.save_checkpoint(self.path)
            trainer.should_stop = True


def data_scenario(cfg: dict) -> None:
    """A scenario (`cfg["dynamic"]`: with dynamic sampling or without) three times over in the same 2
    processes, on `GSM8KDataModule`'s arithmetic task: straight through `steps` steps; stopped with a
    checkpoint after `stop_after` batches; resumed from it under another seed. Writes each run's batches per
    rank (`<out>/<run>.rank<r>.json`) and its final weights (`<out>/<run>.pt`)."""
    out, dynamic = cfg["out"], cfg["dynamic"]
    os.makedirs(out, exist_ok=True)
    ckpt = os.path.join(out, "stopped.ckpt")

    def run(name: str, seed: int, ckpt_path: str | None = None, callbacks: tuple = ()) -> None:
        module = RecordingModule(
            cfg["model"],
            reward_funcs=[parity_reward] if dynamic else [fixed_reward],
            grpo=GRPOConfig(
                num_generations=2,
                max_completion_length=4,
                beta=0.0,
                learning_rate=1e-2,
                scale_rewards="group" if dynamic else "batch",
                dynamic_sampling=dynamic,
                dynamic_sampling_metric="parity_reward" if dynamic else None,
                preflight=False,
                log_completions_every=0,
            ),
            seed=seed,
        )
        data = GSM8KDataModule(
            source="arithmetic",
            system_prompt=None,
            arithmetic_size=20,
            train_size=TRAIN_ROWS,
            batch_size=2,
            val_size=2,
        )
        trainer = L.Trainer(
            accelerator="cpu",
            devices=cfg["devices"],
            strategy=strategy_for(cfg),  # use_distributed_sampler left at its default, True
            max_steps=cfg["steps"],
            limit_val_batches=0,
            num_sanity_val_steps=0,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=list(callbacks),
        )
        trainer.fit(module, data, ckpt_path=ckpt_path)
        weights = full_weights(module)
        rank = trainer.global_rank
        if rank == 0:
            torch.save(weights, os.path.join(out, f"{name}.pt"))
        with open(os.path.join(out, f"{name}.rank{rank}.json"), "w") as f:
            json.dump(module.batches, f)
        evaluated = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("gsm8k/")}
        if evaluated and rank == 0:
            with open(os.path.join(out, f"{name}.evaluated.json"), "w") as f:
                json.dump(evaluated, f)

    evaluate = GSM8KAccuracyCallback(
        "arithmetic", "holdout", num_problems=3, every_n_steps=2, batch_size=1, max_new_tokens=4
    )  # 2 problems on rank 0, 1 on rank 1: one generate call more on rank 0
    run("straight", seed=0, callbacks=(evaluate,) if cfg.get("evaluate") else ())
    run("stopped", seed=0, callbacks=(SaveAndStop(cfg["stop_after"], dynamic, ckpt),))
    run("resumed", seed=1234, ckpt_path=ckpt)


# ----------------------------------------------------------------------------------------- tests
def data_runs(out: str) -> dict[str, list[list[dict]]]:
    """The batches of each run (straight, stopped, resumed), per rank."""
    runs = ("straight", "stopped", "resumed")
    return {
        run: [json.load(open(os.path.join(out, f"{run}.rank{r}.json"))) for r in range(2)] for run in runs
    }


def assert_resume_continues_the_straight_run(out: str) -> dict[str, list[list[dict]]]:
    """Every rank: the stopped run is the straight run's start, the resumed run its rest (the same prompts,
    completions, rewards and advantages), and the final weights are the straight run's."""
    runs = data_runs(out)
    for rank in range(2):
        straight, stopped, resumed = (runs[run][rank] for run in ("straight", "stopped", "resumed"))
        assert 0 < len(stopped) < len(straight)
        assert stopped == straight[: len(stopped)], f"rank {rank}: the same seed, the same start"
        assert resumed == straight[len(stopped) :], f"rank {rank}: the resumed run left the straight one"
    expected, got = (torch.load(os.path.join(out, f"{run}.pt")) for run in ("straight", "resumed"))
    stopped = torch.load(os.path.join(out, "stopped.pt"))
    assert any(not torch.equal(expected[k], stopped[k]) for k in expected), "no training after the stop"
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-7, msg=name)
    return runs


def assert_ranks_share_no_prompt_and_epochs_differ(batches_per_rank: list[list[dict]]) -> None:
    epochs = [{} for _ in batches_per_rank]  # per rank: epoch -> questions in order
    for rank, batches in enumerate(batches_per_rank):
        for batch in batches:
            epochs[rank].setdefault(batch["epoch"], []).extend(batch["questions"])
    assert sorted(epochs[0]) == sorted(epochs[1]) == [0, 1]
    for epoch in (0, 1):
        mine, theirs = epochs[0][epoch], epochs[1][epoch]
        assert len(mine) == len(theirs) == TRAIN_ROWS // 2, "2 batches of 2 prompts per rank and epoch"
        assert not set(mine) & set(theirs), f"epoch {epoch}: the ranks shared a prompt"
    for rank in (0, 1):
        assert epochs[rank][1] != epochs[rank][0], f"rank {rank}: the second epoch repeated the first's order"


def two_rank_jobs(model: str, out: str) -> list[dict]:
    """This file's runs in the launch of tests/two_ranks.py, into `<out>/<strategy>_<scenario>`: 4 steps
    (2 epochs) straight, stopped after one batch, resumed; under DDP without and with dynamic sampling, under
    FSDP2 without, evaluating with `GSM8KAccuracyCallback` in the straight run."""
    jobs = []
    for strategy, dynamic in (("ddp", False), ("ddp", True), ("fsdp", False)):
        name = f"{strategy}_{'dynamic' if dynamic else 'plain'}"
        cfg = two_ranks(strategy, model, os.path.join(out, name), dynamic=dynamic, steps=4, stop_after=1)
        cfg["evaluate"] = strategy == "fsdp"
        jobs.append({"call": "tests.test_distributed_resume:data_scenario", "cfg": cfg})
    return jobs


@pytest.fixture
def runs(two_rank_runs) -> str:
    """Where this file's 2-process runs wrote."""
    return os.path.join(two_rank_runs, "test_distributed_resume")


def test_ddp_resume_continues_every_rank_exactly(runs):
    """Also: disjoint shares, a new order per epoch, the batch std over both ranks, and dynamic sampling
    resumed with groups waiting."""
    straight = assert_resume_continues_the_straight_run(os.path.join(runs, "ddp_plain"))["straight"]
    assert_ranks_share_no_prompt_and_epochs_differ(straight)

    # scale_rewards="batch": advantages over the whole batch of both ranks, as TRL computes them.
    local_std_differs = False
    for batch0, batch1 in zip(*straight, strict=True):
        rewards = torch.tensor(batch0["rewards"] + batch1["rewards"])
        expected = group_advantages(rewards, 2, AdvantageOptions("batch")).tolist()
        assert batch0["advantages"] + batch1["advantages"] == pytest.approx(expected, rel=1e-5, abs=1e-6)
        own = group_advantages(torch.tensor(batch0["rewards"]), 2, AdvantageOptions("batch")).tolist()
        local_std_differs |= own != pytest.approx(batch0["advantages"], rel=1e-5, abs=1e-6)
    assert local_std_differs, "the two ranks' reward spreads never differed: the check would be empty"

    dynamic = os.path.join(runs, "ddp_dynamic")
    saved = torch.load(os.path.join(dynamic, "stopped.ckpt"), weights_only=True)
    per_rank = saved["grpo_state"]["per_rank"]
    assert [own["group_buffer"]["rounds"] > 0 for own in per_rank] == [True, True], "groups waiting"
    kept = [own["group_buffer"]["kept"] for own in per_rank]  # plain dicts, as weights_only reads them
    prompts = [{p[-1]["content"] for g in groups for p in g["prompts"]} for groups in kept]
    assert not prompts[0] & prompts[1], "each rank's own waiting groups"
    resumed = assert_resume_continues_the_straight_run(dynamic)
    assert resumed["stopped"][0][-1]["waiting"] and not resumed["resumed"][0][-1]["waiting"]


def test_fsdp_resume_continues_every_rank_exactly_and_evaluates_sharded(runs):
    """A sharded checkpoint folder; the straight run also evaluates with `GSM8KAccuracyCallback`, on 2
    problems on rank 0 and 1 on rank 1, which hangs unless generation runs on gathered weights."""
    out = os.path.join(runs, "fsdp_plain")
    assert os.path.isdir(os.path.join(out, "stopped.ckpt")), "a sharded checkpoint folder"
    evaluated = json.load(open(os.path.join(out, "straight.evaluated.json")))
    assert 0 <= evaluated["gsm8k/accuracy"] <= 1
    fsdp = assert_resume_continues_the_straight_run(out)
    assert_ranks_share_no_prompt_and_epochs_differ(fsdp["straight"])
