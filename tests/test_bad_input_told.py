"""Options are applied, or the user is told: an option that does nothing without another is warned about,
naming both; the benchmark refuses a results file given twice (or two holding one run) and an accuracy
before training measured on another setup; the training budget says why it stops a run."""

import json
import math
import warnings
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from grpo_lightning.core.config import FLAT_NAMES, GRPOConfig
from grpo_lightning.core.flat_names import default_at
from grpo_lightning.core.generation.backends import EngineOptions
from grpo_lightning.core.generation.vllm_engine import VLLMOptions
from grpo_lightning.core.options import declared_annotation, declared_rule, section_class
from grpo_lightning.demo.cpu_budget import CPUTimeBudget
from tests.test_heldout import load_script

COMPARE = load_script("compare_options", "benchmarks/compare_options.py")

# The options of each optional section, by their flat names, and the switch that turns the section on: all
# derived from the sections' declarations, so an option added to such a section is covered here unasked.
SWITCHES = {entry.path: name for name, entry in FLAT_NAMES.items() if entry.switch}
IN_OPTIONAL = {
    name: SWITCHES[entry.path[:1]]
    for name, entry in FLAT_NAMES.items()
    if not entry.switch and entry.path[:1] in SWITCHES
}
ENABLES = {"sync_ref_model": {"beta": 0.1}}  # what a switch needs beside it to be valid


def section_of(path: tuple[str, ...]) -> type:
    """The section class that holds the option at `path`."""
    cls = GRPOConfig
    for key in path[:-1]:
        cls = section_class(declared_annotation(cls, key))
    return cls


def other_value(path: tuple[str, ...], draw) -> object:
    """A valid value other than the default for the option at `path`, from its annotation's rule."""
    rule = declared_rule(section_of(path), path[-1])
    default = default_at(GRPOConfig, path)
    candidates = list(rule.choices) or [True, False, 1, 2, 3, 5, 0.5, 0.9, 1.5, "format_reward", None]
    allowed = [v for v in candidates if v != default and rule.problem(v) is None]
    return draw(st.sampled_from([v for v in allowed if not isinstance(v, bool) or bool in rule.kinds]))


