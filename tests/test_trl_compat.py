"""A TRL user's reward functions and data set run here unchanged: TRL 1.16's own `trl.rewards` inside real
training steps of a tiny model, on data in TRL's format, called exactly as `GRPOTrainer` calls them."""

import ast
import asyncio
import functools
import json
import re
from pathlib import Path

import lightning as L
import pytest
import torch
from trl.rewards import (
    accuracy_reward,
    get_repetition_penalty_reward,
    get_soft_overlong_punishment,
    think_format_reward,
)

from grpo_lightning.core.config import FLAT_NAMES, GRPOConfig
from grpo_lightning.core.flat_names import default_at
from grpo_lightning.core.metrics import RewardAccuracy
from grpo_lightning.core.rewards.scoring import RewardInputs, call_reward, score_completions, trainer_state
from grpo_lightning.core.rewards.verifiable import accuracy_reward as gsm8k_accuracy_reward
from grpo_lightning.core.rewards.verifiable import format_reward
from grpo_lightning.training.callbacks.completions_table import completions_table
from grpo_lightning.training.data import PromptDataModule
from grpo_lightning.training.module import GRPOModule
from tests.helpers import quiet_trainer

G, MAX_TOKENS, STEPS = 2, 6, 2
PROBLEMS = [
    ("What is 1/3 of 1?", r"\frac{1}{3}"),
    ("Half of 9?", r"\frac{9}{2}"),
    ("What is 2 + 2?", "4"),
    ("What is 3 * 3?", "9"),
]


def write_jsonl(path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def trl_rows(conversational: bool) -> list[dict]:
    """Rows in TRL's "prompt-only" format with a `solution` column, as TRL's math examples have them."""
    rows = []
    for question, solution in PROBLEMS:
        prompt = (
            [{"role": "user", "content": question}] if conversational else f"Question: {question}\nAnswer:"
        )
        rows.append({"prompt": prompt, "solution": solution, "level": len(question)})
    return rows


class DocsStyleReward:
    """A reward written as TRL's documentation writes them for chat data: `completion[0]["content"]`,
    `prompts`, `trainer_state`, `log_extra` and `log_metric`. It records every call."""

    __name__ = "docs_style_reward"

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, prompts, completions, completion_ids, trainer_state, log_extra, log_metric, **kwargs):
        self.calls.append(
            dict(prompts=prompts, completions=completions, completion_ids=completion_ids, kwargs=kwargs)
            | {
                "step": trainer_state.global_step,
                "max_steps": trainer_state.max_steps,
                "epoch": trainer_state.epoch,
            }
        )
        contents = [completion[0]["content"] for completion in completions]
        log_extra("prompt_chars", [len(p[-1]["content"]) for p in prompts])
        log_metric("docs_style/step_seen", float(trainer_state.global_step))
        # Grows with the step, as TRL's docs' curriculum examples do with trainer_state.
        return [len(c) / 100 + trainer_state.global_step for c in contents]


class Recorder(L.Callback):
    """After each training step: the module's `RolloutRecord` and the metrics logged."""

    def __init__(self) -> None:
        self.records, self.metrics = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.records.append(pl_module.last_rollout)
        self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def fit_trl(model_dir, root, reward_funcs, conversational=True, **module_options):
    source = write_jsonl(root / "train.jsonl", trl_rows(conversational))
    data = PromptDataModule(source, batch_size=2, val_size=0)
    grpo = GRPOConfig(num_generations=G, max_completion_length=MAX_TOKENS, log_completions_every=0)
    module = GRPOModule(model_dir, reward_funcs=reward_funcs, grpo=grpo, **module_options)
    seen = Recorder()
    trainer = quiet_trainer(
        max_steps=STEPS, limit_val_batches=0, default_root_dir=str(root), callbacks=[seen]
    )
    trainer.fit(module, data)
    return trainer, module, seen


