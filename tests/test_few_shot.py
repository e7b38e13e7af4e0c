"""`data.few_shot`: worked examples as earlier turns of every prompt's conversation, and a tool exchange among
them read by the policy as its rollout's own tool turns will be."""

import os

import pytest
import yaml
from datasets import Dataset

from grpo_lightning.core.tools.calculator import calculator
from grpo_lightning.core.tools.formats import TOOL_CALL_FORMATS
from grpo_lightning.core.tools.schemas import tool_schema
from grpo_lightning.core.tools.turns import tool_messages, tool_suffix_ids
from grpo_lightning.offline.tool_caller import TOOLS_TEMPLATE
from grpo_lightning.training.data import GSM8KDataModule, PromptDataModule
from tests.helpers import cli_error, one_error_line, tiny_module

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'
SHOTS = [
    {"role": "user", "content": "Tom buys 6 boxes with 7 pens in each box. How many pens does Tom buy?"},
    {"role": "assistant", "content": CALL},
    {"role": "tool", "name": "calculator", "content": "42"},
    {"role": "assistant", "content": "#### 42"},
]


def test_the_examples_sit_between_the_system_turn_and_each_question():
    data = GSM8KDataModule(
        source="arithmetic", system_prompt="S", few_shot=SHOTS, arithmetic_size=20, val_size=2
    )
    data.setup("fit")
    for row in data.train_rows + data.val_rows:
        assert row["prompt"] == [
            {"role": "system", "content": "S"},
            *SHOTS,
            {"role": "user", "content": row["question"]},
        ]
    rows = [
        {"prompt": [{"role": "system", "content": "own"}, {"role": "user", "content": "Q1"}], "answer": "1"},
        {"prompt": [{"role": "user", "content": "Q2"}], "answer": "2"},
        {"prompt": [{"role": "user", "content": "Q3"}], "answer": "3"},
    ]
    chat = PromptDataModule(source=Dataset.from_list(rows), few_shot=SHOTS, val_size=0)
    chat.setup("fit")
    prompts = {row["answer"]: row["prompt"] for row in chat.train_rows}
    assert prompts["1"] == [
        rows[0]["prompt"][0],
        *SHOTS,
        rows[0]["prompt"][1],
    ]  # after the row's own system turn
    assert prompts["2"] == [*SHOTS, {"role": "user", "content": "Q2"}]
    text = PromptDataModule(
        source=Dataset.from_list([{"q": "Q", "answer": "1"}] * 2),
        prompt_template="{q}?",
        few_shot=SHOTS,
        val_size=0,
    )
    text.setup("fit")  # a text prompt becomes the user's turn after the examples
    assert text.train_rows[0]["prompt"] == [*SHOTS, {"role": "user", "content": "Q?"}]


@pytest.mark.parametrize(
    ("few_shot", "message"),
    [
        ([], r"data\.few_shot: a non-empty list of chat messages"),
        (
            [{"role": "user", "content": "q"}, {"role": "system", "content": "s"}],
            r"data\.few_shot\[1\]: a message is",
        ),
        (
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": 42}],
            r"data\.few_shot\[1\]: a message is",
        ),
        (
            [{"role": "assistant", "content": "a"}],
            r"data\.few_shot\[0\] has role 'assistant': the examples must open",
        ),
        (
            SHOTS[:3],
            r"data\.few_shot\[2\] has role 'tool': the examples must close with the assistant's turn",
        ),
    ],
)
def test_bad_examples_are_one_line_naming_the_message_before_any_row_is_read(few_shot, message):
    data = GSM8KDataModule(source="arithmetic", few_shot=few_shot, arithmetic_size=20, val_size=2)
    with pytest.raises(ValueError, match=message) as caught:
        data.setup("fit")
    assert "\n" not in str(caught.value) and not data.train_rows


def contains(ids: list[int], part: list[int]) -> bool:
    return any(ids[i : i + len(part)] == part for i in range(len(ids) - len(part) + 1))


def rolled_out_prompt(module, system_prompt: str | None) -> tuple[list[int], object]:
    """A held-out row of the arithmetic data with `SHOTS` before its question, rolled out by `module`: the
    prompt ids the policy read (padding dropped) and the rollout's turns."""
    data = GSM8KDataModule(
        source="arithmetic", system_prompt=system_prompt, few_shot=SHOTS, arithmetic_size=20, val_size=2
    )
    data.setup("fit")
    batch = {"prompt": [data.val_rows[0]["prompt"]], "answer": [data.val_rows[0]["answer"]]}
    rollout, _, turns = module.rollouts.sample_batch(batch, 2)
    ids, mask = rollout.prompt_ids[0].tolist(), rollout.prompt_mask[0].tolist()  # [P] each
    return [t for t, m in zip(ids, mask, strict=True) if m], turns


