"""Results files agree with the metrics: with several validation sets, each line of `validate --results.path`
names its set and is judged by that set's own checker (its reward function, or the numeric answer check),
so that each set's share of correct lines is its logged accuracy; the names a fit's monitors are checked
against are the names validation logs."""

import json

import lightning as L
import pytest

from grpo_lightning.training.callbacks.results_writer import ValidationResultsWriter
from tests.test_validation_sets import MARKS, module_and_data, write_math_file


def test_each_line_names_its_set_and_is_judged_by_its_checker(tiny_model_dir, tmp_path):
    module, data = module_and_data(tiny_model_dir, write_math_file(tmp_path / "math.jsonl"))
    path = tmp_path / "val.jsonl"
    trainer = L.Trainer(
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ValidationResultsWriter(str(path))],
    )
    trainer.validate(module, data)
    metrics = {key: float(value) for key, value in trainer.callback_metrics.items()}
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    by_set = {name: [line for line in lines if line["set"] == name] for name in (None, "gsm8k_test", "math")}
    assert [len(by_set[name]) for name in by_set] == [3, 5 * 2, len(MARKS)]  # problems x samples, each once
    assert len(lines) == sum(len(rows) for rows in by_set.values())
    for name, rows in by_set.items():
        prefix = "val/" if name is None else f"val/{name}/"
        share = sum(bool(line["correct"]) for line in rows) / len(rows)
        assert share == pytest.approx(metrics[prefix + "accuracy"]), name
    # The math set is judged by its reward (full marks where the row says so), not the numeric check.
    assert [line["correct"] for line in by_set["math"]] == [mark >= 1 for mark in MARKS]
    assert [line["reward"] for line in by_set["math"]] == MARKS and "extracted" not in by_set["math"][0]
    assert sum(line["correct"] for line in lines) > 0  # the file's count of correct lines is not 0
    # The names the fit checks hold monitors to are exactly the validation metrics logged.
    assert set(module.validation.metric_names(data)) == {key for key in metrics if key.startswith("val/")}