def test_trl_reward_functions_run_unchanged_in_training_steps(tiny_model_dir, tmp_path):
    overlong = get_soft_overlong_punishment(max_completion_len=MAX_TOKENS, soft_punish_cache=4)
    repetition = get_repetition_penalty_reward(ngram_size=2, max_penalty=-1.0)
    docs = DocsStyleReward()
    funcs = [think_format_reward, overlong, repetition, accuracy_reward, docs]
    trainer, module, seen = fit_trl(tiny_model_dir, tmp_path, funcs)
    assert trainer.global_step == STEPS

    for step, (record, call) in enumerate(zip(seen.records, docs.calls, strict=True)):
        # The call TRL makes: keywords only, prompts repeated per completion, completions as one assistant
        # message each, ids without padding, every column but `prompt`, and the trainer's state.
        assert set(call["kwargs"]) == {"solution", "level"}
        assert len(call["prompts"]) == len(call["completions"]) == 2 * G
        assert call["prompts"][0] == call["prompts"][1] != call["prompts"][2]  # a group shares its prompt
        assert call["completions"] == [[{"role": "assistant", "content": c}] for c in record.completions]
        assert [len(ids) for ids in call["completion_ids"]] == record.completion_lengths.tolist()
        assert call["kwargs"]["solution"][0] == call["kwargs"]["solution"][1]
        assert (call["step"], call["max_steps"]) == (step, STEPS)
        assert call["epoch"] == pytest.approx(step / 2)  # 4 rows in batches of 2: 2 steps per epoch

        # Each column of the step's rewards is what TRL's own function gives on the same inputs.
        expected = [
            think_format_reward(call["completions"]),
            overlong(call["completion_ids"]),
            repetition(call["completion_ids"]),
            accuracy_reward(call["completions"], call["kwargs"]["solution"]),
            [len(c) / 100 + step for c in record.completions],
        ]
        torch.testing.assert_close(record.rewards_per_func, torch.tensor(expected).T)
        # log_extra: TRL's accuracy_reward logs its parses, the docs-style reward its own column.
        assert record.extra["solution"] == call["kwargs"]["solution"]
        assert set(record.extra) == {"solution", "gold_parsed", "answer_parsed", "prompt_chars"}
        header = completions_table(record).splitlines()[0]
        assert header.endswith("| solution | gold_parsed | answer_parsed | prompt_chars |")
        # log_metric: a scalar of the step, next to the built-in ones.
        assert seen.metrics[step]["train/docs_style/step_seen"] == step
        for name in ("think_format_reward", "soft_overlong_punishment_reward", "repetition_penalty_reward"):
            assert f"train/rewards/{name}" in seen.metrics[step]
    # Completions that hit the limit get the overlong punishment: the length reward saw real lengths.
    lengths = torch.cat([r.completion_lengths for r in seen.records])
    penalties = torch.cat([r.rewards_per_func[:, 1] for r in seen.records])
    assert torch.equal(penalties < 0, lengths > MAX_TOKENS - 4)


class StateRecorder:
    """A reward that records the `trainer_state` of each call: (global_step, max_steps, num_train_epochs,
    epoch), and scores every completion 0."""

    __name__ = "state_recorder"

    def __init__(self) -> None:
        self.states: list[tuple[int, int, int, float]] = []

    def __call__(self, completions, trainer_state, **kwargs):
        state = trainer_state
        self.states.append((state.global_step, state.max_steps, state.num_train_epochs, state.epoch))
        return [0.0] * len(completions)


def trl_epoch_bounded_states(model_dir: str, root: Path, epochs: int) -> list[tuple[int, int, int, float]]:
    """The `trainer_state` TRL 1.16's own `GRPOTrainer` passes its rewards in a run bounded by epochs: 4
    prompts, groups of 2, 4 completions per optimizer step, 2 optimizer steps per generation."""
    from datasets import Dataset
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer

    config = TRLConfig(
        output_dir=str(root / "trl"),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
        steps_per_generation=2,
        num_generations=G,
        max_completion_length=4,
        num_train_epochs=epochs,
        use_cpu=True,
        bf16=False,
        model_init_kwargs={"dtype": "float32"},
        shuffle_dataset=False,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    recorder = StateRecorder()
    prompts = [f"Question: {question}\nAnswer:" for question, _ in PROBLEMS]
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=recorder,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
    )
    trainer.train()
    return recorder.states


