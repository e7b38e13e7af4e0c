"""A model that calls a tool, built offline: a causal LM taught, on one conversation, to ask the calculator
for 6*7 and then answer 42 from its result. Random or small instruct models never call a tool unprompted, so
tests and benchmarks of the multi-turn loop start from this one, whose every sample makes a call.

The conversation is laid out token in, token out, as the loop builds it: the prompt, the model's call turn,
the tool result's ids (`tool_suffix_ids`: the separator, the result, the next assistant header) and the
answer turn. Only the model's two turns are labels.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo_lightning.core.tools.calculator import calculator
from grpo_lightning.core.tools.schemas import tool_schema
from grpo_lightning.core.tools.turns import tool_messages, tool_suffix_ids
from grpo_lightning.offline.tiny import CHATML_TEMPLATE

# A ChatML template that shows the tools (name and description) in a short system turn and an assistant
# turn's calls as Hermes blocks: a whole tool exchange, as TRL requires of a template it runs tools with.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}"
    "{{ t.function.name }}: {{ t.function.description }}\n{% endfor %}<|im_end|>\n{% endif %}"
    + CHATML_TEMPLATE.replace(
        "{{ message['content'] }}",
        "{{ message['content'] }}{% if message.tool_calls is defined %}{% for call in message.tool_calls %}"
        "<tool_call>\n{{ call.function | tojson }}\n</tool_call>{% endfor %}{% endif %}",
    )
)
QUESTION = [{"role": "user", "content": "What is 6 times 7?"}]
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call><|im_end|>'
ANSWER = "The answer is 42.<|im_end|>"


def teach_tool_call(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, steps: int = 120, lr: float = 3e-3
) -> None:
    """Fit `model` in place (`steps` AdamW steps at `lr`) to the conversation `QUESTION` -> `CALL` -> the
    calculator's result -> `ANSWER`; `tokenizer` gets `TOOLS_TEMPLATE` as its chat template."""
    tokenizer.chat_template = TOOLS_TEMPLATE
    prompt = tokenizer.apply_chat_template(
        QUESTION, tools=[tool_schema(calculator)], add_generation_prompt=True, return_dict=False
    )
    call, answer = (tokenizer(text, add_special_tokens=False)["input_ids"] for text in (CALL, ANSWER))
    result = tool_suffix_ids(tokenizer, tool_messages([("calculator", "42")], True))
    ids = torch.tensor([prompt + call + result + answer])  # [1, L]
    labels = ids.clone()  # the model's turns only
    labels[0, : len(prompt)] = -100
    labels[0, len(prompt) + len(call) : len(prompt) + len(call) + len(result)] = -100
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(steps):
        optimizer.zero_grad()
        model(ids, labels=labels).loss.backward()
        optimizer.step()
