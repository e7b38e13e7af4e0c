"""Validation, GSM8KAccuracyCallback, the TensorBoard panel, the collapse monitor, the reward audit and
early stopping, on the tiny random model and on a scripted stand-in for a model."""

from __future__ import annotations

import csv
import os
import warnings
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoTokenizer, GenerationConfig

from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.rewards.audit import audit_module_rewards, audit_reward_funcs
from grpo_lightning.core.rewards.verifiable import (
    accuracy_reward,
    completion_text,
    format_reward,
    reference_answer,
)
from grpo_lightning.training.callbacks.collapse_monitor import CollapseMonitor
from grpo_lightning.training.callbacks.completions_table import completions_table
from grpo_lightning.training.callbacks.reward_audit import RewardAuditCallback
from grpo_lightning.training.data import GSM8KDataModule
from grpo_lightning.training.evaluation import GSM8KAccuracyCallback
from grpo_lightning.training.module import GRPOModule
from grpo_lightning.training.step_metrics import RolloutRecord
from tests.helpers import ACCURACY_KEYS, GSM8K_DIR, gsm8k_rows, quiet_trainer, tiny_module
from tests.test_rewards import TAGS_PROMPT, exact_match_reward, tags_format_reward


def tiny_data(**kwargs) -> GSM8KDataModule:
    options = dict(source=GSM8K_DIR, batch_size=2, val_size=4, val_batch_size=4, train_size=32)
    return GSM8KDataModule(**{**options, **kwargs})


def trainer(tmp_path, max_steps: int, callbacks: list, logger=False) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        val_check_interval=1,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        logger=logger,
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )


def test_fit_logs_validation_metrics_panel_and_monitor(tiny_model_dir: str, tmp_path) -> None:
    module = tiny_module(tiny_model_dir, log_completions_every=1)
    # The callback's subset is the data module's validation rows, so at step 2 it must score exactly what
    # the validation right after it does: same weights, same greedy decoding.
    held_out = GSM8KAccuracyCallback(
        source=GSM8K_DIR,
        split="holdout",
        num_problems=4,
        every_n_steps=2,
        max_new_tokens=8,
        prefix="callback/",
    )
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    fit = trainer(tmp_path, 2, [held_out], logger)
    fit.fit(module, tiny_data())

    events = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    scalars = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    for key in (*ACCURACY_KEYS, "completion_length"):
        assert set(scalars[f"val/{key}"]) == {0, 1}, key  # a validation after each training step, at its step
    assert all(0.0 <= scalars[f"val/{key}"][1] <= 1.0 for key in ACCURACY_KEYS)
    assert 1.0 <= scalars["val/completion_length"][1] <= 8.0
    for key in ACCURACY_KEYS:
        assert scalars[f"callback/{key}"] == {1: pytest.approx(scalars[f"val/{key}"][1])}, key

    record = module.last_rollout
    assert isinstance(record, RolloutRecord) and len(record.completions) == 4  # 2 prompts x G=2
    distinct = [len(set(record.completions[i : i + 2])) for i in (0, 2)]
    assert scalars["monitor/distinct_per_group"][1] == pytest.approx(sum(distinct) / 2)
    assert scalars["monitor/frac_identical_groups"][1] == pytest.approx(distinct.count(1) / 2)
    assert scalars["train/entropy"][1] == pytest.approx(record.entropy, rel=1e-5)

    panels = {e.step: e.tensor_proto.string_val[0] for e in events.Tensors("completions/text_summary")}
    assert sorted(panels) == [0, 1]  # the same steps as the scalars
    lines = panels[1].decode().splitlines()
    header = "| prompt | completion | accuracy_reward | format_reward | reward | advantage | tokens |"
    assert lines[0] == header
    assert len(lines) == 2 + 4  # header, separator, then the 2 x 2 completions of step 2
    for row, line in enumerate(lines[2:]):
        cells = [c.strip() for c in line.split(" | ")]
        assert cells[-2] == f"{float(record.advantages[row]):+.3f}"
        assert cells[-3] == f"{float(record.rewards[row]):.3f}"
        assert cells[-1].startswith(str(int(record.completion_lengths[row])))


