"""Reward functions that misbehave are named with a completion they were given, in one line, checked right
after their own call; each gets its own copies of the inputs, so that none changes what the next scores;
steps whose completions are all empty or all cut off warn; prompts over the limit are cut or refused."""

import math
import re

import lightning as L
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.rewards.scoring import (
    CALL_KEYWORDS,
    RewardInputs,
    call_reward,
    score_completions,
    trainer_state,
)
from grpo_lightning.core.rewards.verifiable import completion_text
from grpo_lightning.training.data import GSM8KDataModule
from grpo_lightning.training.module import GRPOModule
from tests.helpers import cli_error, quiet_trainer
from tests.test_interrupt import fit_args


# ------------------------------------------------------------------------------------------ rewards
def wrong_count_reward(completions, **kwargs) -> list[float]:
    return [0.0] * (len(completions) - 1)


def nan_reward(completions, **kwargs) -> list[float]:
    return [math.nan] + [0.0] * (len(completions) - 1)


def inf_reward(completions, **kwargs) -> list[float]:
    return [0.0] * (len(completions) - 1) + [math.inf]


def none_reward(completions, **kwargs) -> list[None]:
    return [None] * len(completions)


def digit_count_reward(completions, **kwargs) -> list[float]:
    """The number of digit characters of each completion (`helpers.digit_reward` is their share)."""
    return [float(sum(ch.isdigit() for ch in completion_text(c))) for c in completions]


class FailsAtStep:
    """A reward function with a bug that shows on the `step`-th batch it scores."""

    def __init__(self, step: int) -> None:
        self.step, self.calls = step, 0

    def __call__(self, completions, **kwargs) -> list[float]:
        self.calls += 1
        if self.calls == self.step:
            raise ZeroDivisionError("division by zero")
        return [0.0] * len(completions)


def train(model_dir: str, root, reward_funcs: list, steps: int = 1, **grpo) -> L.Trainer:
    grpo = {"num_generations": 2, "max_completion_length": 4, "preflight": False} | grpo
    module = GRPOModule(model_dir, reward_funcs=reward_funcs, grpo=GRPOConfig(**grpo))
    data = GSM8KDataModule(
        source="arithmetic", system_prompt=None, arithmetic_size=20, batch_size=2, val_size=2
    )
    trainer = quiet_trainer(max_steps=steps, limit_val_batches=0, default_root_dir=str(root))
    trainer.fit(module, data)
    return trainer


@pytest.mark.parametrize(
    ("reward", "message"),
    [
        (wrong_count_reward, "reward function 'wrong_count_reward' returned 3 values for 4 completions"),
        (nan_reward, "reward function 'nan_reward' returned nan for completion 0: '"),
        (inf_reward, "reward function 'inf_reward' returned inf for completion 3: '"),
        (none_reward, r"no reward function ['none_reward'] scored completion 0 (all returned None): '"),
    ],
    ids=["wrong-count", "nan", "inf", "all-none"],
)
def test_bad_reward_values_name_the_function(tiny_model_dir, tmp_path, no_audit, reward, message):
    with pytest.raises(RuntimeError) as error:
        train(tiny_model_dir, tmp_path, [reward])
    assert str(error.value).startswith(message)


def test_a_reward_that_is_none_everywhere_beside_a_working_one_only_warns(tiny_model_dir, tmp_path, no_audit):
    with pytest.warns(UserWarning, match="reward function 'none_reward' returned None for every completion"):
        trainer = train(tiny_model_dir, tmp_path, [digit_count_reward, none_reward])
    assert trainer.global_step == 1


def test_a_reward_that_raises_is_named_and_the_completed_steps_are_kept(
    tiny_model_dir, tmp_path, capsys, no_audit
):
    err = cli_error(
        fit_args(
            tiny_model_dir,
            str(tmp_path),
            5,
            "--model.reward_funcs=[{class_path: tests.test_bad_input_rewards.FailsAtStep, "
            "init_args: {step: 3}}]",
        ),
        capsys,
    )
    assert "error: reward function 'fails_at_step' raised ZeroDivisionError: division by zero; first " in err
    # The two steps before the error are not lost: a checkpoint of step 2 to resume from once it is fixed.
    saved = torch.load(
        tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "interrupted.ckpt", weights_only=True
    )
    assert saved["global_step"] == 2
    assert saved["GSM8KDataModule"] == {"epoch": 0, "batches_done": 2}


