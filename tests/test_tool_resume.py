"""Exact resume of a multi-turn run: a run with tools, resumed from its checkpoint after step 1, makes the
same step 2 as the run straight through: the same prompts, the same turns (tool calls and results), the same
rewards, loss and weights. The policy is the tiny model taught to call the calculator
(`tests/test_tool_rollouts.py`), sampled at temperature 0.8 so that the RNG decides which samples call it."""

import copy

import lightning as L
import pytest
from datasets import Dataset
from lightning.pytorch.callbacks import ModelCheckpoint

from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.tools.calculator import calculator
from grpo_lightning.core.tools.rewards import tool_call_reward
from grpo_lightning.training.data import PromptDataModule
from grpo_lightning.training.module import GRPOModule
from tests.helpers import quiet_trainer
from tests.test_resume import assert_same_continuation
from tests.test_tool_rollouts import Trajectories, answered_42
from tests.test_tool_rollouts import calling_model as calling_model  # a fixture, shared

QUESTIONS = [
    "What is 6 times 7?",
    "What is 7 times 6?",
    "What is 6 * 7?",
    "What is 6 times 7 ?",
    "What is 42?",
]


class TurnRecorder(Trajectories):
    """What each training step saw and produced, its turns included."""

    def __init__(self) -> None:
        self.steps: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        record, rollout = pl_module.last_rollout, self.trajectory.rollout
        turns = pl_module.rollouts.multi_turn
        self.steps.append(
            {
                "questions": [prompt[-1]["content"] for prompt in batch["prompt"]],
                "completions": record.completions,
                "rewards": record.rewards.tolist(),
                "loss": float(outputs["loss"]),
                "calls": float(trainer.callback_metrics["train/tools/call_frequency"]),
                "tool_tokens": int((rollout.completion_mask - rollout.model_mask).sum()),
                "multi_turn": turns is not None,
            }
        )


def fit(
    calling,
    max_steps: int,
    seed: int,
    root: str,
    ckpt_path: str | None = None,
    save: bool = False,
    backend: str = "eager",
) -> tuple[GRPOModule, TurnRecorder]:
    model, tokenizer = calling
    L.seed_everything(seed)
    grpo = GRPOConfig(
        num_generations=4,
        max_completion_length=128,
        temperature=0.9,  # at 1.0 most calls are broken JSON, which calls nothing (TRL's reading)
        learning_rate=1e-3,
        generation_backend=backend,
        preflight=False,
        log_completions_every=0,
    )
    module = GRPOModule(
        copy.deepcopy(model),
        tokenizer,
        reward_funcs=[answered_42, tool_call_reward],
        grpo=grpo,
        tools=[calculator],
    )
    rows = [{"prompt": [{"role": "user", "content": q}], "answer": "42"} for q in QUESTIONS]
    data = PromptDataModule(source=Dataset.from_list(rows), batch_size=2, val_size=1, seed=0)
    recorder = TurnRecorder()
    callbacks: list[L.Callback] = [recorder]
    if save:
        callbacks.append(ModelCheckpoint(dirpath=root, every_n_train_steps=max_steps, save_top_k=-1))
    trainer = quiet_trainer(
        max_steps=max_steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_checkpointing=save,
        callbacks=callbacks,
        default_root_dir=root,  # where an interrupted fit writes its checkpoint
    )
    trainer.fit(module, data, ckpt_path=ckpt_path)
    assert trainer.global_step == max_steps
    return module, recorder


@pytest.mark.parametrize("backend", ["eager", "static"])
def test_a_multi_turn_run_resumed_after_step_1_makes_the_same_step_2(calling_model, tmp_path, backend):
    root = str(tmp_path)
    straight, straight_steps = fit(calling_model, 2, seed=2, root=root, backend=backend)
    fit(calling_model, 1, seed=2, root=root, save=True, backend=backend)
    [ckpt] = list(tmp_path.glob("*step=1.ckpt"))
    # Another seed: only the checkpoint's RNG states can make the resumed run sample the same turns.
    resumed, resumed_steps = fit(calling_model, 2, seed=1234, root=root, ckpt_path=str(ckpt), backend=backend)
    [want] = straight_steps.steps[1:]
    [have] = resumed_steps.steps
    assert want["multi_turn"] and want["calls"] > 0 and want["tool_tokens"] > 0  # step 2 called the tool
    assert 0 < sum(want["rewards"]) < len(want["rewards"])  # the samples differ: the RNG chose their turns
    assert (have["calls"], have["tool_tokens"]) == (want["calls"], want["tool_tokens"])
    assert_same_continuation(straight, [want], resumed, [have])


def test_without_the_checkpoint_another_seed_samples_other_turns(calling_model, tmp_path):
    """The comparison above can fail: from another seed, straight through, step 2 differs."""
    _, seeded = fit(calling_model, 2, seed=0, root=str(tmp_path))
    _, other = fit(calling_model, 2, seed=1234, root=str(tmp_path))
    assert seeded.steps[1]["completions"] != other.steps[1]["completions"]
    assert seeded.steps[1]["loss"] != pytest.approx(other.steps[1]["loss"], rel=1e-6, abs=1e-9)
