"""Prompts built as TRL recipes build them: a system prompt before a text column (open-r1's
`system_prompt`), a text column as the user's turn (`chat_prompt`), a format string over the columns
(`prompt_template`); text prompts without any of them stay text (TRL's standard format)."""

from __future__ import annotations

import datasets
import pytest
from jsonargparse import Namespace
from transformers import AutoTokenizer

from grpo_lightning.cli.config_checks import reset_preset_data_defaults
from grpo_lightning.core.chat_template import PromptOptions
from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.generation.prompts import PromptEncoder
from grpo_lightning.io.rows import DEFAULT_SYSTEM_PROMPT, collate_rows
from grpo_lightning.training.data import PromptDataModule
from grpo_lightning.training.evaluation import GSM8KAccuracyCallback
from tests.helpers import GSM8K_DIR, quiet_trainer, recorded_prompt_ids, tiny_module

ROWS = [{"problem": f"What is {i} + {i}?", "solution": str(2 * i)} for i in range(6)]
SYSTEM = "Think, then answer."


class PromptRecorder:
    """A reward that keeps the `prompts` it is given."""

    __name__ = "prompt_recorder"

    def __init__(self) -> None:
        self.prompts: list = []

    def __call__(self, prompts, completions, **kwargs) -> list[float]:
        self.prompts.extend(prompts)
        return [float(len(str(c))) for c in completions]


def test_a_system_prompt_makes_the_text_column_a_conversation(tiny_model_dir, monkeypatch):
    seen = recorded_prompt_ids(monkeypatch)
    data = PromptDataModule(
        datasets.Dataset.from_list(ROWS),
        prompt_field="problem",
        system_prompt=SYSTEM,
        batch_size=2,
        val_size=0,
    )
    reward = PromptRecorder()
    module = tiny_module(tiny_model_dir, reward_funcs=[reward], max_completion_length=4)
    quiet_trainer(max_steps=1, limit_val_batches=0).fit(module, data)

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    by_problem = {row["problem"]: row for row in ROWS}
    # The rewards get the conversations, as TRL passes them: one per completion, 2 per prompt.
    assert len(reward.prompts) == 4
    for prompt in reward.prompts:
        system, user = prompt
        assert system == {"role": "system", "content": SYSTEM}
        assert user["role"] == "user" and user["content"] in by_problem
    # The policy got each conversation through the chat template, nothing else.
    expected = [
        tokenizer.apply_chat_template(p, tokenize=True, add_generation_prompt=True, return_dict=False)
        for p in reward.prompts[::2]
    ]
    assert seen[:2] == [list(ids) for ids in expected]
    assert module.trainer.datamodule.conversational


def test_chat_prompt_makes_the_user_turn_without_a_system_prompt():
    data = PromptDataModule(
        datasets.Dataset.from_list(ROWS), prompt_field="problem", chat_prompt=True, val_size=2
    )
    data.setup("fit")
    problems = {row["problem"]: row["solution"] for row in ROWS}
    for row in data.train_rows + data.val_rows:
        (message,) = row["prompt"]
        assert message["role"] == "user" and problems[message["content"]] == row["solution"]
    batch = next(iter(data.val_dataloader()))
    assert batch["prompt"] == [row["prompt"] for row in data.val_rows]


def test_text_prompts_stay_text_by_default(tiny_model_dir):
    rows = [{"prompt": row["problem"], "answer": row["solution"]} for row in ROWS]
    data = PromptDataModule(datasets.Dataset.from_list(rows), val_size=2)
    data.setup("fit")
    assert isinstance(data.train_rows[0]["prompt"], str) and not data.conversational
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = data.train_rows[0]["prompt"]
    ids, mask = PromptEncoder(tokenizer).encode([text], "cpu")
    assert ids[0][mask[0].bool()].tolist() == tokenizer(text)["input_ids"]  # no chat template around it


def test_a_chat_prompt_gets_the_system_turn_first_unless_it_has_one():
    messages = [{"role": "user", "content": "2 + 2?"}]
    rows = [{"prompt": messages, "answer": "4"}] * 3
    data = PromptDataModule(datasets.Dataset.from_list(rows), system_prompt=SYSTEM, val_size=1)
    data.setup("fit")
    assert data.train_rows[0]["prompt"] == [{"role": "system", "content": SYSTEM}, *messages]

    own = [{"role": "system", "content": "Be brief."}, *messages]
    data = PromptDataModule(
        datasets.Dataset.from_list([{"prompt": own, "answer": "4"}] * 3), system_prompt=SYSTEM, val_size=1
    )
    with pytest.raises(ValueError, match=r"row 0: field 'prompt' starts with a system message of its own"):
        data.setup("fit")