def chat_inputs() -> RewardInputs:
    """Two chat prompts' completions, with an `answer` column and a trainer state."""
    prompts = [[{"role": "user", "content": "1 + 1?"}], [{"role": "user", "content": "2 + 3?"}]]
    return RewardInputs(
        prompts, ["#### 2", "#### 4"], [[5, 6], [7]], {"answer": ["2", "5"]}, trainer_state(global_step=3)
    )


def test_a_reward_that_changes_its_inputs_changes_nothing_for_the_next():
    """The first function overwrites, reorders, appends to and empties everything it is given; the second
    still gets the rollout's values, and so does what the module keeps for logging."""
    seen = {}

    def meddling_reward(prompts, completions, completion_ids, trainer_state, answer, **kwargs):
        values = [1.0] * len(completions)
        completions[0][0]["content"] = "#### 20"
        completions.reverse()
        prompts[0][0]["content"] = "another question"
        prompts.append(prompts[0])
        completion_ids[0].append(99)
        answer[:] = ["20", "20"]
        trainer_state.global_step = 1000
        return values

    def recording_reward(prompts, completions, completion_ids, trainer_state, answer, **kwargs):
        seen.update(prompts=prompts, completions=completions, ids=completion_ids, answer=answer)
        seen["step"] = trainer_state.global_step
        return [0.0] * len(completions)

    inputs = chat_inputs()
    expected = chat_inputs()
    scores = score_completions([meddling_reward, recording_reward], inputs)
    assert scores.rewards.tolist() == [[1.0, 0.0], [1.0, 0.0]]
    assert seen == {
        "prompts": expected.prompts,
        "completions": expected.trl_completions(),
        "ids": [[5, 6], [7]],
        "answer": ["2", "5"],
        "step": 3,
    }
    assert (inputs.prompts, inputs.completions, inputs.columns) == (
        expected.prompts,
        expected.completions,
        expected.columns,
    )


def test_a_reward_that_empties_its_inputs_leaves_the_next_its_own():
    """Emptied lists once made the next function return no values, and take the blame."""

    def emptying_reward(completions, prompts, answer, **kwargs):
        values = [0.0] * len(completions)
        for inputs in (completions, prompts, answer):
            inputs.clear()
        return values

    def length_reward(completions, answer, **kwargs):
        return [float(len(c[0]["content"]) + len(a)) for c, a in zip(completions, answer, strict=True)]

    scores = score_completions([emptying_reward, length_reward], chat_inputs())
    assert scores.rewards.tolist() == [[0.0, 7.0], [0.0, 7.0]]


def test_each_result_is_checked_before_the_next_function_runs():
    calls = []

    def text_reward(completions, **kwargs):
        calls.append("text_reward")
        return "1.0"

    def failing_reward(completions, **kwargs):
        calls.append("failing_reward")
        raise ZeroDivisionError("division by zero")

    with pytest.raises(RuntimeError) as error:
        score_completions([text_reward, failing_reward], chat_inputs())
    assert str(error.value).startswith(
        "reward function 'text_reward' must return a list with one float (or None) per completion; it "
        "returned a str: '1.0'"
    )
    assert calls == ["text_reward"]


@pytest.mark.parametrize("keyword", CALL_KEYWORDS)
def test_reward_inputs_refuse_a_column_named_like_a_keyword(keyword):
    with pytest.raises(ValueError) as error:
        RewardInputs(["q"], ["#### 1"], [[1]], {"answer": ["1"], keyword: ["#### 20"]})
    assert str(error.value) == (
        f"the reward functions' inputs: the data column {keyword!r} has the name of a keyword every reward "
        "function is given (prompts, completions, completion_ids, trainer_state, log_extra, log_metric) and "
        "would replace it: rename the column"
    )


# ------------------------------------------------------------------------------------------ generation
def end_early(module: GRPOModule, eos_logit: float) -> None:
    """Give the policy an LM head whose logits are 0 for every token but EOS, which gets `eos_logit`."""
    head = torch.nn.Linear(module.policy.config.hidden_size, module.policy.config.vocab_size)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    head.bias.data[module.tokenizer.eos_token_id] = eos_logit
    module.policy.set_output_embeddings(head)


def test_every_completion_empty_warns(tiny_model_dir, tmp_path):
    module = GRPOModule(tiny_model_dir, grpo=GRPOConfig(num_generations=2, max_completion_length=4))
    module.configure_model()
    end_early(module, eos_logit=100.0)  # the policy ends every completion at once
    rollout, completions = module.rollouts.sample([[{"role": "user", "content": "2 + 3?"}]], 2)
    assert completions == ["", ""]
    with pytest.warns(UserWarning, match="all 2 completions of this step are empty: the policy ends at once"):
        module.rollouts.check(rollout, completions)


