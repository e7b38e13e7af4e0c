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

from grpo_lightning.core.config import INERT_UNLESS, GRPOConfig
from grpo_lightning.demo.cpu_budget import CPUTimeBudget
from tests.test_heldout import load_script

COMPARE = load_script("compare_options", "benchmarks/compare_options.py")

# A value other than the default for each option that needs another, and the setting that gives it effect.
SET_ALONE = {
    "ref_model_sync_steps": (st.integers(1, 511), {"sync_ref_model": True, "beta": 0.1}),
    "ref_model_mixup_alpha": (st.floats(0, 0.59), {"sync_ref_model": True, "beta": 0.1}),
    "dynamic_sampling_max_rounds": (st.integers(0, 8), {"dynamic_sampling": True}),
    "dynamic_sampling_metric": (st.sampled_from([None, "format_reward"]), {"dynamic_sampling": True}),
    "min_lr_ratio": (st.floats(0.01, 1), {"lr_scheduler_type": "cosine"}),
    "kl_estimator": (st.sampled_from(["k2"]), {"beta": 0.1}),
    "use_bias_correction_kl": (st.just(False), {"beta": 0.1}),
    "importance_sampling_cap": (
        st.floats(1, 10).filter(lambda c: c != 2.0),
        {"importance_sampling_correction": True},
    ),
}


@given(option=st.sampled_from(sorted(SET_ALONE)), data=st.data(), enabled=st.booleans())
def test_an_option_without_the_one_it_needs_is_warned_naming_both(option, data, enabled):
    assert set(SET_ALONE) == set(INERT_UNLESS)
    values, needed = SET_ALONE[option]
    value = data.draw(values)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        GRPOConfig(**{option: value, **(needed if enabled else {})})
    said = [str(w.message) for w in caught if "has no effect" in str(w.message)]
    if enabled:
        assert said == []
    else:
        assert said == [f"GRPOConfig.{option}={value!r} has no effect without {INERT_UNLESS[option][0]}"]
        assert next(iter(needed)) in said[0]  # the option that gives it effect is named


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
