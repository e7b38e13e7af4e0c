"""Reference-model sync (TR-DPO's soft update): the closed-form mixture of policy snapshots, in a real fit,
and exactly the same after a resume (the synced reference is stored in the checkpoint)."""

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from grpo_lightning.core.algorithm.reference_sync import ReferenceSync, mix_into_reference
from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.io.models import LoraOptions
from grpo_lightning.training.data import GSM8KDataModule
from grpo_lightning.training.module import GRPOModule
from tests.helpers import length_reward, quiet_trainer

ALPHA = 0.3


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_mixing_k_times_is_the_closed_form_mixture():
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).double()
    policy = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).double()
    ref_0 = weights(reference)
    snapshots = []
    for _ in range(4):
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(torch.randn_like(p))  # the policy moves between syncs
        snapshots.append(weights(policy))
        mix_into_reference(reference, policy, ALPHA)
    k = len(snapshots)
    for name, got in weights(reference).items():
        expected = (1 - ALPHA) ** k * ref_0[name] + sum(
            ALPHA * (1 - ALPHA) ** (k - j) * snapshot[name] for j, snapshot in enumerate(snapshots, start=1)
        )
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_syncs_are_due_once_per_multiple_of_the_interval():
    reference, policy = nn.Linear(2, 2), nn.Linear(2, 2)
    sync = ReferenceSync(every=2, alpha=1.0)
    assert [sync.apply_due(reference, policy, step) for step in (0, 1, 2, 3, 4, 8, 8)] == [
        0,
        0,
        1,
        0,
        1,
        2,
        0,
    ]
    torch.testing.assert_close(reference.weight, policy.weight)  # alpha 1 copies the policy
    with pytest.raises(ValueError, match="different weights"):
        mix_into_reference(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)), 0.5)


def test_lora_is_refused_in_one_line(tiny_model_dir):
    grpo = GRPOConfig(beta=0.04, sync_ref_model=True)
    with pytest.raises(
        ValueError, match=r"grpo.reference_sync \(sync_ref_model\) with LoRA: the reference is the policy"
    ):
        GRPOModule(tiny_model_dir, grpo=grpo, lora=LoraOptions(r=4))


class PolicySnapshots(L.Callback):
    """The policy at the start of each training step: what the module mixes into the reference there."""

    def __init__(self) -> None:
        self.policy: list[dict[str, torch.Tensor]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.policy.append(weights(pl_module.policy))  # callbacks run before the module's own hook


def syncing_config(**options) -> GRPOConfig:
    """A reference synced with weight ALPHA after every optimizer step, and a learning rate that moves it."""
    defaults = {"num_generations": 4, "max_completion_length": 6, "learning_rate": 1e-2, "preflight": False}
    sync = {"beta": 0.04, "sync_ref_model": True, "ref_model_mixup_alpha": ALPHA, "ref_model_sync_steps": 1}
    return GRPOConfig(**{**defaults, **sync, "log_completions_every": 0, **options})


def fit(model_dir: str, max_steps: int, root: str, ckpt_path: str | None = None, save: bool = False):
    L.seed_everything(0)
    module = GRPOModule(model_dir, reward_funcs=[length_reward], grpo=syncing_config())
    data = GSM8KDataModule(
        source="arithmetic", system_prompt=None, arithmetic_size=20, batch_size=2, train_size=6, val_size=2
    )
    snapshots = PolicySnapshots()
    callbacks = [snapshots]
    if save:
        callbacks.append(ModelCheckpoint(dirpath=root, every_n_train_steps=max_steps, save_top_k=-1))
    trainer = quiet_trainer(
        max_steps=max_steps,
        limit_val_batches=0,
        enable_checkpointing=save,
        callbacks=callbacks,
        default_root_dir=root,
    )
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return module, snapshots


def test_fit_reference_is_the_mixture_of_policy_snapshots_and_resumes_exactly(tiny_model_dir, tmp_path):
    straight, snapshots = fit(tiny_model_dir, 4, str(tmp_path / "straight"))
    # Syncs due after steps 1, 2 and 3 are applied at the starts of steps 2, 3 and 4 (the 4th is pending:
    # no rollout follows it), with the policy of that moment; the reference started as the policy.
    p = snapshots.policy
    assert straight.reference_sync.syncs_done == 3
    for name, got in weights(straight.reference).items():
        expected = (1 - ALPHA) ** 3 * p[0][name] + sum(
            ALPHA * (1 - ALPHA) ** (3 - j) * p[j][name] for j in (1, 2, 3)
        )
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=name)
    moved = sum(float((weights(straight.reference)[n] - p[0][n]).abs().sum()) for n in p[0])
    assert moved > 1e-3, "the reference did not move: the comparison would be empty"

    # Stopped after 2 steps and resumed to 4: the checkpoint holds the synced reference and the count.
    fit(tiny_model_dir, 2, str(tmp_path / "first"), save=True)
    ckpt = str(tmp_path / "first" / "epoch=0-step=2.ckpt")
    saved = torch.load(ckpt, weights_only=True)
    assert saved["grpo_state"]["reference_syncs"] == 1
    assert any(key.startswith("reference.") for key in saved["state_dict"])
    resumed, _ = fit(tiny_model_dir, 4, str(tmp_path / "resumed"), ckpt_path=ckpt)
    for model in ("policy", "reference"):
        expected = weights(getattr(straight, model))
        for name, got in weights(getattr(resumed, model)).items():
            torch.testing.assert_close(got, expected[name], rtol=0, atol=0, msg=f"{model}.{name}")