def test_trainer_state_in_a_run_bounded_by_epochs_is_trls(tiny_model_dir, tmp_path):
    """No max_steps: TRL passes the run's computed total of optimizer steps as `max_steps` (never -1), so a
    reward scheduled on global_step / max_steps stays in [0, 1]; ours passes the same state at each
    generation."""
    epochs = 2
    expected = trl_epoch_bounded_states(tiny_model_dir, tmp_path, epochs)
    assert [state[:3] for state in expected] == [(0, 4, 2), (2, 4, 2)]  # 2 generations, 4 optimizer steps

    recorder = StateRecorder()
    source = write_jsonl(tmp_path / "train.jsonl", trl_rows(conversational=False))
    data = PromptDataModule(source, batch_size=4, val_size=0)
    grpo = GRPOConfig(
        num_generations=G,
        max_completion_length=4,
        steps_per_generation=2,
        log_completions_every=0,
        preflight=False,
    )
    module = GRPOModule(tiny_model_dir, reward_funcs=[recorder], grpo=grpo)
    trainer = quiet_trainer(max_epochs=epochs, limit_val_batches=0, default_root_dir=str(tmp_path))
    trainer.fit(module, data)
    assert trainer.global_step == 4
    assert recorder.states == expected


def test_standard_prompts_get_text_completions_and_our_rewards_take_both_shapes(tiny_model_dir, tmp_path):
    seen_shapes = []

    def shape_reward(prompts, completions, **kwargs):
        seen_shapes.append((type(prompts[0]), type(completions[0])))
        return [0.0] * len(completions)

    trainer, module, seen = fit_trl(tiny_model_dir, tmp_path, [shape_reward], conversational=False)
    assert seen_shapes == [(str, str)] * STEPS
    # Our own rewards read text and TRL's chat completions alike.
    text = "2 + 2 = 4\n#### 4"
    chat = [{"role": "assistant", "content": text}]
    assert gsm8k_accuracy_reward([text, chat], answer=["#### 4", "#### 4"]) == [1.0, 1.0]
    assert format_reward([chat]) == format_reward([text]) == [1.0]


def test_async_reward_functions_run_concurrently():
    class Pair:
        """Two async rewards: the first waits until the second has run, which only concurrency allows."""

        def __init__(self) -> None:
            self.event = asyncio.Event()

        async def first(self, completions, **kwargs):
            await asyncio.wait_for(self.event.wait(), timeout=5)
            return [1.0] * len(completions)

        async def second(self, completions, **kwargs):
            self.event.set()
            return [2.0] * len(completions)

    pair = Pair()
    inputs = RewardInputs(["q", "q"], ["a", "b"])
    scores = score_completions([pair.first, pair.second], inputs)
    assert scores.rewards.tolist() == [[1.0, 2.0], [1.0, 2.0]]


def test_async_rewards_inside_a_running_event_loop():
    """In a notebook an event loop already runs: the rewards are awaited on a loop of their own."""

    async def reward(completions, **kwargs):
        await asyncio.sleep(0)
        return [3.0] * len(completions)

    async def score_in_loop():
        return score_completions([reward], RewardInputs(["q"], ["a"]))

    assert asyncio.run(score_in_loop()).rewards.tolist() == [[3.0]]


def test_math_verify_judges_latex_answers():
    inputs = RewardInputs(
        [[{"role": "user", "content": "1/3?"}]] * 3,
        [r"So \boxed{\frac{1}{3}}", r"\boxed{0.5}", "no idea"],
        columns={"solution": [r"\frac{1}{3}"] * 3},
    )
    assert call_reward(accuracy_reward, inputs) == [1.0, 0.0, 0.0]


def test_reward_accuracy_metric():
    metric = RewardAccuracy(k=2)
    metric.update([1.0, 0.0, 0.0, 0.0])
    metric.update([1.0, 1.0])
    result = metric.compute()
    assert result["accuracy"].item() == pytest.approx((0.5 + 0.0 + 1.0) / 3)
    assert result["pass_at_k"].item() == pytest.approx(2 / 3)