@given(option=st.sampled_from(sorted(IN_OPTIONAL)), data=st.data(), enabled=st.booleans())
def test_an_option_of_a_section_that_is_off_is_warned_naming_its_switch(option, data, enabled):
    assert {"dynamic_sampling", "importance_sampling_correction", "sync_ref_model"} <= set(SWITCHES.values())
    switch = IN_OPTIONAL[option]
    value = other_value(FLAT_NAMES[option].path, data.draw)
    on = {switch: True, **ENABLES.get(switch, {})} if enabled else {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = GRPOConfig(**{option: value, **on})
    said = [str(w.message) for w in caught if "has no effect" in str(w.message)]
    if enabled:
        assert said == [] and getattr(config, option) == value
    else:
        assert said == [f"GRPOConfig.{option}={value!r} has no effect without {switch}: true"]
        assert getattr(config, FLAT_NAMES[switch].key) is None  # the section stays off


# Options inside a section that need another option of theirs: the rule each section states.
NEEDS = {
    "kl_estimator": ("k2", {"beta": 0.1}, "beta > 0"),
    "use_bias_correction_kl": (False, {"beta": 0.1}, "beta > 0 and the KL in the loss"),
    "min_lr_ratio": (0.1, {"lr_scheduler_type": "cosine"}, "lr_scheduler_type: linear or cosine"),
    **{
        name: (value, {"generation_backend": "auto"}, "engine.backend: vllm (or auto)")
        for name, value in (
            ("vllm_max_model_len", 64),
            ("vllm_kv_cache_gb", 2.0),
            ("vllm_gpu_memory_utilization", 0.5),
            ("vllm_enable_sleep_mode", True),
            ("vllm_enforce_eager", True),
        )
    },
}


@pytest.mark.parametrize("option", sorted(NEEDS))
def test_an_option_without_the_one_it_needs_in_its_section_is_warned(option):
    vllm = {n for n, e in FLAT_NAMES.items() if e.path[:2] == ("engine", "vllm")}
    assert {n for n in NEEDS if n.startswith("vllm_")} == vllm  # every option of the vLLM engine's section
    assert EngineOptions().vllm == VLLMOptions()
    value, needed, named = NEEDS[option]
    alone = {"generation_backend": "eager"} if option.startswith("vllm_") else {}
    for others, expect in ((alone, True), (needed, False)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            GRPOConfig(**{option: value, **others})
        said = [str(w.message) for w in caught if "has no effect" in str(w.message)]
        assert (len(said) == 1 and named in said[0] and repr(value) in said[0]) if expect else said == []


def results_file(path, config: str, variant: str = "baseline", seed: int = 0, **setup) -> str:
    """A results file as the benchmark writes it, of one run."""
    run = {
        "variant": variant,
        "heldout_problems": 2,
        "before": {"strict": 0.5, "lenient": 0.5, "correct": [1, 0]},
        "after": {"strict": 1.0, "lenient": 1.0, "correct": [1, 1]},
        "gain_se": 0.3,
        "steps": 3,
        "rounds": 3,
        "frac_no_signal": 0.0,
        "frac_truncated": 0.0,
        "generate_share": 0.5,
        "train_cpu_seconds": 9.0,
        "train_seconds": 5.0,
        "curve": [],
    }
    record = {"written_by": COMPARE.WRITER, "config": config, "overrides": [], "seed": seed, "results": [run]}
    path.write_text(json.dumps({**record, "heldout_setup": setup}))
    return str(path)


def test_report_counts_each_run_once(tmp_path):
    config = str(tmp_path / "config.yaml")
    a = results_file(tmp_path / "a.json", config)
    with pytest.raises(ValueError, match=f"--report {a} is given twice: its runs would count as more seeds"):
        COMPARE.seeds_report([a, a])
    with pytest.raises(ValueError, match="--report .* is given twice"):
        COMPARE.seeds_report([a, str(tmp_path / "." / "a.json")])
    copy = results_file(tmp_path / "copy.json", config)
    with pytest.raises(ValueError, match=f"--report: {a} and {copy} both hold run 'baseline' of seed 0"):
        COMPARE.seeds_report([a, copy])
    other_seed = results_file(tmp_path / "b.json", config, seed=1)
    assert "mean of 2" in COMPARE.seeds_report([a, other_seed])
    (tmp_path / "notes.json").write_text('{"mine": 1}')
    with pytest.raises(ValueError, match="not a results file of this script"):
        COMPARE.seeds_report([a, str(tmp_path / "notes.json")])


@given(
    changed=st.sampled_from(["model.policy", "data.source", "data.val_size", "trainer.precision", "device"]),
)
def test_before_from_another_setup_is_refused_naming_what_differs(tmp_path_factory, changed):
    folder = tmp_path_factory.mktemp("before")
    config = {
        "model": {"policy": "models/a"},
        "data": {"source": "arithmetic", "val_size": 2, "batch_size": 2},
    }
    setup = COMPARE.heldout_setup(config, "cpu")
    path = results_file(folder / "before.json", "config.yaml", **setup)
    assert COMPARE.load_before(path, setup)["correct"] == [1, 0]
    # What the accuracy before training does not depend on: free to differ.
    assert COMPARE.load_before(
        path, COMPARE.heldout_setup({**config, "data": {**config["data"], "batch_size": 8}}, "cpu")
    )
    other = {**setup, changed: "something else"}
    with pytest.raises(ValueError, match=f"--before {path} was measured on another setup \\({changed}: its "):
        COMPARE.load_before(path, other)


def test_the_budget_says_why_it_stops(caplog):
    budget = CPUTimeBudget(max_wall_seconds=1.0)
    trainer = SimpleNamespace(should_stop=False, global_step=4)
    budget.on_train_batch_start(trainer, None, None, 0)
    budget.wall_seconds = 0.6  # as if the first batch took 0.6 s: a second one would pass 1.0
    with caplog.at_level("INFO"):
        budget.on_train_batch_end(trainer, None, None, None, 0)
    assert trainer.should_stop and budget.stopped_by == "max_wall_seconds"
    (message,) = [r.getMessage() for r in caplog.records if "CPUTimeBudget" in r.getMessage()]
    assert message.startswith(
        "CPUTimeBudget: stopping after 1 training batch(es), 4 optimizer step(s): 0.6 s"
    )
    assert "would pass max_wall_seconds=1" in message
    assert math.isclose(budget.wall_seconds, 0.6, abs_tol=0.05)
