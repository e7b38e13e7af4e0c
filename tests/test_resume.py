"""Exact resume: N steps, a checkpoint, M more steps from it == N + M steps straight through."""

import os
import random
import signal
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DistributedSampler

from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.rng import capture_rng_states, restore_rng_states
from grpo_lightning.core.types import ScoredGroups
from grpo_lightning.io.models import LoraOptions
from grpo_lightning.training.callbacks.interrupt_checkpoint import INTERRUPT_FILENAME
from grpo_lightning.training.data import GSM8KDataModule
from grpo_lightning.training.module import GRPOModule
from grpo_lightning.training.resume import ResumableSampler
from tests.helpers import length_reward, quiet_trainer

M = 2  # steps after the resume
BATCHES_PER_EPOCH = 3  # train_size=6, batch_size=2: the resumed steps reach into the next epoch


class Recorder(L.Callback):
    """What each training step saw and produced."""

    def __init__(self) -> None:
        self.steps: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        record = pl_module.last_rollout
        self.steps.append(
            {
                "questions": batch["question"],
                "completions": record.completions,
                "rewards": record.rewards.tolist(),
                "loss": float(outputs["loss"]),
            }
        )


def fit(
    model_dir: str,
    max_steps: int,
    lora: LoraOptions | None,
    seed: int,
    ckpt_path: str | None = None,
    save_dir: str | None = None,
    limit_val_batches: int = 1,
    callbacks: tuple[L.Callback, ...] = (),
    root: str | None = None,
    **grpo,
) -> tuple[GRPOModule, Recorder]:
    """`max_steps` optimizer steps (a training step makes `grpo`'s steps_per_generation of them)."""
    L.seed_everything(seed)
    module = GRPOModule(
        model_dir,
        reward_funcs=[length_reward],
        grpo=GRPOConfig(
            num_generations=4,
            max_completion_length=6,
            beta=0.04,
            learning_rate=1e-2,
            warmup_steps=3,
            preflight=False,
            log_completions_every=0,
            **grpo,
        ),
        lora=lora,
        num_generations_eval=2,  # validation samples too: it must not move the training RNG
    )
    data = GSM8KDataModule(
        source="arithmetic",
        system_prompt=None,
        arithmetic_size=20,
        batch_size=2,
        train_size=6,
        val_size=2,
        val_batch_size=1,  # validation runs 1 batch, or 2 for the SIGTERM to land between them
    )
    recorder = Recorder()
    callbacks = [recorder, *callbacks]
    if save_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=save_dir, every_n_train_steps=max_steps, save_top_k=-1))
    trainer = quiet_trainer(
        max_steps=max_steps,
        val_check_interval=2,
        limit_val_batches=limit_val_batches,
        num_sanity_val_steps=0,
        enable_checkpointing=save_dir is not None,
        callbacks=callbacks,
        default_root_dir=root,
    )
    trainer.fit(module, data, ckpt_path=ckpt_path)  # weights_only left to torch.load: True since PyTorch 2.6
    assert trainer.global_step == max_steps
    return module, recorder


@pytest.mark.parametrize(
    ("n", "lora"),
    [
        (2, None),  # mid-epoch, before a validation that samples
        # At an epoch's end, with LoRA.
        (BATCHES_PER_EPOCH, LoraOptions(r=4, alpha=8, target_modules=["q_proj", "v_proj"])),
    ],
    ids=["mid-epoch", "lora-epoch-end"],
)
def test_resume_continues_exactly(tiny_model_dir, tmp_path, n, lora):
    straight, straight_steps = fit(tiny_model_dir, n + M, lora, seed=0)
    fit(tiny_model_dir, n, lora, seed=0, save_dir=str(tmp_path))
    ckpt = str(tmp_path / f"epoch={(n - 1) // BATCHES_PER_EPOCH}-step={n}.ckpt")

    saved = torch.load(ckpt, weights_only=True)  # what we write loads without trusting pickles
    assert saved["grpo_state"]["bad_steps"] == 0
    epoch, done = divmod(n, BATCHES_PER_EPOCH)
    assert saved["GSM8KDataModule"] == {"epoch": epoch, "batches_done": done}

    # Another seed: only the checkpoint's RNG states can make the resumed run sample the same completions.
    resumed, resumed_steps = fit(tiny_model_dir, n + M, lora, seed=1234, ckpt_path=ckpt)
    assert len(resumed_steps.steps) == M
    assert_same_continuation(straight, straight_steps.steps[n:], resumed, resumed_steps.steps)