def test_validation_accuracy_from_a_reward_function_drives_early_stopping(tiny_model_dir, tmp_path):
    """Beyond GSM8K: val/accuracy comes from `val_reward` on the data's columns; EarlyStopping reads it."""
    from lightning.pytorch.callbacks import EarlyStopping

    rows = [{"prompt": [{"role": "user", "content": f"Question {i}?"}], "solution": str(i)} for i in range(8)]
    source = write_jsonl(tmp_path / "rows.jsonl", rows)

    def judged_by_solution(completions, solution, trainer_state, **kwargs):  # right on even problems
        return [1.0 if int(s) % 2 == 0 else 0.0 for s in solution]

    grpo = GRPOConfig(num_generations=2, max_completion_length=4, preflight=False, log_completions_every=0)
    module = GRPOModule(
        tiny_model_dir, reward_funcs=[judged_by_solution], grpo=grpo, val_reward=judged_by_solution
    )
    data = PromptDataModule(source, batch_size=2, val_size=5, val_batch_size=2)
    stop = EarlyStopping(monitor="val/accuracy", mode="max", patience=1, check_on_train_epoch_end=False)
    trainer = quiet_trainer(
        max_steps=10, val_check_interval=1, check_val_every_n_epoch=None, callbacks=[stop]
    )
    trainer.fit(module, data)
    expected = sum(int(r["solution"]) % 2 == 0 for r in data.val_rows) / len(data.val_rows)
    assert float(trainer.callback_metrics["val/accuracy"]) == pytest.approx(expected)
    assert trainer.global_step == 2  # flat accuracy: stopped after patience=1 validations without gain


# ------------------------------------------------------------------------------------------ docs/from_trl.md
DOC = Path(__file__).parent.parent / "docs" / "from_trl.md"


def doc_parts() -> tuple[str, str, list[dict]]:
    """The doc's TRL script, its YAML, and the rows of its "Option by option" table (names, values, kind)."""
    text = DOC.read_text(encoding="utf-8")
    script = re.search(r"```python\n(.*?)```", text, re.S)[1]
    config = re.search(r"```yaml\n(.*?)```", text, re.S)[1]
    table = text.split("\n## Option by option", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in table.splitlines():
        if not line.startswith("| `"):
            continue
        trl_names, trl_value, ours, our_value, kind, _note = [c.strip() for c in line.strip("|").split(" | ")]

        def literal(cell: str):
            return ast.literal_eval(cell.strip("`")) if cell != "—" else NOTHING

        rows.append(
            {
                "trl": re.findall(r"`(\w+)`", trl_names),
                "trl_value": literal(trl_value),
                "ours": ours.strip("`") if ours != "—" else None,
                "our_value": literal(our_value),
                "kind": kind,
            }
        )
    return script, config, rows


NOTHING = object()


def plain(value):
    """Config values as literals: enums by value, tensors as lists, one-item lists (report_to) as the item."""
    value = getattr(value, "value", value)
    if isinstance(value, torch.Tensor):
        return value.tolist()
    return value[0] if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str) else value


