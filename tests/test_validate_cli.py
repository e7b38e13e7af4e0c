"""`cli.py validate` with the per-problem results file, `cli.py audit`, and the Qwen2.5 config's callbacks."""

from __future__ import annotations

import json
import os

import pytest
import yaml
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

from grpo_lightning.cli import build_cli
from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.rewards.verifiable import extract_answer, reference_answer
from grpo_lightning.io.rows import DEFAULT_SYSTEM_PROMPT, chat_prompt
from grpo_lightning.training.callbacks.export_best import ExportBestCallback
from tests.helpers import GSM8K_DIR, gsm8k_rows, write_rows

QWEN_CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "gsm8k_qwen2.5_0.5b.yaml")


def write_config(path, tiny_model_dir: str, reward_funcs: str = "") -> str:
    path.write_text(f"""\
trainer:
  accelerator: cpu
  logger: false
  enable_progress_bar: false
model:
  policy: {tiny_model_dir}
{reward_funcs}  grpo:
    num_generations: 2
    max_completion_length: 8
    preflight: false
data:
  source: {GSM8K_DIR}
  val_split: test
  val_size: 5
  val_batch_size: 3
""")
    return str(path)


def test_validate_writes_one_line_per_problem(tiny_model_dir: str, tmp_path, capsys) -> None:
    config = write_config(tmp_path / "config.yaml", tiny_model_dir)
    results = tmp_path / "out" / "val.jsonl"
    cli = build_cli(["validate", "--config", config, "--results.path", str(results)])

    assert "val/accuracy" in capsys.readouterr().out  # Lightning's table of the validation metrics
    rows = gsm8k_rows("test", 5)  # the first problems of the test split, in order
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    assert [line["question"] for line in lines] == [r["question"] for r in rows]
    assert [line["answer"] for line in lines] == [reference_answer(r["answer"]) for r in rows]
    assert [line["worked_solution"] for line in lines] == [r["answer"] for r in rows]  # a data column
    for line in lines:
        data = {"question", "worked_solution"}  # the row's columns; its `answer` is the reference
        assert set(line) == data | {"set", "sample", "completion", "extracted", "answer", "correct"}
        assert line["sample"] == 0  # greedy: one completion per problem
        assert line["extracted"] == extract_answer(line["completion"])
        assert line["correct"] == (line["extracted"] == line["answer"])
    accuracy = float(cli.trainer.callback_metrics["val/accuracy"])
    assert accuracy == pytest.approx(sum(line["correct"] for line in lines) / 5)

    # Greedy: the module alone decodes the same completion for the first problem as in its batch of three.
    prompt = chat_prompt(rows[0]["question"], DEFAULT_SYSTEM_PROMPT)
    _, completions = cli.model.rollouts.sample([prompt], 1, do_sample=False)
    assert completions == [lines[0]["completion"]]


def test_audit_command_prints_the_rates_and_fails_on_a_bad_reward(tiny_model_dir: str, tmp_path, capsys):
    good = write_config(tmp_path / "good.yaml", tiny_model_dir)
    build_cli(["audit", "--config", good, "--num_rows", "50"])
    table = capsys.readouterr().out.splitlines()
    assert table[0] == "reward audit on 50 reference solutions: mean reward per case"
    assert table[1].split() == ["reference", "wrong_number", "two_answers", "no_answer"]
    assert table[2].split() == ["accuracy_reward", "1.000", "0.000", "0.000", "0.000"]
    assert table[3].split() == ["format_reward", "1.000", "1.000", "0.000", "0.000"]
    assert table[-3].split() == ["rate", "1.000", "0.000", "0.000", "0.000"]
    assert table[-1] == "verdict: OK"

    # A length penalty that every reference solution pays: the references are not at full marks.
    penalised = """\
  reward_funcs:
    - grpo_lightning.core.rewards.verifiable.accuracy_reward
    - class_path: grpo_lightning.core.rewards.verifiable.LengthPenalty
      init_args:
        limit: 0
        per_100_tokens: 1.0
"""
    bad = write_config(tmp_path / "bad.yaml", tiny_model_dir, penalised)
    with pytest.raises(SystemExit) as exit_info:
        build_cli(["audit", "--config", bad, "--num_rows", "50"])
    assert exit_info.value.code == 1
    table = capsys.readouterr().out.splitlines()
    rate = [float(v) for v in table[-3].split()[1:]]
    assert rate[0] < 1.0 and table[-1].startswith("verdict: NOT PERFECT")


