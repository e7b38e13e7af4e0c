"""Several validation sets: per-set checkers, sample counts and metric names, monitoring one set's metric,
and under DDP (2 gloo processes, an odd number of rows) exactly the one-process metrics: no row counts
twice. The DDP run is made in the distributed tests' one launch of 2 processes (`two_rank_jobs` below and
tests/two_ranks.py)."""

import json
import os
from pathlib import Path

import lightning as L
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from grpo_lightning.cli import build_cli
from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.rewards.verifiable import reference_answer
from grpo_lightning.training.data import GSM8KDataModule
from grpo_lightning.training.module import GRPOModule
from grpo_lightning.training.validation_scores import ValidationScoring
from grpo_lightning.training.validation_sets import COUNTED, SetScores, ValidationSet, rank_share
from tests.helpers import GSM8K_DIR, gsm8k_rows

MARKS = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0]  # 7 rows: 3/7 right; Lightning's padding would count row 0 twice


def mark_reward(completions, mark, **kwargs) -> list[float]:
    """Full marks where the row says so, whatever the completion: the set's accuracy is known exactly."""
    return list(mark)


def even_answer_reward(completions, answer, **kwargs) -> list[float]:
    """Full marks where the GSM8K row's answer is even, whatever the completion: known exactly, as above."""
    return [float(int(reference_answer(a)) % 2 == 0) for a in answer]