def test_completions_that_decode_to_nothing_warn_as_such(tiny_model_dir):
    # The model's vocabulary is larger than the tokenizer's and the policy writes only ids the tokenizer lacks
    # (as gpu_check's 151,936-token model with a 1,024-token tokenizer did): it did not end at once.
    module = GRPOModule(tiny_model_dir, grpo=GRPOConfig(num_generations=2, max_completion_length=4))
    module.configure_model()
    unknown = len(module.tokenizer)
    module.policy.resize_token_embeddings(unknown + 1)
    end_early(module, eos_logit=-100.0)
    module.policy.get_output_embeddings().bias.data[unknown] = 100.0  # always the unknown id
    rollout, completions = module.rollouts.sample([[{"role": "user", "content": "2 + 3?"}]], 2)
    assert completions == ["", ""] and rollout.completion_mask.sum() == 8
    message = (
        f"all 2 completions of this step are empty: 2 have tokens (8 in all) that decode to nothing "
        f"(whitespace, special tokens, or ids past the tokenizer's {unknown}: the model's vocabulary has "
        f"{unknown + 1})"
    )
    with pytest.warns(UserWarning, match=re.escape(message) + "$"):
        module.rollouts.check(rollout, completions)


def test_every_completion_truncated_warns(tiny_model_dir, tmp_path, no_audit):
    # EOS suppressed for all 4 tokens: every completion runs into the limit.
    with pytest.warns(UserWarning, match="all 4 completions of this step reached max_completion_length=4 "):
        trainer = train(tiny_model_dir, tmp_path, [digit_count_reward], min_completion_length=4)
    assert trainer.global_step == 1  # a warning, not a stop
    assert float(trainer.callback_metrics["train/frac_truncated"]) == 1.0


@pytest.mark.parametrize("mode", ["left", "error"])
def test_prompt_over_the_limit_is_cut_from_the_left_or_refused(tiny_model_dir, mode):
    grpo = GRPOConfig(num_generations=2, max_prompt_length=6, truncate_prompts=mode)
    module = GRPOModule(tiny_model_dir, grpo=grpo)
    prompts = [[{"role": "user", "content": "What is 12 + 30 + 7?"}], [{"role": "user", "content": "1?"}]]
    full = GRPOModule(tiny_model_dir, grpo=GRPOConfig(num_generations=2, max_prompt_length=None))
    full_ids, full_mask = full.rollouts.encoder.encode(prompts, "cpu")  # [2, P]
    longest = int(full_mask.sum(1).max())
    if mode == "error":
        with pytest.raises(ValueError, match=f"a prompt has {longest} tokens, over max_prompt_length=6"):
            module.rollouts.encoder.encode(prompts, "cpu")
        return
    with pytest.warns(UserWarning, match=f"prompt of {longest} tokens cut from the left to max_prompt_len"):
        ids, mask = module.rollouts.encoder.encode(prompts, "cpu")
    assert ids.shape == (2, 6)
    torch.testing.assert_close(ids, full_ids[:, -6:])  # the ends, where the generation prompt is, survive


def test_prompts_are_whole_by_default_and_a_system_turn_or_tools_are_never_cut(tiny_model_dir):
    from grpo_lightning.core.tools.calculator import calculator
    from grpo_lightning.core.tools.schemas import tool_schema

    assert GRPOConfig().max_prompt_length is None  # TRL 1.x has no prompt cut
    module = GRPOModule(tiny_model_dir, grpo=GRPOConfig(num_generations=2, max_prompt_length=6))
    question = {"role": "user", "content": "What is 12 + 30 + 7?"}
    system = [{"role": "system", "content": "Answer with a number."}, question]
    full = GRPOModule(tiny_model_dir, grpo=GRPOConfig(num_generations=2)).rollouts.encoder
    length = int(full.encode([system], "cpu")[1].sum())
    with pytest.raises(
        ValueError, match=f"^a prompt that opens with a system turn has {length} tokens, over "
    ):
        module.rollouts.encoder.encode([system], "cpu")
    shown = [[tool_schema(calculator)]]
    length = int(full.encode([[question]], "cpu", tools=shown)[1].sum())
    with pytest.raises(
        ValueError, match=f"^a prompt that shows tools has {length} tokens, over max_prompt_le"
    ):
        module.rollouts.encoder.encode([[question]], "cpu", tools=shown)