def test_an_example_tool_result_is_in_the_prompt_as_the_rollout_appends_one(tiny_model_dir):
    """Where the chat template shows no tools, the rollout appends a result as a user turn of
    `<tool_response>` blocks: the example's `tool` message reaches the policy as exactly those ids, after
    the example's call turn ends, and no `tool` turn of the template's own is left in the prompt."""
    module = tiny_module(tiny_model_dir, module_options={"tools": [calculator]}, max_completion_length=4)
    module.configure_model()  # the policy loaded
    tokenizer = module.tokenizer
    prompt, turns = rolled_out_prompt(module, system_prompt="S")
    appended = tool_suffix_ids(tokenizer, tool_messages([("calculator", "42")], False))
    end_of_call = tokenizer(CALL + "<|im_end|>", add_special_tokens=False)["input_ids"]
    assert contains(prompt, end_of_call + appended)
    assert not contains(prompt, tokenizer("<|im_start|>tool", add_special_tokens=False)["input_ids"])
    assert turns.prompts[0][3] == {"role": "user", "content": "<tool_response>\n42\n</tool_response>"}


def test_a_yaml_text_split_at_its_comma_is_named_with_the_fix(tmp_path, capsys):
    """An unquoted text holding ', ' in a YAML flow mapping splits there, leaving a key without a value:
    the one line says an item holds None and to quote the text (not only "expected null")."""
    config = tmp_path / "shots.yaml"
    config.write_text("data:\n  few_shot:\n    - {role: user, content: Tom has 3, then 4}\n")
    message = one_error_line(
        cli_error(["fit", "--config", "configs/demo_arithmetic.yaml", "--config", str(config)], capsys)
    )
    assert message == (
        "error: data.few_shot: expected a list of dict[str, str] or null; an item inside holds None, not a "
        "string (in YAML, quote a text holding ', ' or ': ')"
    )


def test_an_example_tool_result_stays_the_templates_own_tool_turn_where_it_shows_tools(tiny_model_dir):
    """Where the chat template shows tools, the rollout appends a result as the template renders a `tool`
    message: the example's is kept as it is, and reaches the policy as the ids the rollout appends."""
    module = tiny_module(tiny_model_dir, module_options={"tools": [calculator]}, max_completion_length=4)
    module.configure_model()
    tokenizer = module.tokenizer
    tokenizer.chat_template = TOOLS_TEMPLATE  # the calculator shown in the system turn, tool turns its own
    prompt, turns = rolled_out_prompt(module, system_prompt=None)
    appended = tool_suffix_ids(tokenizer, tool_messages([("calculator", "42")], True))
    end_of_call = tokenizer(CALL + "<|im_end|>", add_special_tokens=False)["input_ids"]
    assert contains(prompt, end_of_call + appended)
    assert turns.prompts[0][:4] == SHOTS


@pytest.mark.parametrize("config", ["demo_arithmetic_calculator.yaml", "gsm8k_calculator_smollm2.yaml"])
def test_a_shipped_configs_worked_exchanges_are_right_and_read_as_the_models_calls(config):
    """Each worked exchange of a shipped config: its call, read as the rollout reads the model's (Hermes,
    SmolLM2's template showing no tools), runs the calculator to the exchange's own result, and its answer is
    that result. A wrong sum or an unreadable call would teach the policy that."""
    path = os.path.join(os.path.dirname(__file__), "..", "configs", config)
    with open(path, encoding="utf-8") as f:
        few_shot = yaml.safe_load(f)["data"]["few_shot"]
    exchanges = [few_shot[i : i + 4] for i in range(0, len(few_shot), 4)]
    assert len(exchanges) == 3
    for question, call, result, answer in exchanges:
        assert [m["role"] for m in (question, call, result, answer)] == [
            "user",
            "assistant",
            "tool",
            "assistant",
        ]
        turn = TOOL_CALL_FORMATS["hermes"].parse(
            call["content"] + "<|im_end|>",
            prompt="<|im_start|>assistant\n",
            schemas=[tool_schema(calculator)],
            eos_token="<|im_end|>",
        )
        [called] = turn.message["tool_calls"]
        assert called["function"]["name"] == result["name"] == "calculator"
        assert calculator(**called["function"]["arguments"]) == result["content"], question["content"]
        assert answer["content"] == f"#### {result['content']}"
