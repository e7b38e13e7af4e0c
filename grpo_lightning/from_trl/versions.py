"""TRL's defaults by version: what a TRL recipe got for each option it left unset.

A recipe leaves most options to TRL's defaults, and those changed between releases (open-r1 pins TRL 0.18,
whose `beta` was 0.04; TRL 0.19 made it 0). `cli.py from-trl` fills the options a recipe leaves unset with
the defaults of the TRL version it was written for, from `TRL_DEFAULTS`: one row per default and the first
version that had it, read in TRL's code at that release (`source`), and the transformers `TrainingArguments`
defaults that TRL's `GRPOConfig` inherits. Only the defaults that differ from ours at some version are
listed: for every other option ours is TRL's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TRL_REPO = "https://github.com/huggingface/trl/blob"
TRAINING_ARGUMENTS = "transformers `TrainingArguments` (4.x and 5.x)"


def _at(tag: str, path: str = "trl/trainer/grpo_config.py") -> str:
    return f"{TRL_REPO}/{tag}/{path}"


@dataclass(frozen=True)
class VersionDefault:
    """TRL's default for `option` from version `since` until the next row of the same option.

    `when` names a recipe option that must be true for the default to matter (`use_vllm`: a vLLM option),
    or, prefixed with "!", false.
    """

    option: str
    since: str
    value: object
    source: str
    when: str | None = None


# Each option's rows in the order of their versions.
TRL_DEFAULTS: tuple[VersionDefault, ...] = (
    # Sampling.
    VersionDefault("temperature", "0.14", 0.9, _at("v0.14.0")),
    VersionDefault("temperature", "0.18", 1.0, _at("v0.18.0")),
    # HF `generate` under a `GenerationConfig` without top_k: transformers' default of 50 (vLLM had none).
    VersionDefault("top_k", "0.14", 50, _at("v0.14.0", "trl/trainer/grpo_trainer.py"), when="!use_vllm"),
    VersionDefault("top_k", "0.16", 50, _at("v0.16.0")),
    VersionDefault("top_k", "0.18", 0, _at("v0.18.0")),  # None there: no top-k
    VersionDefault("max_prompt_length", "0.14", 512, _at("v0.14.0")),
    VersionDefault("max_prompt_length", "0.26", None, _at("v0.26.0")),  # removed in 0.28: never cut
    VersionDefault("max_completion_length", "0.14", 256, _at("v0.14.0")),
    VersionDefault(
        "max_completion_length", "1.10", 512, "https://github.com/huggingface/trl/pull/6264 (commit 286d19f)"
    ),
    # The loss and the KL.
    VersionDefault("beta", "0.14", 0.04, _at("v0.14.0")),
    VersionDefault("beta", "0.19", 0.0, _at("v0.19.0")),
    # 0.14: each sequence's token mean, then their mean; 0.16: the token mean of the local batch.
    VersionDefault("loss_type", "0.14", "grpo", _at("v0.14.0", "trl/trainer/grpo_trainer.py")),
    VersionDefault("loss_type", "0.16", "bnpo", _at("v0.16.0", "trl/trainer/grpo_trainer.py")),
    VersionDefault("loss_type", "0.22", "dapo", _at("v0.22.0")),
    VersionDefault("use_bias_correction_kl", "0.14", False, _at("v0.26.0")),  # none before the option
    VersionDefault("use_bias_correction_kl", "1.16", True, "trl 1.16.0 (PyPI): trl/trainer/grpo_config.py"),
    VersionDefault("ref_model_mixup_alpha", "0.15", 0.9, _at("v0.15.0"), when="sync_ref_model"),
    VersionDefault("ref_model_mixup_alpha", "0.16", 0.6, _at("v0.16.0"), when="sync_ref_model"),
    VersionDefault("ref_model_sync_steps", "0.15", 64, _at("v0.15.0"), when="sync_ref_model"),
    VersionDefault("ref_model_sync_steps", "0.16", 512, _at("v0.16.0"), when="sync_ref_model"),
    # vLLM: a server process from 0.18 until 1.0; the sampler's importance-sampling correction from 0.23.
    VersionDefault("vllm_mode", "0.18", "server", _at("v0.18.0"), when="use_vllm"),
    VersionDefault("vllm_mode", "1.0", "colocate", _at("v1.0.0"), when="use_vllm"),
    VersionDefault("vllm_importance_sampling_correction", "0.23", True, _at("v0.23.0"), when="use_vllm"),
    VersionDefault(
        "vllm_importance_sampling_mode",
        "0.23",
        "token_truncate",
        _at("v0.23.0", "trl/trainer/grpo_trainer.py"),  # each token's ratio clamped at the cap
        when="use_vllm",
    ),
    VersionDefault("vllm_importance_sampling_mode", "0.26", "sequence_mask", _at("v0.26.0"), when="use_vllm"),
    VersionDefault("vllm_importance_sampling_cap", "0.23", 2.0, _at("v0.23.0"), when="use_vllm"),
    # vllm_importance_sampling_clip_max from 1.6, with the same default.
    VersionDefault("vllm_importance_sampling_cap", "0.26", 3.0, _at("v0.26.0"), when="use_vllm"),
    # The batch: 0.14 counted prompts per device (each sampled num_generations times), later releases
    # completions.
    VersionDefault("per_device_train_batch_size", "0.14", 1, _at("v0.14.0")),
    VersionDefault("per_device_train_batch_size", "0.15", 8, TRAINING_ARGUMENTS),
    VersionDefault("gradient_accumulation_steps", "0.14", 8, _at("v0.14.0")),
    VersionDefault("gradient_accumulation_steps", "0.15", 1, TRAINING_ARGUMENTS),
    # Training arguments TRL overrides, and those it inherits.
    VersionDefault("bf16", "0.14", False, TRAINING_ARGUMENTS),
    VersionDefault("bf16", "0.19", True, _at("v0.19.0")),  # None there: bf16 unless fp16
    VersionDefault("gradient_checkpointing", "0.14", False, TRAINING_ARGUMENTS),
    VersionDefault("gradient_checkpointing", "0.22", True, _at("v0.22.0")),
    VersionDefault("logging_steps", "0.14", 500, TRAINING_ARGUMENTS),
    VersionDefault("logging_steps", "0.19", 10, _at("v0.19.0")),
    VersionDefault("log_completions", "0.14", False, _at("v0.15.0")),  # none logged before the option
    VersionDefault("lr_scheduler_type", "0.14", "linear", TRAINING_ARGUMENTS),
    VersionDefault("num_train_epochs", "0.14", 3.0, TRAINING_ARGUMENTS),
    VersionDefault("seed", "0.14", 42, TRAINING_ARGUMENTS),
    VersionDefault("eval_strategy", "0.14", "no", TRAINING_ARGUMENTS),
    VersionDefault("save_strategy", "0.14", "steps", TRAINING_ARGUMENTS),
    VersionDefault("save_steps", "0.14", 500, TRAINING_ARGUMENTS),
    # ModelConfig's LoRA: PEFT's own target modules for the architecture, a dropout of 0.05.
    VersionDefault(
        "lora_dropout", "0.14", 0.05, _at("v0.14.0", "trl/trainer/model_config.py"), when="use_peft"
    ),
    VersionDefault(
        "lora_target_modules", "0.14", None, _at("v0.14.0", "trl/trainer/model_config.py"), when="use_peft"
    ),
)

FIRST_VERSION = "0.14"  # GRPOTrainer's first release

_VERSION = re.compile(r"v?(\d+)\.(\d+)(?:\.(\d+))?(?:\.?(?:dev|rc|a|b)\d*)?")
# A recipe naming its TRL version in a comment: `# trl==0.18.0`, `# TRL 0.18`, `trl>=0.14`.
_RECIPE_VERSION = re.compile(r"#.*?\btrl(?:\[[\w,]+\])?\s*(?:==|>=|~=|\s)\s*(v?\d+\.\d+(?:\.\d+)?)", re.I)


def version_key(version: str) -> tuple[int, int]:
    """`version` ("0.18", "0.18.1", "v1.16.0") as (major, minor); anything else raises ValueError."""
    match = _VERSION.fullmatch(version.strip())
    if match is None:
        raise ValueError(f"--trl-version {version!r}: not a version number (write it as 0.18 or 0.18.1)")
    return int(match[1]), int(match[2])


def checked_version(version: str) -> str:
    """`version` as major.minor, refused before TRL's first GRPO release."""
    key = version_key(version)
    if key < version_key(FIRST_VERSION):
        raise ValueError(
            f"--trl-version {version}: TRL has a GRPOTrainer from {FIRST_VERSION} on; give the version the "
            "recipe was written for"
        )
    return f"{key[0]}.{key[1]}"