# ------------------------------------------------------------------------------------------ reward types
def tensor_reward(completions, **kwargs):
    return torch.zeros(len(completions))


# Wrong return values, each with what the message says about it. One contract (`scoring._check_values`)
# checks them all, in training, validation, the audit and the pre-flight alike.
WRONG_RETURNS = {
    "strings": (lambda n: ["1.0"] * n, "value 0 is a str: '1.0', for completion 0: "),
    "None": (lambda n: None, "it returned None (return a list: [None] * len(completions) when"),
    "tensor": (
        lambda n: torch.zeros(n),
        "it returned a torch Tensor (return value.tolist()); first completion: ",
    ),
    "ndarray": (
        lambda n: np.zeros(n),
        "it returned a numpy ndarray (return value.tolist()); first completion: ",
    ),
    "generator": (
        lambda n: (0.0 for _ in range(n)),
        "it returned a generator (return a list, e.g. list(...))",
    ),
    "str": (lambda n: "1" * n, "it returned a str: '1111'; first completion: "),
    "dict": (lambda n: {i: 0.0 for i in range(n)}, "it returned a dict: "),
    "tensor items": (
        lambda n: list(torch.zeros(n)),
        "value 0 is a torch Tensor (return value.tolist()), for",
    ),
    "numpy strings": (lambda n: list(np.array(["a"] * n)), "value 0 is a numpy str_ (return value.tolist())"),
    "nested": (lambda n: [[0.0]] * n, "value 0 is a list: '[0.0]', for completion 0: "),
}


@pytest.mark.parametrize("case", list(WRONG_RETURNS))
def test_every_wrong_return_type_names_the_function_and_a_completion(case):
    make, detail = WRONG_RETURNS[case]

    def bad_reward(completions, **kwargs):
        return make(len(completions))

    inputs = RewardInputs(["q"] * 4, ["a", "b", "c", "d"])
    with pytest.raises(RuntimeError) as error:
        score_completions([bad_reward], inputs)
    message = str(error.value)
    assert message.startswith("reward function 'bad_reward' must return a list with one float (or None) per ")
    assert detail in message
    assert "'a'" in message  # the completion it was given


def test_numbers_of_any_kind_are_rewards():
    values = [np.float32(0.5), np.int64(2), True, None]
    scores = call_reward(lambda completions, **kwargs: tuple(values), RewardInputs(["q"] * 4, list("abcd")))
    assert scores == [0.5, 2.0, 1.0, None] and all(type(v) is float for v in scores[:3])


ELEMENTS = st.one_of(
    st.none(),
    st.floats(),
    st.integers(-10, 10),
    st.booleans(),
    st.text(max_size=3),
    st.lists(st.floats(), max_size=1),
)


@given(
    st.one_of(
        st.lists(ELEMENTS, min_size=0, max_size=5),
        st.tuples(ELEMENTS, ELEMENTS, ELEMENTS),
        st.none(),
        st.floats(),
        st.text(max_size=5),
        st.dictionaries(st.integers(0, 3), st.floats(), max_size=3),
    )
)
def test_any_return_value_is_a_reward_or_one_clear_error(returned):
    """Whatever a reward function returns: three valid rewards, or a `RuntimeError` naming it and a
    completion, never a raw `TypeError` from deeper down."""

    def any_reward(completions, **kwargs):
        return returned

    inputs = RewardInputs(["q"] * 3, ["first", "second", "third"])
    try:
        scores = call_reward(any_reward, inputs)
    except RuntimeError as err:
        assert str(err).startswith("reward function 'any_reward' ")
        assert any(repr(c) in str(err) for c in inputs.completions)
        return
    assert isinstance(returned, (list, tuple)) and len(returned) == 3
    for value, got in zip(returned, scores, strict=True):
        assert got == (None if value is None else float(value)) and (got is None or math.isfinite(got))


def test_a_wrong_return_type_ends_the_cli_with_one_line(tiny_model_dir, tmp_path, capsys):
    args = fit_args(
        tiny_model_dir, str(tmp_path), 1, "--model.reward_funcs=[tests.test_bad_input_rewards.tensor_reward]"
    )
    err = cli_error(args, capsys)
    assert "error: reward function 'tensor_reward' must return a list with one float (or None) per " in err
    assert "returned a torch Tensor (return value.tolist()); first completion: '" in err