def test_sampled_evaluations_leave_training_draws_alone(tiny_model_dir: str) -> None:
    def train(callbacks: list) -> tuple[list[str], dict[str, torch.Tensor]]:
        L.seed_everything(0)
        module = tiny_module(tiny_model_dir, learning_rate=1e-2, log_completions_every=1)
        quiet_trainer(max_steps=2, limit_val_batches=0, callbacks=callbacks).fit(module, tiny_data())
        return module.last_rollout.completions, {k: v.clone() for k, v in module.policy.state_dict().items()}

    plain_completions, plain_weights = train([])
    sampled = GSM8KAccuracyCallback(
        source=GSM8K_DIR,
        split="holdout",
        num_problems=4,
        every_n_steps=1,
        num_generations=4,
        max_new_tokens=8,
    )
    completions, weights = train([sampled])
    assert completions == plain_completions  # step 2 sampled the same completions after the evaluation
    for name, value in plain_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=0, msg=name)


class ScriptedLM(torch.nn.Module):
    """Stands in for a causal LM: `generate` answers each known question with scripted completions.

    The i-th time a question appears in one `generate` call it gets `script[question][i]`, so the samples of
    a problem are known, and so is every metric.
    """

    def __init__(self, tokenizer, script: dict[str, list[str]]) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(1))
        self.tokenizer = tokenizer
        self.script = script
        self.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id)

    def generate(self, input_ids, attention_mask, generation_config, **kwargs):
        prompts = self.tokenizer.batch_decode(input_ids, skip_special_tokens=True)
        seen: dict[str, int] = {}
        rows = []
        for prompt in prompts:
            question = next(q for q in self.script if q in prompt)
            text = self.script[question][seen.get(question, 0)]
            seen[question] = seen.get(question, 0) + 1
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            rows.append(ids + [self.tokenizer.eos_token_id])
        width = max(map(len, rows))
        pad = self.tokenizer.pad_token_id
        completions = torch.tensor([r + [pad] * (width - len(r)) for r in rows])  # [B, T]
        return torch.cat([input_ids, completions], dim=1)


class OtherPeoplesModule(L.LightningModule):
    """Not a GRPOModule: a model and a tokenizer under names of its own, and its own training."""

    def __init__(self, lm: torch.nn.Module, tok) -> None:
        super().__init__()
        self.lm, self.tok = lm, tok

    def training_step(self, batch, batch_idx):
        return (self.lm.weight - batch.mean()).pow(2).sum()

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(16, 1), batch_size=2)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_accuracy_callback_on_any_lightning_module(tiny_model_dir: str, tmp_path) -> None:
    rows = gsm8k_rows("test", 4)
    gold = [reference_answer(r["answer"]) for r in rows]
    wrong = [str(int(g) + 1) for g in gold]
    script = {
        rows[0]["question"]: [f"So\n#### {gold[0]}", f"#### {gold[0]}"],  # both right
        rows[1]["question"]: [f"#### {gold[1]}", f"#### {wrong[1]}"],  # one right; the tie goes to the first
        rows[2]["question"]: [f"The answer is {gold[2]}.", f"#### {wrong[2]}"],  # right only leniently
        rows[3]["question"]: ["no idea", "no idea"],
    }
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.padding_side = "right"  # the module's own choice, which the callback must leave alone
    callback = GSM8KAccuracyCallback(
        source=GSM8K_DIR,
        split="test",
        num_problems=4,
        every_n_steps=2,
        batch_size=3,
        num_generations=2,
        model_attr="lm",
        tokenizer_attr="tok",
    )
    logger = CSVLogger(str(tmp_path), name="csv")
    fit = trainer(tmp_path, 4, [callback], logger)
    fit.fit(OtherPeoplesModule(ScriptedLM(tokenizer, script), tokenizer))

    with open(os.path.join(logger.log_dir, "metrics.csv"), encoding="utf-8") as f:
        logged = [r for r in csv.DictReader(f) if r["gsm8k/accuracy"]]
    assert [int(r["step"]) for r in logged] == [1, 3]  # after training steps 2 and 4, counted from 0
    expected = {
        "accuracy": (1 + 0.5 + 0.5 + 0) / 4,
        "accuracy_strict": (1 + 0.5 + 0 + 0) / 4,
        "pass_at_k": 3 / 4,
        "pass_at_k_strict": 2 / 4,
        "maj_at_k": 3 / 4,
        "maj_at_k_strict": 2 / 4,
        "format": 5 / 8,
    }
    for row in logged:
        assert {k: float(row[f"gsm8k/{k}"]) for k in expected} == pytest.approx(expected)
    assert float(fit.callback_metrics["gsm8k/accuracy"]) == pytest.approx(0.5)  # EarlyStopping can monitor it
    assert tokenizer.padding_side == "right"