def recipe_version(text: str) -> str | None:
    """The TRL version a recipe names in a comment (`# trl==0.18.0`), or None."""
    match = _RECIPE_VERSION.search(text)
    return match[1] if match else None


def defaults_at(version: str, recipe: dict[str, object]) -> dict[str, tuple[object, str]]:
    """TRL `version`'s default of every option of `TRL_DEFAULTS` that `recipe` leaves unset, with the row's
    source; a row whose `when` option is not as it asks (in the recipe, else in these defaults) is left out.
    """
    key = version_key(version)
    latest: dict[str, VersionDefault] = {}
    for row in TRL_DEFAULTS:
        if version_key(row.since) <= key:
            latest[row.option] = row
    chosen = {option: row for option, row in latest.items() if option not in recipe}

    def on(option: str) -> bool:
        if option in recipe:
            return bool(recipe[option])
        return bool(chosen[option].value) if option in chosen else False

    applying = {}
    for option, row in chosen.items():
        if row.when is not None:
            wanted = not row.when.startswith("!")
            if on(row.when.lstrip("!")) != wanted:
                continue
        applying[option] = (row.value, row.source)
    return applying


VERSIONS = sorted({row.since for row in TRL_DEFAULTS}, key=version_key)  # the releases whose defaults changed
NEWEST_VERSION = VERSIONS[-1]
