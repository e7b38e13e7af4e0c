"""The old paths of names that moved out of `grpo_lightning.callbacks` and `grpo_lightning.credit`:
they resolve to the very same objects, with a `FutureWarning` naming the new path, for one release.
Class paths in YAML configs are public API, and checkpoints pickle the class path of dynamic sampling's
buffered groups."""

from __future__ import annotations

import importlib

import lightning as L
import pytest
import torch
from jsonargparse import ArgumentParser

import grpo_lightning.core.dynamic_sampling as dynamic_sampling
from grpo_lightning.core.dynamic_sampling import ScoredGroups
from grpo_lightning.core.sampling import Rollout
from grpo_lightning.io.checkpoints import register_safe_globals
from grpo_lightning.io.export import ExportBestCallback

MOVED = (
    [
        ("callbacks", name, new)
        for new, names in {
            "evaluation": ["GSM8KAccuracyCallback", "ValidationResultsWriter", "generate_answers"],
            "monitoring": [
                "CollapseMonitor",
                "CompletionsPanel",
                "RolloutRecord",
                "completions_table",
                "logging_step",
                "prompt_text",
            ],
            "audit": [
                "AUDIT_CASES",
                "AuditReport",
                "audit_module_rewards",
                "audit_reward_funcs",
                "auditable",
            ],
            "audit_callback": ["RewardAuditCallback"],
            "export": ["ExportBestCallback"],
            "sampling": ["stop_token_ids"],
        }.items()
        for name in names
    ]
    + [
        ("credit", name, "dynamic_sampling")
        for name in ("GroupBuffer", "ScoredGroups", "cat_rollouts", "informative_groups")
    ]
    + [("credit", "kl_in_reward", "loss")]
    + [("audit", "RewardAuditCallback", "audit_callback"), ("rewards", "audit_rewards", "audit")]
    + [("steps", "step_token_penalties", "credit")]
)


@pytest.mark.parametrize(("old", "name", "new"), MOVED)
def test_old_path_resolves_to_the_moved_object_with_a_warning(old, name, new):
    old_module = importlib.import_module(f"grpo_lightning.{old}")
    moved = getattr(importlib.import_module(f"grpo_lightning.{new}"), name)
    with pytest.warns(
        FutureWarning, match=rf"grpo_lightning\.{old}\.{name} moved to grpo_lightning\.{new}\.{name}"
    ):
        assert getattr(old_module, name) is moved


def test_a_name_that_never_lived_there_is_missing():
    import grpo_lightning.callbacks
    import grpo_lightning.core.credit

    with pytest.raises(AttributeError, match="has no attribute 'NoSuchCallback'"):
        grpo_lightning.callbacks.NoSuchCallback  # noqa: B018
    with pytest.raises(AttributeError, match="has no attribute '_pad_columns'"):  # private names are not kept
        grpo_lightning.core.credit._pad_columns  # noqa: B018
    # credit.py is still the home of step credit: no warning for its own names.
    from grpo_lightning.core.credit import step_credit_penalties  # noqa: F401


def test_old_class_path_in_a_yaml_config_still_builds_the_callback(tmp_path):
    parser = ArgumentParser()
    parser.add_argument("--callback", type=L.Callback)
    config = {"class_path": "grpo_lightning.callbacks.ExportBestCallback", "init_args": {"merge_lora": False}}
    with pytest.warns(FutureWarning, match="grpo_lightning.io.export.ExportBestCallback"):
        callback = parser.instantiate_classes(parser.parse_object({"callback": config})).callback
    assert type(callback) is ExportBestCallback and callback.merge_lora is False


def test_checkpoint_with_groups_pickled_under_the_old_path_loads_weights_only(tmp_path, monkeypatch):
    """A checkpoint of 0.1.0 names the old path `grpo_lightning.credit.ScoredGroups`: resuming from it
    with `weights_only=True` (the default) must still rebuild the buffered groups."""
    rollout = Rollout(
        *(torch.zeros(2, 3, dtype=torch.long) for _ in range(4)), torch.zeros(2, dtype=torch.bool)
    )
    groups = ScoredGroups([["p"]], rollout, ["a", "b"], torch.ones(2, 1), torch.tensor([0.0, 1.0]), 2)
    monkeypatch.setattr(ScoredGroups, "__module__", "grpo_lightning.credit")  # 0.1.0 pickled it: an old path
    with pytest.warns(FutureWarning):  # pickle checks the old path leads back to the class
        torch.save({"group_buffer": {"kept": [groups]}}, tmp_path / "old.ckpt")
    monkeypatch.undo()
    assert ScoredGroups.__module__ == dynamic_sampling.__name__
    assert b"grpo_lightning.credit" in (tmp_path / "old.ckpt").read_bytes()  # old path

    register_safe_globals()
    loaded = torch.load(tmp_path / "old.ckpt", weights_only=True)["group_buffer"]["kept"][0]
    assert type(loaded) is ScoredGroups
    assert loaded.completions == ["a", "b"] and loaded.rewards.tolist() == [0.0, 1.0]