def assert_same_continuation(straight: GRPOModule, expected: list, resumed: GRPOModule, got: list) -> None:
    for want, have in zip(expected, got, strict=True):
        assert have["questions"] == want["questions"]
        assert have["completions"] == want["completions"]
        assert have["rewards"] == want["rewards"]
        assert have["loss"] == pytest.approx(want["loss"], rel=1e-6, abs=1e-9)
    assert any(step["loss"] != 0 for step in expected)  # the steps compared did train
    trained = {k: v for k, v in straight.policy.state_dict().items()}
    for key, value in resumed.policy.state_dict().items():
        torch.testing.assert_close(value, trained[key], rtol=1e-6, atol=1e-7, msg=key)


class SigtermInValidation(L.Callback):
    """Sends this process SIGTERM during the first validation batch: Lightning raises before the second."""

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if not trainer.sanity_checking and batch_idx == 0:
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_during_validation_saves_the_training_stream(tiny_model_dir, tmp_path):
    """The checkpoint written when SIGTERM stops a validation that samples holds the generators as training
    left them, not as validation moved them: the resumed run samples what the straight one did."""
    n, val_batches = 2, 2  # validation after step 2, of 2 batches: SIGTERM lands between them
    straight, straight_steps = fit(tiny_model_dir, n + M, None, seed=0, limit_val_batches=val_batches)
    with pytest.raises(SystemExit):  # Lightning's SIGTERMException
        fit(
            tiny_model_dir,
            n + M,
            None,
            seed=0,
            limit_val_batches=val_batches,
            callbacks=(SigtermInValidation(),),
            root=str(tmp_path),
        )
    ckpt = str(tmp_path / "checkpoints" / INTERRUPT_FILENAME)
    assert torch.load(ckpt, weights_only=True)["global_step"] == n
    resumed, resumed_steps = fit(
        tiny_model_dir, n + M, None, seed=1234, ckpt_path=ckpt, limit_val_batches=val_batches
    )
    assert_same_continuation(straight, straight_steps.steps[n:], resumed, resumed_steps.steps)


def test_adaptive_state_round_trips_through_a_weights_only_checkpoint(tiny_model_dir, tmp_path):
    """The count of consecutive non-finite steps, and dynamic sampling's groups waiting for an update."""
    grpo = GRPOConfig(num_generations=2, max_completion_length=4, dynamic_sampling=True, preflight=False)
    module = GRPOModule(tiny_model_dir, grpo=grpo)
    module.configure_model()
    prompts = [[{"role": "user", "content": "1 + 1?"}], [{"role": "user", "content": "2 + 2?"}]]
    rollout, completions = module.rollouts.sample(prompts, 2)
    rewards = torch.tensor([0.0, 1.0, 1.0, 1.0])  # the first group informative, the second not
    module.group_source.buffer.add(ScoredGroups(prompts, rollout, completions, rewards[:, None], rewards, 2))
    module.optimization.step_guard.bad_steps = 2
    checkpoint = {"state_dict": {}}
    module.on_save_checkpoint(checkpoint)
    torch.save(checkpoint, tmp_path / "state.ckpt")

    fresh = GRPOModule(tiny_model_dir, grpo=grpo)
    fresh.on_load_checkpoint(torch.load(tmp_path / "state.ckpt", weights_only=True))
    assert fresh.optimization.step_guard.bad_steps == 2
    buffer = fresh.group_source.buffer
    assert (buffer.rounds, buffer.target, buffer.num_kept) == (1, 2, 1)
    assert buffer.kept[0].completions == completions[:2] and buffer.kept[0].prompts == prompts[:1]
    torch.testing.assert_close(buffer.kept[0].rollout.completion_ids, rollout.completion_ids[:2])

    # Lightning loads on the CPU; training starts on the module's device ("meta" stands in for a GPU here).
    fresh.to("meta").on_train_start()
    kept = fresh.group_source.buffer.kept[0]
    assert {t.device.type for t in (kept.rewards, kept.rewards_per_func, kept.rollout.completion_ids)} == {
        "meta"
    }