def test_a_template_writes_the_prompt_from_the_columns():
    data = PromptDataModule(
        datasets.Dataset.from_list(ROWS),
        prompt_template="Solve: {problem} ({solution!r} hidden)",
        system_prompt=SYSTEM,
        val_size=2,
    )
    data.setup("fit")
    row = data.train_rows[0]
    assert row["prompt"][1] == {
        "role": "user",
        "content": f"Solve: {row['problem']} ('{row['solution']}' hidden)",
    }
    assert set(row) == {"prompt", "problem", "solution"}  # the columns still reach the rewards

    plain = PromptDataModule(datasets.Dataset.from_list(ROWS), prompt_template="Q: {problem}", val_size=0)
    plain.setup("fit")
    assert plain.train_rows[0]["prompt"] == "Q: " + plain.train_rows[0]["problem"]


@pytest.mark.parametrize(
    ("template", "message"),
    [
        (
            "Solve: {question}",
            r"row \d: data.prompt_template='Solve: \{question\}' names \{question\}, which is not a column "
            r"\(the columns are \['problem', 'solution'\]\)",
        ),
        ("Solve: {}", r"data.prompt_template='Solve: \{\}': name the columns it reads in braces"),
        ("Solve: {problem", r"data.prompt_template='Solve: \{problem': not a format string"),
    ],
)
def test_a_template_naming_no_column_is_refused_before_any_weights_load(template, message):
    data = PromptDataModule(datasets.Dataset.from_list(ROWS), prompt_template=template, val_size=2)
    with pytest.raises(ValueError, match=message):
        data.setup("fit")  # the module's weights load after this, in `fit`


def test_a_class_switch_does_not_carry_the_presets_system_prompt():
    def parsed(system_prompt):
        init_args = Namespace(source="rows.jsonl", system_prompt=system_prompt, val_size=64)
        return Namespace(
            data=Namespace(class_path="grpo_lightning.training.data.PromptDataModule", init_args=init_args)
        )

    config = parsed(DEFAULT_SYSTEM_PROMPT)
    reset_preset_data_defaults(config, Namespace(data=Namespace(init_args=Namespace(source="rows.jsonl"))))
    assert config.data.init_args.system_prompt is None and config.data.init_args.val_size == 64

    given = Namespace(data=Namespace(init_args=Namespace(system_prompt=DEFAULT_SYSTEM_PROMPT)))
    config = parsed(DEFAULT_SYSTEM_PROMPT)
    reset_preset_data_defaults(config, given)
    assert config.data.init_args.system_prompt == DEFAULT_SYSTEM_PROMPT  # the user's own choice stays


THINKING_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def test_chat_template_kwargs_reach_the_template(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = THINKING_TEMPLATE
    messages = [[{"role": "user", "content": "2 + 2?"}]]
    config = GRPOConfig(chat_template_kwargs={"enable_thinking": False})
    assert config.prompts.chat_template_kwargs == {"enable_thinking": False}

    plain, _ = PromptEncoder(tokenizer).encode(messages, "cpu")
    off, _ = PromptEncoder(tokenizer, options=config.prompts).encode(messages, "cpu")
    closed_block = tokenizer("<think>\n\n</think>\n\n", add_special_tokens=False)["input_ids"]
    assert off[0].tolist() == plain[0].tolist() + closed_block
    expected = tokenizer.apply_chat_template(
        messages[0], tokenize=True, add_generation_prompt=True, enable_thinking=False, return_dict=False
    )
    assert off[0].tolist() == list(expected)


def test_the_rollouts_encoder_takes_the_options_kwargs(tiny_model_dir):
    module = tiny_module(tiny_model_dir, chat_template_kwargs={"enable_thinking": False})
    assert module.rollouts.encoder.options == PromptOptions(chat_template_kwargs={"enable_thinking": False})
    with pytest.raises(ValueError, match=r"GRPOConfig.prompts.chat_template_kwargs='off': must be a mapping"):
        GRPOConfig(chat_template_kwargs="off")


def test_an_evaluation_renders_its_prompts_with_the_modules_kwargs(tiny_model_dir, monkeypatch):
    """`GSM8KAccuracyCallback` samples a `GRPOModule`'s policy from prompts rendered as its training ones."""
    seen = recorded_prompt_ids(monkeypatch)
    module = tiny_module(tiny_model_dir, chat_template_kwargs={"enable_thinking": False})
    module.configure_model()
    module.tokenizer.chat_template = THINKING_TEMPLATE
    callback = GSM8KAccuracyCallback(source=GSM8K_DIR, split="holdout", num_problems=2, max_new_tokens=2)
    callback.setup(None, module, "fit")
    callback.evaluate(module)
    batch = collate_rows(callback.data.val_rows, callback.data.hparams.system_prompt)["prompt"]
    expected = [
        module.tokenizer.apply_chat_template(
            p, tokenize=True, add_generation_prompt=True, enable_thinking=False, return_dict=False
        )
        for p in batch
    ]
    assert len(seen) == 2 and seen == [list(ids) for ids in expected]
    closed_block = module.tokenizer("<think>\n\n</think>\n\n", add_special_tokens=False)["input_ids"]
    assert all(ids[-len(closed_block) :] == closed_block for ids in seen)