def write_math_file(path) -> str:
    """A MATH-500-style file: `problem`, a LaTeX `answer` (no number to check), and the test's `mark`."""
    rows = [
        {"problem": f"Simplify $\\frac{{{i}}}{{{i + 1}}}$.", "answer": f"\\frac{{{i}}}{{{i + 1}}}", "mark": m}
        for i, m in enumerate(MARKS)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@given(rows=st.integers(1, 30), world=st.integers(1, 5))
def test_rank_shares_hold_every_row_once_and_equal_counts(rows, world):
    table = [{"i": i} for i in range(rows)]
    shares = [rank_share(table, rank, world) for rank in range(world)]
    assert len({len(share) for share in shares}) == 1  # every rank takes as many batches
    counted = sorted(row["i"] for share in shares for row in share if row[COUNTED])
    assert counted == list(range(rows))


def test_set_scores_leave_the_repeats_out():
    scores = SetScores("val/x/", num_generations=2, reward=mark_reward)
    lengths = torch.tensor([3, 5, 7, 9])  # [2 problems * k=2]
    scores.update_rewards([True, False], lengths, [1.0, 0.0, 1.0, 1.0])
    results = scores.compute()
    assert float(results["val/x/accuracy"]) == 0.5 and float(results["val/x/pass_at_k"]) == 1.0
    assert float(results["val/x/completion_length"]) == 4.0


def test_a_set_with_latex_answers_needs_a_reward(tmp_path):
    from grpo_lightning.training.validation_sets import read_validation_rows

    path = write_math_file(tmp_path / "math.jsonl")
    with pytest.raises(
        ValueError, match=r"validation set 'math', .*math.jsonl:1: field 'answer' is not a number"
    ):
        read_validation_rows(ValidationSet(name="math", source=path, question_field="problem"))
    with pytest.raises(ValueError, match=r"data.val_sets\[0\].num_generations=0: must be an integer >= 1"):
        GSM8KDataModule(source="arithmetic", val_sets=[ValidationSet("a", path, num_generations=0)]).setup()
    with pytest.raises(ValueError, match="the name 'a' is used twice"):
        GSM8KDataModule(source="arithmetic", val_sets=[ValidationSet("a", path)] * 2).setup()


def validation_sets(math_file: str, gsm8k_reward=None) -> list[ValidationSet]:
    return [
        ValidationSet(
            name="gsm8k_test",
            source=GSM8K_DIR,
            question_field="question",
            size=5,
            num_generations=2,
            reward=gsm8k_reward,
        ),
        ValidationSet(
            name="math", source=math_file, question_field="problem", reward=mark_reward, batch_size=2
        ),
    ]


def module_and_data(model_dir: str, math_file: str, val_size: int = 3, gsm8k_reward=None):
    grpo = GRPOConfig(num_generations=2, max_completion_length=4, preflight=False)
    module = GRPOModule(model_dir, grpo=grpo, num_generations_eval=1)
    data = GSM8KDataModule(
        source="arithmetic",
        arithmetic_size=20,
        val_size=val_size,
        val_batch_size=2,
        val_sets=validation_sets(math_file, gsm8k_reward),
    )
    return module, data


def test_each_set_is_scored_on_its_own(tiny_model_dir, tmp_path):
    module, data = module_and_data(tiny_model_dir, write_math_file(tmp_path / "math.jsonl"))
    trainer = L.Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    trainer.validate(module, data)
    results = {key: float(value) for key, value in trainer.callback_metrics.items()}
    assert not any("dataloader_idx" in key for key in results)  # logged under the sets' own names
    for prefix in ("val/", "val/gsm8k_test/"):
        for key in ("accuracy", "accuracy_strict", "pass_at_k", "maj_at_k", "format", "completion_length"):
            assert prefix + key in results, prefix + key
    assert results["val/math/accuracy"] == pytest.approx(3 / 7) and results[
        "val/math/pass_at_k"
    ] == pytest.approx(3 / 7)
    assert "val/math/maj_at_k" not in results  # a reward's set has accuracy (mean@k) and pass@k
    assert module.validation.scores[1].k == 2 and module.validation.scores[0].k == 1
    assert isinstance(module.validation, ValidationScoring)
    assert sorted(module.validation.metric_names(data)) == sorted(results)  # what a monitor may name
    answers = [r["answer"] for r in gsm8k_rows("test", 5)]
    assert [r["answer"] for r in data.val_set_rows[0]] == answers  # the set's own rows, GSM8K's test split


def test_cli_monitors_one_sets_metric(tiny_model_dir, tmp_path):
    """The YAML way: val_sets in the data module's options, the best checkpoint on `val/math/accuracy`."""
    math_file = write_math_file(tmp_path / "math.jsonl")
    sets = json.dumps(
        [
            {
                "name": "math",
                "source": math_file,
                "question_field": "problem",
                "reward": "tests.test_validation_sets.mark_reward",
            }
        ]
    )
    cli = build_cli(
        [
            "fit",
            f"--model.policy={tiny_model_dir}",
            "--model.grpo.num_generations=2",
            "--model.grpo.max_completion_length=4",
            "--model.grpo.preflight=false",
            "--data.source=arithmetic",
            "--data.arithmetic_size=20",
            "--data.val_size=2",
            f"--data.val_sets={sets}",
            "--trainer.accelerator=cpu",
            "--trainer.max_steps=1",
            "--trainer.val_check_interval=1",
            "--trainer.num_sanity_val_steps=0",
            "--trainer.enable_progress_bar=false",
            "--trainer.logger=false",
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.callbacks=lightning.pytorch.callbacks.ModelCheckpoint",
            "--trainer.callbacks.monitor=val/math/accuracy",
            "--trainer.callbacks.mode=max",
        ]
    )
    checkpoint = cli.trainer.checkpoint_callback
    assert checkpoint.monitor == "val/math/accuracy"
    assert float(checkpoint.best_model_score) == pytest.approx(3 / 7)
    assert cli.datamodule.val_sets[0].reward.__name__ == "mark_reward"  # imported from its dotted path


# ----------------------------------------------------------------------------------------- DDP
def validate_and_record(cfg: dict) -> None:
    # GSM8K's set scored by its rows, not by sampled text: each rank samples with its own random stream, so
    # a sampled completion that happens to hold the answer would count on one world size and not the other.
    module, data = module_and_data(cfg["model"], cfg["math"], val_size=7, gsm8k_reward=even_answer_reward)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=cfg["devices"],
        strategy="ddp" if cfg["devices"] > 1 else "auto",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.validate(module, data)
    if trainer.global_rank == 0:
        with open(os.path.join(cfg["out"], "results.json"), "w") as f:
            json.dump({key: float(value) for key, value in trainer.callback_metrics.items()}, f)


def two_rank_jobs(model: str, out: str) -> list[dict]:
    """This file's run in the launch of tests/two_ranks.py: the validation sets under DDP."""
    cfg = {"strategy": "ddp", "devices": 2, "model": model, "math": write_math_file(Path(out) / "math.jsonl")}
    return [{"call": "tests.test_validation_sets:validate_and_record", "cfg": {**cfg, "out": out}}]


def test_ddp_counts_every_row_once(tiny_model_dir, two_rank_runs, tmp_path):
    math_file = write_math_file(tmp_path / "math.jsonl")
    validate_and_record({"devices": 1, "model": tiny_model_dir, "math": math_file, "out": str(tmp_path)})
    results = {
        devices: json.load(open(os.path.join(out, "results.json")))
        for devices, out in ((1, tmp_path), (2, os.path.join(two_rank_runs, "test_validation_sets")))
    }
    assert results[2]["val/math/accuracy"] == results[1]["val/math/accuracy"] == pytest.approx(3 / 7)
    even = [int(reference_answer(r["answer"])) % 2 == 0 for r in gsm8k_rows("test", 5)]
    assert 0 < sum(even) < 5  # a repeated row would move the share
    for key in ("val/gsm8k_test/accuracy", "val/gsm8k_test/pass_at_k"):
        assert results[2][key] == results[1][key] == pytest.approx(sum(even) / 5), key
    # Greedy on the arithmetic rows (the tiny model answers none right): equal on both world sizes.
    for key in ("val/accuracy", "val/math/pass_at_k"):
        assert results[2][key] == results[1][key], key