def test_qwen_config_stops_and_exports_even_before_the_first_validation(tiny_model_dir: str, tmp_path):
    with open(QWEN_CONFIG, encoding="utf-8") as f:
        raw = yaml.safe_load(f)
    assert raw["model"]["policy"] == "Qwen/Qwen2.5-0.5B-Instruct"
    assert raw["trainer"]["precision"] == "bf16-mixed" and raw["model"]["model_options"]["dtype"] == "float32"
    options = GRPOConfig(**raw["model"]["grpo"])
    assert [getattr(options, k) for k in ("num_generations", "max_completion_length", "epsilon_high")] == [
        8,
        512,
        0.28,
    ]
    assert raw["data"]["val_split"] == "test" and raw["trainer"]["val_check_interval"] == 100

    # The real config, shrunk to the tiny model and two CPU steps: validation (every 100) never runs.
    out = tmp_path / "run"
    cli = build_cli(
        [
            "--config",
            QWEN_CONFIG,
            f"--model.policy={tiny_model_dir}",
            "--model.model_options.dtype=float32",
            "--model.model_options.attn_implementation=eager",
            "--model.model_options.gradient_checkpointing=false",
            "--model.grpo.num_generations=2",
            "--model.grpo.max_completion_length=8",
            "--model.grpo.micro_batch_size=null",
            "--model.grpo.preflight=false",
            f"--data.source={GSM8K_DIR}",
            "--data.batch_size=2",
            "--trainer.accelerator=cpu",
            "--trainer.precision=32-true",
            "--trainer.max_steps=2",
            "--trainer.enable_progress_bar=false",
            f"--trainer.default_root_dir={out}",
            f"--trainer.logger.init_args.save_dir={out}",
            f"--trainer.callbacks.init_args.out_dir={out / 'export'}",  # the last callback named: ExportBest
            f"--results.path={out / 'val.jsonl'}",
        ],
        run=False,
    )
    grpo = cli.model.grpo
    assert (grpo.epsilon, grpo.epsilon_high, grpo.learning_rate, grpo.loss_type) == (0.2, 0.28, 1e-6, "dapo")
    stopper = next(c for c in cli.trainer.callbacks if isinstance(c, EarlyStopping))
    assert (stopper.monitor, stopper.mode, stopper.patience, stopper._check_on_train_epoch_end) == (
        "val/accuracy",
        "max",
        5,
        False,
    )
    best = next(c for c in cli.trainer.callbacks if isinstance(c, ModelCheckpoint) and c.monitor)
    assert (best.mode, best.save_top_k, best.auto_insert_metric_name) == ("max", 1, False)

    cli.trainer.fit(cli.model, cli.datamodule)  # with check_on_train_epoch_end=True, EarlyStopping raises
    assert cli.trainer.global_step == 2 and not os.path.exists(out / "val.jsonl")
    export = next(c for c in cli.trainer.callbacks if isinstance(c, ExportBestCallback))
    assert export.exported_from is None  # no validation, no best: the final weights, with a warning
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(out / "export"))


def test_test_and_predict_commands_score_and_answer_the_test_split(tiny_model_dir: str, tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    write_rows(data / "train.jsonl", gsm8k_rows("train", 20))
    write_rows(data / "test.jsonl", gsm8k_rows("test", 5))
    config = write_config(tmp_path / "config.yaml", tiny_model_dir)
    with open(config, encoding="utf-8") as f:
        text = f.read().replace(GSM8K_DIR, str(data))  # the small folder, not the shipped GSM8K
    with open(config, "w", encoding="utf-8") as f:
        f.write(text)
    tested, answered = tmp_path / "test.jsonl", tmp_path / "answers.jsonl"
    limit = ["--trainer.limit_test_batches=1", "--trainer.limit_predict_batches=1"]
    cli = build_cli(["test", "--config", config, limit[0], "--results.path", str(tested)])
    assert "test/accuracy" in capsys.readouterr().out  # Lightning's table of the test metrics
    rows = gsm8k_rows("test", 3)  # one batch of val_batch_size 3: the test split's first rows
    lines = [json.loads(line) for line in tested.read_text().splitlines()]
    assert [line["question"] for line in lines] == [r["question"] for r in rows]
    accuracy = float(cli.trainer.callback_metrics["test/accuracy"])
    assert accuracy == pytest.approx(sum(line["correct"] for line in lines) / 3)

    build_cli(["predict", "--config", config, limit[1], "--results.path", str(answered)])
    answers = [json.loads(line) for line in answered.read_text().splitlines()]
    assert [a["question"] for a in answers] == [r["question"] for r in rows]
    for answer, line in zip(answers, lines, strict=True):  # greedy: the same completion as the test's
        assert answer["completion"] == line["completion"] and answer["sample"] == 0
        assert answer["extracted"] == extract_answer(answer["completion"])