def test_from_trl_table_builds_both_configs(tiny_model_dir, tmp_path):
    import dataclasses
    import inspect

    import transformers
    import trl

    from grpo_lightning.cli import build_cli
    from grpo_lightning.io.models import ModelOptions

    script, config, rows = doc_parts()
    assert {row["kind"] for row in rows} == {"maps", "differs", "lacks"}
    # Every option TRL's GRPOConfig adds to TrainingArguments has its row.
    base = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    own = {f.name for f in dataclasses.fields(trl.GRPOConfig)} - base
    named = [name for row in rows for name in row["trl"]]
    assert len(named) == len(set(named)) and own <= set(named), sorted(own - set(named))

    # TRL's side: the script's GRPOConfig(...) is the table's TRL column, and TRL builds it.
    call = next(
        n
        for n in ast.walk(ast.parse(script))
        if isinstance(n, ast.Call) and ast.unparse(n.func) == "GRPOConfig"
    )
    script_kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}
    table_kwargs = {row["trl"][0]: row["trl_value"] for row in rows if row["trl_value"] is not NOTHING}
    assert script_kwargs == table_kwargs
    trl_config = trl.GRPOConfig(**script_kwargs, use_cpu=True)  # bf16 on a machine without a GPU

    # Ours: the YAML, with the tiny model standing in for the hub's.
    path = tmp_path / "deepmath.yaml"
    path.write_text(config)
    cli = build_cli(["--config", str(path), f"--model.policy={tiny_model_dir}"], run=False)
    assert (
        cli.model.reward_funcs == [accuracy_reward, think_format_reward]
        and cli.model.validation.reward is accuracy_reward
    )
    assert type(cli.datamodule) is PromptDataModule

    def ours(option: str):
        head, *rest = option.split(".")
        if head == "model":  # the module's arguments, as its hyper-parameters hold them
            if rest[0] == "grpo" and rest[1] in FLAT_NAMES:  # a flat name: where it sits in the sections
                entry = FLAT_NAMES[rest[1]]
                rest = ["grpo", *entry.path]
                if entry.switch:
                    return cli.model.hparams["grpo"][entry.path[0]] is not None
            value = cli.model.hparams[rest[0]]
            for key in rest[1:]:
                if value is None:  # an option of a section that is off: its default
                    return default_at(GRPOConfig, tuple(rest[1:]))
                value = value[key] if isinstance(value, dict) else getattr(value, key)
            return plain(value)
        if head == "data":
            return cli.datamodule.hparams[rest[0]]
        return functools.reduce(lambda ns, key: ns[key], option.split("."), cli.config)

    our_names = (
        set(FLAT_NAMES)
        | {f.name for f in dataclasses.fields(ModelOptions)}
        | set(inspect.signature(GRPOModule).parameters)
        | set(inspect.signature(PromptDataModule).parameters)
    )
    for row in rows:
        name = row["trl"][0]
        if row["trl_value"] is not NOTHING:
            assert plain(getattr(trl_config, name)) == row["trl_value"], name
        if row["ours"] is not None:
            assert ours(row["ours"]) == row["our_value"], row["ours"]
        if row["kind"] == "maps":
            assert row["our_value"] == row["trl_value"], name
        if row["kind"] == "lacks":
            assert row["ours"] is None and not set(row["trl"]) & our_names, row["trl"]


def test_cli_trains_on_trl_data_with_trl_rewards(tiny_model_dir, tmp_path):
    """The command line path: a TRL-format file, TRL's reward functions by import path, two steps."""
    from grpo_lightning.cli import build_cli
    from tests.test_interrupt import fit_args

    source = write_jsonl(tmp_path / "train.jsonl", trl_rows(conversational=True))
    args = fit_args(
        tiny_model_dir,
        str(tmp_path),
        2,
        "--data=grpo_lightning.training.data.PromptDataModule",
        f"--data.source={source}",
        "--data.val_size=0",
        "--model.reward_funcs=[trl.rewards.think_format_reward, trl.rewards.accuracy_reward]",
        "--model.grpo.preflight=true",
    )
    # Without `--data.system_prompt=null`, the preset's default system prompt would be there to carry over.
    cli = build_cli([arg for arg in args if arg != "--data.system_prompt=null"])
    assert cli.trainer.global_step == 2
    assert cli.datamodule.hparams.system_prompt is None  # the GSM8K preset's is not carried over
    assert cli.datamodule.train_rows[0]["prompt"][0]["role"] == "user"
    for name in ("think_format_reward", "accuracy_reward"):
        assert f"train/rewards/{name}" in cli.trainer.callback_metrics


def test_group_inputs_repeat_each_prompt_and_column_for_its_group_as_trl_does():
    batch = {"prompt": ["p0", "p1"], "answer": ["4", "9"], "source": ["a", "b"]}
    inputs = RewardInputs.of_groups(batch, list("wxyzWXYZ"[:6]), [[1]] * 6, trainer_state(3, 10, 0.5))
    assert inputs.prompts == ["p0"] * 3 + ["p1"] * 3
    assert inputs.columns == {"answer": ["4"] * 3 + ["9"] * 3, "source": ["a"] * 3 + ["b"] * 3}
    assert "prompt" not in inputs.columns and inputs.state.global_step == 3
