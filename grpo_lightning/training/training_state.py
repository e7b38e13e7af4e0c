"""What a GRPO checkpoint holds beyond Lightning's own state, for an exact resume.

The generators that sampling draws from, the count of consecutive non-finite steps and the group source's
state (`core.group_source`: dynamic sampling's waiting groups, not its options); the data position is the
data module's state. The generators and the source's state are each rank's own (each samples its own
prompts): all ranks' go into the checkpoint, on the CPU, the source's under its own keys (`group_buffer`).
The frozen reference never changes: it is rebuilt from the policy's source, not stored a second time
(sharded checkpoints keep it: the strategy loads them in place and checks every key).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, is_dataclass, replace

import lightning as L
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.options import declared_annotation, option_differences, section_class
from grpo_lightning.core.rng import capture_rng_states
from grpo_lightning.core.types import ScoredGroups
from grpo_lightning.io.checkpoints import check_fits, upgrade_scheduler_states
from grpo_lightning.io.distributed import gather_per_rank, is_sharded
from grpo_lightning.io.hparams import comparable_hparams
from grpo_lightning.training.resume import state_of_rank

STATE_KEY = "grpo_state"
REFERENCE_PREFIX = "reference."


@dataclass
class RankState:
    """One rank's part of a checkpoint's GRPO state."""

    bad_steps: int
    rng: dict
    group_source: dict  # the source's state (`GroupSource.state_dict`)


def save_grpo_state(
    checkpoint: dict,
    bad_steps: int,
    rng: dict,
    group_source: dict,
    reference_syncs: int | None = None,
) -> None:
    """Store the GRPO state of every rank, the group source's `state_dict` among it (a collective under
    several processes: every rank calls it), and the reference syncs done (`grpo.reference_sync`; None
    without)."""
    own = {"rng": rng, **move_data_to_device(group_source, "cpu")}
    checkpoint[STATE_KEY] = {"bad_steps": bad_steps, "per_rank": gather_per_rank(own)}
    if reference_syncs is not None:
        checkpoint[STATE_KEY]["reference_syncs"] = reference_syncs


def load_grpo_state(checkpoint: dict, rank: int, world_size: int) -> RankState | None:
    """This rank's GRPO state from `checkpoint`, or None for a checkpoint without one."""
    if STATE_KEY not in checkpoint:
        return None
    state = checkpoint[STATE_KEY]
    own = dict(state_of_rank(state["per_rank"], rank, world_size))
    rng = own.pop("rng")
    if "group_buffer" in own:  # the waiting groups of a checkpoint written before they carried a version
        own["group_buffer"] = _versioned(own["group_buffer"], checkpoint.get("global_step", 0))
    return RankState(state["bad_steps"], rng, own)


def _versioned(value: object, step: int) -> object:
    """Dynamic sampling's waiting groups (plain dicts, or the dataclasses of older checkpoints), those without
    a policy version stamped with the checkpoint's step: the buffer waits within one step, no update in
    between, so its groups were all sampled by the policy of that step."""
    if isinstance(value, list):
        return [_versioned(v, step) for v in value]
    if isinstance(value, dict):
        if "rollout" in value:
            return {"policy_version": step, **value}
        return {k: _versioned(v, step) for k, v in value.items()}
    if isinstance(value, ScoredGroups) and "policy_version" not in vars(value):
        return replace(value, policy_version=step)
    return value


def reference_syncs_of(checkpoint: dict, every: int) -> int:
    """The reference syncs a checkpoint's run had done; for a checkpoint without the count, those due before
    its step (none is missed)."""
    default = checkpoint.get("global_step", 0) // every
    return checkpoint.get(STATE_KEY, {}).get("reference_syncs", default)


# A module's options, beside its `grpo` ones, that leave the training stream alone: validation only.
MODULE_OPTIONS_FREE_ON_RESUME = ("num_generations_eval", "val_reward")


def free_on_resume(option: str) -> bool:
    """Whether a module's option ("num_generations_eval", "grpo.run.preflight") leaves the training stream
    alone (the rows, the completions drawn, the updates), so that a resumed run may change it: one of
    `MODULE_OPTIONS_FREE_ON_RESUME`, or an option of a `GRPOConfig` section that declares
    `changes_training = False` (`RunOptions`)."""
    head, _, rest = option.partition(".")
    if head != "grpo":
        return head in MODULE_OPTIONS_FREE_ON_RESUME
    section: type | None = GRPOConfig
    for key in rest.split("."):
        if not getattr(section, "changes_training", True):
            return True
        known = is_dataclass(section) and key in {f.name for f in fields(section)}
        section = section_class(declared_annotation(section, key)) if known else None
        if section is None:
            return False
    return not getattr(section, "changes_training", True)


def warn_changed_options(saved: dict, own: dict) -> None:
    """Lightning restores weights and state into the module as built, whose options (`own`) win over the
    checkpoint's hyper-parameters (`saved`): said, not silent, for the options that change the training
    stream (`free_on_resume`). Where the policy and tokenizer load from is not an option:
    `load_from_checkpoint(ckpt, policy=...)` only says where to find the same model."""
    saved, own = comparable_hparams(saved), comparable_hparams(own)
    for where in ("policy", "tokenizer"):
        saved.pop(where, None)
    changed = [row for row in option_differences(saved, own) if not free_on_resume(row[0])]
    if changed:
        listed = "; ".join(
            f"{key}: checkpoint {theirs!r}, this module {ours!r}" for key, theirs, ours in changed
        )
        rank_zero_warn(f"the checkpoint was trained with other options, this module's apply: {listed}")


