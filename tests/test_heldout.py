"""The demo's statistics (binomial and paired standard errors, spread over seeds), the CPU-time budget that
caps its training, and `scripts/demo.py --seeds` end to end on a tiny model."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import statistics
import time
from unittest import mock

import matplotlib.image
import pytest
import torch
import yaml
from lightning.pytorch.demos.boring_classes import BoringModel

from grpo_lightning.demo import curves as curves_module
from grpo_lightning.demo.cpu_budget import CPUTimeBudget
from grpo_lightning.demo.heldout import binomial_se, heldout_correct, paired_gain_se, seed_spread
from tests.helpers import quiet_trainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_binomial_se_is_sqrt_p_q_over_n():
    assert binomial_se([True, False, True, True]) == pytest.approx(math.sqrt(0.75 * 0.25 / 4), abs=1e-12)
    assert binomial_se([True] * 5) == 0.0


def test_paired_gain_se_is_the_se_of_the_per_problem_differences():
    generator = torch.Generator().manual_seed(0)
    before = (torch.rand(200, generator=generator) < 0.3).tolist()
    after = [b or bool(torch.rand(1, generator=generator) < 0.4) for b in before]  # solved stay solved
    diffs = torch.tensor(
        [float(a) - float(b) for b, a in zip(before, after, strict=True)], dtype=torch.float64
    )
    expected = math.sqrt(diffs.var(unbiased=False).item() / 200)
    assert paired_gain_se(before, after) == pytest.approx(expected, abs=1e-12)
    # Problems solved both times add no variance: below the unpaired sqrt(se_before^2 + se_after^2).
    assert paired_gain_se(before, after) < math.hypot(binomial_se(before), binomial_se(after))
    assert paired_gain_se(before, before) == 0.0
    with pytest.raises(ValueError, match="3 problems before, 2 after"):
        paired_gain_se([True] * 3, [True] * 2)


def test_seed_spread_matches_statistics():
    values = [12.5, 30.0, 21.0]
    spread = seed_spread(values)
    assert spread["mean"] == pytest.approx(statistics.mean(values), abs=1e-12)
    assert spread["std"] == pytest.approx(statistics.stdev(values), abs=1e-12)
    assert spread["se"] == pytest.approx(statistics.stdev(values) / math.sqrt(3), abs=1e-12)
    assert (spread["min"], spread["max"]) == (12.5, 30.0)
    assert seed_spread([4.0])["std"] == 0.0


class BusyModel(BoringModel):
    """Each training step burns `cpu_per_step` CPU seconds of this process."""

    cpu_per_step = 0.05

    def training_step(self, batch, batch_idx):
        start = time.process_time()
        while time.process_time() - start < self.cpu_per_step:
            pass
        return super().training_step(batch, batch_idx)


def test_cpu_budget_stops_before_the_budget_and_measures_without_one():
    budget = CPUTimeBudget(max_cpu_seconds=0.3)  # about 5 steps of 0.05 s and Lightning's overhead
    trainer = quiet_trainer(max_steps=50, callbacks=[budget], enable_model_summary=False)
    trainer.fit(BusyModel())
    assert 2 <= trainer.global_step < 6
    assert budget.batches == trainer.global_step
    assert BusyModel.cpu_per_step * budget.batches <= budget.cpu_seconds <= 0.3

    unlimited = CPUTimeBudget()
    trainer = quiet_trainer(max_steps=4, callbacks=[unlimited])
    trainer.fit(BusyModel())
    assert trainer.global_step == 4 and unlimited.cpu_seconds >= 4 * BusyModel.cpu_per_step
    with pytest.raises(ValueError, match="CPUTimeBudget.max_cpu_seconds=0: must be > 0"):
        CPUTimeBudget(0)


class SleepyModel(BoringModel):
    """Each training step waits 0.05 s of wall-clock and uses almost no CPU."""

    def training_step(self, batch, batch_idx):
        time.sleep(0.05)
        return super().training_step(batch, batch_idx)


def test_wall_budget_stops_on_wall_clock_while_the_cpu_budget_is_far():
    budget = CPUTimeBudget(max_cpu_seconds=100.0, max_wall_seconds=0.3)
    trainer = quiet_trainer(max_steps=50, callbacks=[budget], enable_model_summary=False)
    trainer.fit(SleepyModel())
    assert 2 <= trainer.global_step < 6
    assert budget.wall_seconds <= 0.3 and budget.cpu_seconds < 0.3
    with pytest.raises(ValueError, match="CPUTimeBudget.max_wall_seconds=-1: must be > 0"):
        CPUTimeBudget(max_wall_seconds=-1)


def tiny_demo(tiny_model_dir, tmp_path) -> tuple:
    """scripts/demo.py, and the demo config on the tiny model (2 optimizer steps of one rollout, 4 held-out
    rows) in bf16-mixed, written to `tmp_path`; with a list that records the precision of the engine each
    evaluation decoded with, once `heldout_correct` is patched with the function returned last."""
    with open(os.path.join(REPO, "configs", "demo_arithmetic.yaml"), encoding="utf-8") as f:
        config = yaml.safe_load(f)
    # bf16-mixed: the evaluations must decode in the trainer's precision, not the float32 of no trainer
    trainer = config["trainer"]
    trainer.update(max_steps=2, default_root_dir=str(tmp_path), logger=False, precision="bf16-mixed")
    config["model"]["policy"] = tiny_model_dir
    grpo = config["model"]["grpo"]  # in sections, as the shipped config writes them
    grpo["sampling"].update(num_generations=2, max_completion_length=8)
    grpo.setdefault("run", {})["preflight"] = False
    config["data"].update(val_size=4, val_batch_size=4, batch_size=2)
    grpo.setdefault("update", {})["steps_per_generation"] = 2  # one rollout, 2 optimizer steps of one prompt
    path = tmp_path / "demo.yaml"
    path.write_text(yaml.safe_dump(config))
    precisions = []

    def recorded(module, *args):
        results = heldout_correct(module, *args)
        precisions.append(module.rollouts.engine_precision)
        return results

    return load_script("demo", "scripts/demo.py"), str(path), config, precisions, recorded


def test_demo_with_seeds_reports_the_mean_gain(tiny_model_dir, tmp_path):
    """`scripts/demo.py --seeds 2` on a tiny model and the demo config: two runs from the same measured
    `before`, each under the config's CPU and wall-clock budget, and the mean of their gains."""
    demo, path, config, precisions, recorded = tiny_demo(tiny_model_dir, tmp_path)
    with (
        mock.patch.object(demo, "heldout_correct", recorded),
        mock.patch.object(demo, "cpu_multiplies_bf16", lambda: True),
    ):
        demo.main(["--config", path, "--seeds", "2", "--threads", str(torch.get_num_threads())])
    # before (once), after seed 0, after seed 1: all in the config's precision, as training sampled
    assert precisions == ["bf16-mixed"] * 3

    summary = json.loads((tmp_path / "summary.json").read_text())
    runs = summary["runs"]
    assert [r["seed"] for r in runs] == [0, 1]
    assert runs[0]["accuracy_before"] == runs[1]["accuracy_before"]
    assert all(r["steps"] == 2 and r["heldout_problems"] == 4 and r["train_cpu_seconds"] > 0 for r in runs)
    assert all(r["precision"] == "bf16-mixed" for r in runs)
    limits = config["trainer"]["callbacks"][0]["init_args"]
    assert all(r["cpu_budget_seconds"] == limits["max_cpu_seconds"] for r in runs)
    assert all(r["wall_budget_seconds"] == limits["max_wall_seconds"] == 420 for r in runs)
    gains = [100 * r["gain"] for r in runs]
    assert summary["mean_gain_points"]["mean"] == pytest.approx(sum(gains) / 2, abs=1e-9)
    for r in runs:
        assert r["gain"] == pytest.approx(r["accuracy_after"] - r["accuracy_before"], abs=1e-12)
    check_curves(tmp_path, runs)