def test_rng_states_round_trip_through_a_weights_only_checkpoint(tmp_path):
    torch.manual_seed(1), random.seed(2), np.random.seed(3)
    torch.save(capture_rng_states(), tmp_path / "rng.pt")
    first = (torch.rand(3).tolist(), random.random(), np.random.rand())
    torch.manual_seed(9), random.seed(9), np.random.seed(9)
    restore_rng_states(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert (torch.rand(3).tolist(), random.random(), np.random.rand()) == first


def test_resumable_sampler_starts_part_way_then_from_the_top():
    sampler = ResumableSampler(10, seed=5)
    epoch0, epoch1 = sampler.order(0), sampler.order(1)
    assert sorted(epoch0) == list(range(10)) and epoch0 != epoch1  # a permutation, a new one each epoch
    assert list(sampler) == epoch0
    sampler.resume(epoch=1, start=4)
    assert list(sampler) == epoch1[4:]
    assert list(sampler) == epoch1  # only the first pass after a resume is cut
    assert ResumableSampler(10, seed=5).order(1) == epoch1  # the seed and the epoch alone fix the order
    with pytest.raises(ValueError, match="outside this rank's 10 training rows"):
        sampler.resume(epoch=0, start=11)


def test_resumable_sampler_deals_disjoint_equal_shares_and_resumes_each():
    ranks = [ResumableSampler(9, seed=5, num_replicas=2, rank=r) for r in (0, 1)]
    shares = []
    for epoch in (0, 1):
        for sampler in ranks:
            sampler.set_epoch(epoch)  # what Lightning calls before each epoch
        shares.append([list(sampler) for sampler in ranks])
        mine, theirs = shares[-1]
        assert len(mine) == len(theirs) == len(ranks[0]) == 4  # the same number of batches on every rank
        assert not set(mine) & set(theirs)
        assert set(mine) | set(theirs) == set(ranks[0].order(epoch)[:8])  # one row sits this epoch out
    assert shares[0] != shares[1]
    ranks[1].resume(epoch=1, start=2)  # each rank resumes at batches done x batch size of its own share
    assert list(ranks[1]) == shares[1][1][2:]
    with pytest.raises(ValueError, match="1 training rows cannot be shared among 2 processes"):
        ResumableSampler(1, num_replicas=2, rank=0)


def test_data_module_gives_each_rank_its_share_and_resumes_it():
    """The loader's sampler is a `DistributedSampler`: Lightning leaves it as it is instead of wrapping it."""
    shares = []
    for rank in (0, 1):
        data = GSM8KDataModule(
            source="arithmetic", arithmetic_size=20, train_size=9, batch_size=2, val_size=2
        )
        data.setup()
        data.trainer = SimpleNamespace(world_size=2, global_rank=rank)
        loader = data.train_dataloader()
        assert isinstance(loader.sampler, DistributedSampler)
        shares.append([q for batch in loader for q in batch["question"]])
        data.load_state_dict({"epoch": 0, "batches_done": 1})
        resumed = [q for batch in data.train_dataloader() for q in batch["question"]]
        assert resumed == shares[-1][2:]
    assert len(shares[0]) == len(shares[1]) == 4 and not set(shares[0]) & set(shares[1])