# Data options that leave what is trained on, its order and the batches' size alone: free to change on resume.
DATA_OPTIONS_FREE_ON_RESUME = ("val_batch_size", "num_workers")


def changed_data_options(saved: Mapping, current: Mapping) -> list[tuple[str, object, object]]:
    """`(data.<option>, checkpoint's value, this run's)` for each data option of a resumed run that changes
    what is trained on, in what order or how much per step: the source, splits, sizes, columns, prompt,
    batch size, seed, and the data module's class. The checkpoint's position in its data (epoch, batches
    done) means nothing in other data. `val_size` counts only where a run holds its validation rows out of
    the training rows (`val_split: holdout`)."""
    holdout = "holdout" in (saved.get("val_split", "holdout"), current.get("val_split", "holdout"))
    free = {*DATA_OPTIONS_FREE_ON_RESUME, *(() if holdout else ("val_size",))}
    rows = [
        (f"data.{key}", theirs, ours)
        for key, theirs, ours in option_differences(saved, current)
        if key not in free
    ]
    theirs, ours = saved.get("_class_path"), current.get("_class_path")
    if theirs and ours and theirs.rpartition(".")[2] != ours.rpartition(".")[2]:
        rows.insert(0, ("data.class_path", theirs, ours))
    return rows


def listed_differences(changed: list[tuple[str, object, object]]) -> str:
    """`a: checkpoint 1, this run 2; b: ...`: options that differ from a checkpoint's, for messages."""
    return "; ".join(f"{key}: checkpoint {theirs!r}, this run {ours!r}" for key, theirs, ours in changed)


def check_resumed_data(checkpoint: dict, datamodule: object, new_data: bool) -> None:
    """On resume: with `new_data`, drop the checkpoint's position in its data, so that this data module starts
    from its beginning; without, warn naming the data options that differ from the checkpoint's (from
    Python: `cli.py fit` has refused them before anything loaded)."""
    hparams = getattr(datamodule, "hparams", None)
    if new_data:
        checkpoint.pop(type(datamodule).__qualname__, None)
        return
    saved = checkpoint.get("datamodule_hyper_parameters")
    changed = changed_data_options(saved, dict(hparams)) if saved and hparams is not None else []
    if changed:
        rank_zero_warn(
            f"resuming on other data ({listed_differences(changed)}) at the checkpoint's position in its own "
            "data: to start this data from its beginning instead, fit with GRPOTrainer(...).fit(..., "
            "new_data=True)"
        )


def drop_reference(checkpoint: dict) -> None:
    """Remove the frozen reference's weights from an unsharded checkpoint's state dict."""
    state = checkpoint["state_dict"]
    for key in [k for k in state if k.startswith(REFERENCE_PREFIX)]:
        del state[key]


def restore_reference(checkpoint: dict, reference: nn.Module) -> None:
    """Put the reference's own weights back into a checkpoint that `drop_reference` left without them."""
    if "state_dict" in checkpoint:  # a sharded one was loaded in place
        for key, value in reference.state_dict().items():
            checkpoint["state_dict"].setdefault(REFERENCE_PREFIX + key, value)


def save_module_state(module: L.LightningModule, checkpoint: dict) -> None:
    """A `GRPOModule`'s `on_save_checkpoint`: its GRPO state (generators, bad steps, the group source's
    state, the reference's syncs), and its frozen reference left out unless a sync changed it or the run is
    sharded."""
    # Interrupted during validation (SIGTERM), the generators are the training stream's, saved before it.
    rng = module.validation.training_rng or capture_rng_states()
    syncs = module.reference_sync.syncs_done if module.reference_sync is not None else None
    bad_steps, source = module.optimization.step_guard.bad_steps, module.group_source.state_dict()
    save_grpo_state(checkpoint, bad_steps, rng, source, syncs)
    if not is_sharded(module.policy) and module.reference_sync is None:  # a synced reference is stored
        drop_reference(checkpoint)


def load_module_state(module: L.LightningModule, checkpoint: dict) -> None:
    """A `GRPOModule`'s `on_load_checkpoint`: older scheduler states upgraded, changed options warned about,
    other data refused, the reference restored, the weights checked to fit in one line, and its GRPO state
    taken back (applied when training starts)."""
    upgrade_scheduler_states(checkpoint)  # before Lightning restores the schedulers
    warn_changed_options(checkpoint.get("hyper_parameters", {}), dict(module.hparams))
    if module._trainer is not None and module.trainer.training and module.trainer.datamodule is not None:
        new_data = getattr(module.trainer, "new_data", False)  # GRPOTrainer.fit's
        check_resumed_data(checkpoint, module.trainer.datamodule, new_data)
    if module.reference is not None:
        restore_reference(checkpoint, module.reference)
    if "state_dict" in checkpoint and module.strict_loading:  # one line, not load_state_dict's dump
        check_fits(
            module.state_dict(), checkpoint["state_dict"], module._trainer and module._trainer.ckpt_path
        )
    world = module.trainer.world_size if module._trainer is not None else 1
    own = load_grpo_state(checkpoint, module.global_rank, world)
    if own is not None:
        module.optimization.step_guard.bad_steps = own.bad_steps
        module.rng_to_restore = own.rng
        module.group_source.load_state_dict(own.group_source)
    if module.reference_sync is not None:
        module.reference_sync.syncs_done = reference_syncs_of(checkpoint, module.reference_sync.every)