def test_demo_trains_in_float32_on_a_cpu_without_bf16_matrix_instructions(tiny_model_dir, tmp_path, capsys):
    demo, path, _, precisions, recorded = tiny_demo(tiny_model_dir, tmp_path)
    with (
        mock.patch.object(demo, "heldout_correct", recorded),
        mock.patch.object(demo, "cpu_multiplies_bf16", lambda: False),
    ):
        demo.main(["--config", path, "--threads", str(torch.get_num_threads()), "--cpu_seconds", "500"])
    assert precisions == ["32-true"] * 2  # before and after, as training
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["precision"] == "32-true" and summary["steps"] == 2
    # --cpu_seconds: the CPU budget given, and no wall-clock limit
    assert summary["cpu_budget_seconds"] == 500 and summary["wall_budget_seconds"] is None
    assert "trainer.precision=32-true, not bf16-mixed" in capsys.readouterr().out


def check_curves(folder, runs: list[dict]) -> None:
    """The demo's picture: the numbers beside it are each seed's logged rewards and held-out accuracies, and
    the PNG, read back, is the figure's size with both panels' lines drawn."""
    curves = json.loads((folder / "curves.json").read_text())["runs"]
    assert [c["seed"] for c in curves] == [r["seed"] for r in runs]
    for curve, run in zip(curves, runs, strict=True):
        ((step, reward),) = curve["reward"]  # one rollout, whose 2 optimizer steps end at step 2
        assert step == 2 and 0.0 <= reward <= 2.0  # accuracy + format rewards
        ((step, accuracy),) = curve["train_accuracy"]  # the sampled completions' accuracy_reward
        assert step == 2 and 0.0 <= accuracy <= reward  # a part of the reward
        assert curve["train_calls"] == [] and run["tool_calls_before"] == run["tool_calls_after"] == 0.0
        before = [0, run["accuracy_before"], run["accuracy_before_se"]]
        assert curve["accuracy"] == [before, [2, run["accuracy_after"], run["accuracy_after_se"]]]
    image = matplotlib.image.imread(folder / "curves.png")  # [H, W, RGBA] in 0..1
    inches, dpi = curves_module.FIGURE_INCHES, curves_module.DPI
    assert image.shape[:2] == (int(inches[1] * dpi), int(inches[0] * dpi))
    top, bottom = image[: image.shape[0] // 2, :, :3], image[image.shape[0] // 2 :, :, :3]
    blue = top[..., 2] - top[..., 0] > 0.2  # the reward's points and legend, any seed's shade
    red = bottom[..., 0] - bottom[..., 2] > 0.2  # the accuracy points at step 0 and step 2
    assert blue.sum() > 30 and not (bottom[..., 2] - bottom[..., 0] > 0.2).any()
    assert red.sum() > 30 and not (top[..., 0] - top[..., 2] > 0.2).any()


def load_script(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_compare_options_report_gives_each_runs_mean_gain_over_seeds(tmp_path):
    compare = load_script("compare_options", "benchmarks/compare_options.py")
    config = os.path.join(REPO, "configs", "demo_arithmetic.yaml")
    paths = []
    for seed, after in ((0, 0.40), (1, 0.50), (2, 0.30)):
        run = {
            "variant": "lr 3e-5",
            "before": {"strict": 0.25, "lenient": 0.26},
            "after": {"strict": after, "lenient": after},
            "gain_se": 0.03,
            "steps": 10 + seed,
            "rounds": 10 + seed,
            "frac_no_signal": 0.2,
            "frac_truncated": 0.1,
            "generate_share": 0.5,
            "train_cpu_seconds": 100.0 * (seed + 1),
            "train_seconds": 60.0,
            "curve": [],
        }
        path = tmp_path / f"seed{seed}.json"
        overrides = [f"seed_everything={seed}"]
        path.write_text(json.dumps({"config": config, "overrides": overrides, "results": [run]}))
        paths.append(str(path))
    table = compare.seeds_report(paths).splitlines()
    assert [line.split("|")[2].strip() for line in table[2:5]] == ["0", "1", "2"]
    assert "+15.0 ± 3.0" in table[2] and "| 100 | 10.0 |" in table[2]
    # Gains +15, +25, +5: mean +15, sample sd 10, range +5..+25; mean CPU seconds 200, mean steps 11.
    assert "**+15.0** (sd 10.0, +5.0..+25.0)" in table[5] and "| 11 |" in table[5] and "| 200 |" in table[5]
    assert all(line.count("|") == table[0].count("|") for line in table)


def test_compare_options_runs_the_demo_config_and_evaluates_in_its_precision(tiny_model_dir, tmp_path):
    """`benchmarks/compare_options.py` on the demo config (static rollouts), in bf16-mixed with 2 optimizer
    steps per rollout, with a tiny model: the steps it reports are the trainer's, its gain is after - before,
    and the evaluation before training decodes in the trainer's precision, as the one after does."""
    compare = load_script("compare_options", "benchmarks/compare_options.py")
    precisions = []

    def recorded(module, *args):
        results = heldout_correct(module, *args)
        precisions.append(module.rollouts.engine_precision)
        return results

    out = tmp_path / "results.json"
    overrides = [
        f"model.policy={tiny_model_dir}",
        "model.grpo.num_generations=2",
        "model.grpo.max_completion_length=8",
        "model.grpo.preflight=false",
        "data.val_size=4",
        "data.val_batch_size=4",
        "data.batch_size=2",
        "model.grpo.steps_per_generation=2",
        "trainer.precision=bf16-mixed",
    ]
    args = ["--max_steps", "2", "--eval_every", "1000", "--variants", "baseline", "--out", str(out)]
    with mock.patch.object(compare, "heldout_correct", recorded):
        threads = ["--threads", str(torch.get_num_threads())]
        compare.main(args + threads + [a for o in overrides for a in ("--set", o)])
    (run,) = json.loads(out.read_text())["results"]
    assert (run["steps"], run["rounds"]) == (2, 1)  # one rollout, two optimizer steps
    assert run["heldout_problems"] == len(run["before"]["correct"]) == len(run["after"]["correct"]) == 4
    assert run["after"]["strict"] == sum(run["after"]["correct"]) / 4
    assert precisions and set(precisions) == {"bf16-mixed"}
