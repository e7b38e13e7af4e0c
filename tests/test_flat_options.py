"""Options by their flat names (TRL's, and every option's before the options had sections) keep working:
the shipped configs of that layout build the very options that code built (`tests/fixtures/`), a checkpoint
of that layout reads back into the sections, and a name given both ways is refused in one line."""

import dataclasses
import json
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from grpo_lightning.cli.sections import sectioned_argv
from grpo_lightning.core.config import FLAT_NAMES, GRPOConfig
from grpo_lightning.io.hparams import sectioned_hparams

FIXTURES = Path(__file__).parent / "fixtures"
OLD_CONFIGS = FIXTURES / "flat_options_configs"
OLD_OPTIONS = json.loads((OLD_CONFIGS / "options.json").read_text())
# The flat names added since that layout (TRL's and verl's), with the defaults that an old config gets.
ADDED_OPTIONS = {
    "optim": "adamw_torch_fused",
    "adam_beta1": 0.9,
    "adam_beta2": 0.999,
    "adam_epsilon": 1e-8,
    "max_tool_calling_iterations": None,
    "max_tool_response_length": None,
    "tool_call_format": None,
    "check_tool_arguments": False,
    "tool_call_timeout": 60.0,
    "environment_timeout": 300.0,
    "warmup_ratio": 0.0,
    "top_entropy_quantile": 1.0,
    "logging_first_step": False,
    "chat_template_kwargs": None,
    "vllm_mode": None,
    "vllm_server_base_url": None,
    "vllm_server_host": "127.0.0.1",
    "vllm_server_port": 8000,
    "vllm_server_timeout": 240.0,
    "vllm_server_request_timeout": 600.0,
    "vllm_group_port": 51216,
    "vllm_server_trainer_host": None,
    "vllm_server_weight_plane": "auto",
    "vllm_server_weights_dir": None,
    "vllm_server_max_in_flight": 64,
    "max_staleness": 0,
    "stale_groups": "drop",
    "off_policy_correction": "importance_sampling",
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}
# The defaults changed since that layout, which an old config that leaves the option out now gets.
CHANGED_DEFAULTS = {"max_prompt_length": None}  # 512 then; TRL 1.x has no prompt cut


def flat(config: GRPOConfig) -> dict:
    """Every option of `config` by its flat name (a switch: whether its section is on)."""
    return {
        name: bool(getattr(config, name)) if e.switch else getattr(config, name)
        for name, e in FLAT_NAMES.items()
    }


def test_the_alias_table_holds_every_flat_option_once():
    old_names = set(next(iter(OLD_OPTIONS.values())))
    assert set(FLAT_NAMES) == old_names | set(ADDED_OPTIONS)  # none lost, none invented but those added
    assert len({entry.key for entry in FLAT_NAMES.values()}) == len(FLAT_NAMES)


@pytest.mark.parametrize("name", sorted(OLD_OPTIONS))
def test_an_old_config_builds_the_options_the_old_code_built(name):
    argv = sectioned_argv(["fit", "--config", str(OLD_CONFIGS / name)])
    config = yaml.safe_load(argv[2])  # passed on as YAML text, its flat names filed into sections
    grpo = config["model"]["grpo"]
    assert not set(grpo) & {n for n, e in FLAT_NAMES.items() if e.path != (n,)}  # no flat name left
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built = GRPOConfig(**grpo)
    given = (OLD_CONFIGS / name).read_text()
    changed = {option: value for option, value in CHANGED_DEFAULTS.items() if option not in given}
    assert flat(built) == OLD_OPTIONS[name] | ADDED_OPTIONS | changed


def test_an_old_checkpoint_reads_back_into_the_sections():
    checkpoint = torch.load(
        FIXTURES / "flat_options_run" / "step2.ckpt", weights_only=True, map_location="cpu"
    )
    saved = checkpoint["hyper_parameters"]["grpo"]
    assert "beta" in saved and "kl" not in saved  # written by the flat layout
    sectioned = sectioned_hparams(checkpoint["hyper_parameters"])["grpo"]
    config = GRPOConfig(**sectioned)
    assert {name: flat(config)[name] for name in saved} == saved
    assert config.dynamic_sampling is not None and config.kl.beta == saved["beta"]


def test_flat_names_on_the_command_line_are_filed_into_sections():
    argv = sectioned_argv(
        [
            "fit",
            "--model.grpo.beta",
            "0.04",
            "--model.grpo.importance_sampling_correction=true",
            "--model.grpo.sync_ref_model",
            "false",
            "--model.grpo.sampling.top_p",
            "0.9",
            "--trainer.max_steps",
            "3",
        ]
    )
    assert argv == [
        "fit",
        "--model.grpo.kl.beta=0.04",
        "--model.grpo.sampler_correction={}",
        "--model.grpo.reference_sync=null",
        "--model.grpo.sampling.top_p",
        "0.9",
        "--trainer.max_steps",
        "3",
    ]


def test_a_name_given_both_ways_is_refused_in_one_line():
    with pytest.raises(
        ValueError, match=r"^GRPOConfig: beta and kl\.beta are one option, given twice: give one$"
    ):
        GRPOConfig(beta=0.1, kl={"beta": 0.2})
    # A flat name over a section given as an instance replaces its option (`dataclasses.replace`).
    config = dataclasses.replace(GRPOConfig(beta=0.1, kl_estimator="k2"), beta=0.3)
    assert (config.kl.beta, config.kl.estimator) == (0.3, "k2")


@pytest.mark.parametrize("name", sorted(OLD_OPTIONS))
def test_an_old_pickle_s_flat_state_unpickles_into_the_sections(name):
    """What unpickling a `GRPOConfig` of the flat layout does: `__setstate__` with its flat `__dict__` (the
    fixture's values are exactly that); and a sectioned one round-trips through pickle unchanged."""
    config = object.__new__(GRPOConfig)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config.__setstate__(OLD_OPTIONS[name])
    assert flat(config) == OLD_OPTIONS[name] | ADDED_OPTIONS
    assert pickle.loads(pickle.dumps(config)) == config