def record(completions: list[str], rewards: list[float], truncated: list[bool]) -> RolloutRecord:
    n = len(completions)
    return RolloutRecord(
        prompts=[[{"role": "user", "content": f"q{i}"}] for i in range(n // 2)],
        completions=completions,
        reward_names=["accuracy_reward"],
        rewards_per_func=torch.tensor(rewards)[:, None],
        rewards=torch.tensor(rewards),
        advantages=torch.zeros(n),
        completion_lengths=torch.full((n,), 5),
        truncated=torch.tensor(truncated),
        num_generations=2,
        entropy=0.01,
    )


def test_collapse_monitor_alarms_once_per_episode() -> None:
    monitor = CollapseMonitor(patience=2)
    stuck = record(["a", "a", "b", "b"], [1.0, 1.0, 0.0, 0.0], [True] * 4)  # identical, no signal, all cut
    healthy = record(["a", "b", "c", "d"], [1.0, 0.0, 0.0, 0.0], [False, False, False, True])
    seen = []
    for step in (stuck, stuck, stuck, healthy, stuck):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            metrics = monitor.update(step)
        seen.append(([str(w.message) for w in caught], metrics))

    messages, metrics = seen[0]
    assert messages == []
    assert metrics == {
        "monitor/frac_identical_groups": 1.0,
        "monitor/distinct_per_group": 1.0,
        "monitor/collapse": 0.0,
        "monitor/no_signal": 0.0,
        "monitor/truncation": 0.0,
    }
    messages, metrics = seen[1]  # the second stuck step in a row: all three alarms
    heads = [m.split(":")[0].split(" of ")[0] for m in messages]
    assert heads == ["policy collapse", "no learning signal", "100%"]
    assert "token entropy 0.010" in messages[0] and "mean reward 0.500" in messages[1]
    assert metrics["monitor/collapse"] == metrics["monitor/no_signal"] == metrics["monitor/truncation"] == 1.0
    messages, metrics = seen[2]  # still on, not repeated
    assert messages == [] and metrics["monitor/collapse"] == 1.0
    messages, metrics = seen[3]
    assert messages == []
    assert metrics == {
        "monitor/frac_identical_groups": 0.0,
        "monitor/distinct_per_group": 2.0,
        "monitor/collapse": 0.0,
        "monitor/no_signal": 0.0,
        "monitor/truncation": 0.0,
    }
    assert seen[4] == ([], seen[0][1])  # a new episode starts counting from one


def test_completions_table_keeps_each_completion_in_its_cell() -> None:
    step = record(["#### 5 | x\n<b>bold</b> *a*", "plain"], [1.0, 0.0], [False, True])
    step.advantages = torch.tensor([0.7071, -0.7071])
    lines = completions_table(step).splitlines()
    assert len(lines) == 4
    for line in lines:
        assert line.count("|") == 6 + 1  # 6 columns: no `|` of the text opens a cell
    escaped = "\\#\\#\\#\\# 5 &#124; x<br>&lt;b&gt;bold&lt;/b&gt; \\*a\\*"
    assert lines[2] == f"| q0 | {escaped} | 1.000 | 1.000 | +0.707 | 5 |"
    assert lines[3] == "|  | plain | 0.000 | 0.000 | -0.707 | 5 (cut) |"
    # Decoded random tokens hold other line breaks too (\r, \x85, \u2028): each stays in its cell.
    step = record(["a\rb\x85c\u2028d", "e\x0bf"], [1.0, 0.0], [False, True])
    assert len(completions_table(step).splitlines()) == 4


def first_hash_reward(completions: list[str], answer: list[str], **kwargs) -> list[float]:
    """A gameable reward: it reads the first `#### N`, so a second, wrong final answer costs nothing."""
    out = []
    for completion, ref in zip(completions, answer, strict=True):
        _, marker, tail = completion_text(completion).partition("####")
        first = tail.strip().split("\n")[0].strip()
        out.append(float(bool(marker) and first == reference_answer(ref)))
    return out


def test_reward_audit_passes_sound_rewards_and_flags_a_gameable_one() -> None:
    rows = gsm8k_rows("train", 100)
    questions, answers = [r["question"] for r in rows], [r["answer"] for r in rows]
    report = audit_reward_funcs([accuracy_reward, format_reward], questions, answers, [1.0, 0.5])
    assert report.num_rows == 100 and report.perfect
    assert report.means == {
        "accuracy_reward": {"reference": 1.0, "wrong_number": 0.0, "two_answers": 0.0, "no_answer": 0.0},
        "format_reward": {"reference": 1.0, "wrong_number": 1.0, "two_answers": 0.0, "no_answer": 0.0},
    }
    assert report.totals == {"reference": 1.5, "wrong_number": 0.5, "two_answers": 0.0, "no_answer": 0.0}
    assert report.rates == {"reference": 1.0, "wrong_number": 0.0, "two_answers": 0.0, "no_answer": 0.0}
    assert report.table().splitlines()[-1] == "verdict: OK"

    gamed = audit_reward_funcs([first_hash_reward], questions, answers)
    assert not gamed.perfect
    assert gamed.rates == {"reference": 1.0, "wrong_number": 0.0, "two_answers": 1.0, "no_answer": 0.0}

    # The pre-training report: only a module's `reward_funcs` and the data module's `train_rows` are read.
    callback = RewardAuditCallback(num_rows=20)
    fake_trainer = SimpleNamespace(datamodule=SimpleNamespace(train_rows=rows), is_global_zero=True)
    fake_module = SimpleNamespace(reward_funcs=[first_hash_reward], reward_weights=torch.ones(1))
    with pytest.warns(UserWarning, match="reward audit is not perfect") as caught:
        callback.on_fit_start(fake_trainer, fake_module)
    assert "reward audit on 20 reference solutions" in str(caught[0].message)


def test_the_gsm8k_presets_final_number_passes_an_exact_match_reward_that_a_worked_solution_fails():
    """unsloth's GSM8K rewards on the preset's rows: `answer` is the final number, which their exact match
    compares with, and the audit passes; on rows whose `answer` is the worked solution (as the preset kept
    them before) it fails, naming the reward and the row. Our own rewards read either."""
    data = GSM8KDataModule(source=GSM8K_DIR, system_prompt=TAGS_PROMPT, val_size=0, train_size=20)
    data.setup("fit")
    rows = data.train_rows
    module = SimpleNamespace(reward_funcs=[exact_match_reward, tags_format_reward], reward_weights=None)
    report = audit_module_rewards(module, rows)
    assert report.perfect and report.means["exact_match_reward"]["reference"] == 2.0

    worked = [
        {k: v for k, v in r.items() if k != "worked_solution"} | {"answer": r["worked_solution"]}
        for r in rows
    ]
    failed = audit_module_rewards(module, worked)
    assert not failed.perfect
    assert failed.right_not_rewarded.startswith(
        f"row 0: a completion with the reference's final answer {rows[0]['answer']} "
    )
    assert "exact_match_reward gives it 0 and the wrong one 0 (it reads answer=" in failed.right_not_rewarded

    ours = SimpleNamespace(reward_funcs=[accuracy_reward], reward_weights=None)
    for audited in (rows, worked):
        assert audit_module_rewards(ours, audited).means["accuracy_reward"]["reference"] == 1.0


class FlatAccuracy(GRPOModule):
    """Validation reports `start + rise * k` at its k-th run, without generating anything."""

    def __init__(self, *args, start: float, rise: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.scripted = [start + rise * k for k in range(100)]
        self.validations = 0

    def validation_step(self, batch, batch_idx) -> None:
        pass

    def on_validation_epoch_end(self) -> None:
        self.log("val/accuracy", self.scripted[self.validations])
        self.validations += 1


@pytest.mark.parametrize(("rise", "stopped_at"), [(0.0, 3), (0.004, 3), (0.02, 4)])
def test_early_stopping_on_a_flat_val_accuracy(tiny_model_dir: str, tmp_path, rise: float, stopped_at: int):
    grpo = GRPOConfig(num_generations=2, max_completion_length=2, preflight=False, log_completions_every=0)
    module = FlatAccuracy(tiny_model_dir, grpo=grpo, start=0.25, rise=rise)
    stopper = EarlyStopping(
        monitor="val/accuracy", mode="max", patience=2, min_delta=0.01, check_on_train_epoch_end=False
    )
    fit = trainer(tmp_path, 4, [stopper])
    fit.fit(module, tiny_data(source="arithmetic", val_size=1))
    # Validation 1 sets the best; 2 and 3 improve by less than min_delta, and patience 2 ends the run.
    assert fit.global_step == stopped_at
    assert module.validations == stopped_at
    assert fit.should_stop == (stopped_at < 4)
    assert float(stopper.best_score) == pytest.approx(0.25 if rise < 0.01 else 0.25 + 3 * rise)
