"""Old paths: 0.1.0's flat module paths (an old path: `grpo_lightning.data`, ...) and the names that moved
out of `grpo_lightning.callbacks` and (old path) `grpo_lightning.credit` resolve to the very same objects,
with a `FutureWarning` naming the new path and the release that drops the old one. Class paths in YAML
configs are public API, and checkpoints pickle the class path of dynamic sampling's buffered groups."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from jsonargparse import ArgumentParser

import grpo_lightning
import grpo_lightning.core.dynamic_sampling as dynamic_sampling
from grpo_lightning._compat import OLD_MODULES, REMOVED_IN
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


def home(module: str) -> str:
    """Where the 0.1.0 module `grpo_lightning.<module>` lives now."""
    return OLD_MODULES.get(f"grpo_lightning.{module}", f"grpo_lightning.{module}")


@pytest.mark.parametrize(("old", "name", "new"), MOVED)
def test_old_path_resolves_to_the_moved_object_with_a_warning(old, name, new):
    old_module = importlib.import_module(home(old))
    moved = getattr(importlib.import_module(home(new)), name)
    with pytest.warns(
        FutureWarning, match=rf"{re.escape(home(old))}\.{name} moved to {re.escape(home(new))}\.{name}"
    ):
        assert getattr(old_module, name) is moved


@pytest.mark.parametrize(("old", "new"), sorted(OLD_MODULES.items()))
def test_old_module_path_is_the_moved_module_with_a_warning(old, new, monkeypatch):
    monkeypatch.delitem(sys.modules, old, raising=False)
    message = rf"{re.escape(old)} moved to {re.escape(new)}; the old path will be removed in 0\.3\.0"
    with pytest.warns(FutureWarning, match=message):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)


def test_from_an_old_module_path_import_a_name(monkeypatch):
    monkeypatch.delitem(sys.modules, "grpo_lightning.module", raising=False)  # old path
    with pytest.warns(FutureWarning, match="grpo_lightning.training.module"):
        from grpo_lightning.module import GRPOModule  # old path
    assert (
        GRPOModule is grpo_lightning.GRPOModule and GRPOModule.__module__ == "grpo_lightning.training.module"
    )


def test_the_version_is_the_packages_and_drops_the_old_paths_in_the_next_minor():
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    (version,) = re.findall(r'^version = "([^"]+)"$', pyproject, flags=re.M)
    assert grpo_lightning.__version__ == version == "0.2.0"
    assert REMOVED_IN == "0.3.0"


def test_the_public_api_names_what_users_build_on():
    for name in grpo_lightning.__all__:
        assert getattr(grpo_lightning, name) is not None, name
    assert grpo_lightning.Trajectory.__module__ == "grpo_lightning.core.trajectory"
    with pytest.raises(AttributeError, match="no attribute 'Nothing'"):
        grpo_lightning.Nothing  # noqa: B018


def test_a_name_that_never_lived_there_is_missing():
    import grpo_lightning.callbacks
    import grpo_lightning.core.credit

    with pytest.raises(AttributeError, match="has no attribute 'NoSuchCallback'"):
        grpo_lightning.callbacks.NoSuchCallback  # noqa: B018
    with pytest.raises(AttributeError, match="has no attribute '_pad_columns'"):  # private names are not kept
        grpo_lightning.core.credit._pad_columns  # noqa: B018
    # credit.py is still the home of step credit: no warning for its own names.
    from grpo_lightning.core.credit import step_credit_penalties  # noqa: F401


def test_old_module_path_in_a_yaml_class_path_still_builds_the_data_module(monkeypatch):
    monkeypatch.delitem(sys.modules, "grpo_lightning.data", raising=False)  # old path
    parser = ArgumentParser()
    parser.add_argument("--data", type=L.LightningDataModule)
    old_path = "grpo_lightning.data"  # an old path, on purpose
    config = {"class_path": f"{old_path}.GSM8KDataModule", "init_args": {"source": "arithmetic"}}
    with pytest.warns(FutureWarning, match=f"{old_path} moved to grpo_lightning.training.data"):
        data = parser.instantiate_classes(parser.parse_object({"data": config})).data
    assert type(data) is grpo_lightning.GSM8KDataModule and data.hparams.source == "arithmetic"


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
