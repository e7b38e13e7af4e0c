"""Which system prompt makes SmolLM2-135M-Instruct use the calculator before any training? For each prompt
in `PROMPTS`, 32 sampled answers (temperature 0.7) to the arithmetic task's problems through the training
loop's own multi-turn rollouts (`ToolRollouts` on the eager engine, the calculator described in a Hermes
system prompt after the candidate's text, as the demo renders it): how many answers call the calculator, how
many of those write the right `#### N` after the calculator's result, and how many are right at all.

    python benchmarks/tool_prompt_probe.py --prompts oneshot,first_reply --max_new_tokens 96
"""

from __future__ import annotations

import argparse
import json
import re
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_lightning.core.generation.engines import EagerEngine
from grpo_lightning.core.generation.multi_turn import ToolRollouts
from grpo_lightning.core.generation.prompts import PromptEncoder
from grpo_lightning.core.generation.sampling import SamplingSettings
from grpo_lightning.core.tools.calculator import calculator
from grpo_lightning.core.tools.calls import ToolOptions, ToolRunner
from grpo_lightning.core.tools.schemas import hermes_system_prompt, tool_schema, with_tools_in_system_prompt
from grpo_lightning.io.arithmetic_task import arithmetic_problems

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call>'
ANSWER_RULE = "On the last line, write only the final answer as '#### <number>'."
PROMPTS = {
    "plain": f"Solve the math problem step by step. {ANSWER_RULE}",
    "oneshot": (
        "Solve the math problem. First call the calculator, then answer from its result.\n\n"
        "Example.\nUser: Tom has 3 apples and gets 4 more. How many apples does Tom have now?\n"
        f"Assistant: {CALL % '3 + 4'}\nTool: 7\nAssistant: Tom has 7 apples.\n#### 7\n\n{ANSWER_RULE}"
    ),
    "first_reply": (
        "Solve the math problem with the calculator. Your reply must start with <tool_call>.\n"
        f"Examples of a first reply:\n{CALL % '3 + 4'}\n{CALL % '12 - 5'}\n{CALL % '6 * 7'}\n"
        f"{CALL % '20 / 4'}\n{ANSWER_RULE}"
    ),
    # Both turns shown, the answer line tied to the result: "#### " followed by the number the tool returned.
    "two_turns": (
        "You solve math problems with a calculator, in two replies.\n"
        f"First reply: only a calculator call, e.g. {CALL % '3 + 4'}\n"
        "Then you get the result in <tool_response>. Second reply: only '#### ' and that result, "
        "e.g. #### 7"
    ),
    "two_turns_copy": (
        "You solve math problems with a calculator, in two replies.\n"
        f"First reply: only a calculator call, e.g. {CALL % '3 + 4'}\n"
        "After it you read <tool_response>\n7\n</tool_response>. Second reply: copy the number from "
        "<tool_response> after '#### ', e.g.\n#### 7"
    ),
    # The known 29/32 first replies, plus what to do once the result is back.
    "first_reply_then_answer": (
        "Solve the math problem with the calculator. Your first reply must start with <tool_call>.\n"
        f"Examples of a first reply:\n{CALL % '3 + 4'}\n{CALL % '12 - 5'}\n{CALL % '6 * 7'}\n"
        f"{CALL % '20 / 4'}\nWhen you get the result in <tool_response>, do not call again: reply with "
        "only '#### ' and the result, e.g. #### 7"
    ),
    # The instruction after the question, in the user's turn (a data module's `prompt_template`), so that
    # it is the last thing the model reads: in the system turn the calculator's description comes after it.
    "user_first_reply": (
        "Solve the math problem with the calculator.",
        "\n\nYour reply must start with <tool_call>. Examples of a first reply:\n"
        f"{CALL % '3 + 4'}\n{CALL % '12 - 5'}\n{CALL % '6 * 7'}",
    ),
    "user_then_answer": (
        "Solve the math problem with the calculator.",
        "\n\nYour first reply must start with <tool_call>. Examples of a first reply:\n"
        f"{CALL % '3 + 4'}\n{CALL % '12 - 5'}\n{CALL % '6 * 7'}\nWhen you get the result in "
        "<tool_response>, do not call again: reply with only '#### ' and the result, e.g. #### 7",
    ),
}


def messages_of(name: str, question: str) -> list[dict]:
    """A prompt's system turn and user turn: `PROMPTS[name]` is the system text, or (system text, what
    follows the question in the user's turn)."""
    system, after = (PROMPTS[name], "") if isinstance(PROMPTS[name], str) else PROMPTS[name]
    return [{"role": "system", "content": system}, {"role": "user", "content": question + after}]


def rendered(name: str, question: str, schemas: list[dict]) -> list[dict]:
    """The prompt as the demo renders it: the calculator's description after the system text. With
    "tools_first:" before the name, before it instead, so that the instruction is the system turn's last
    words (a chat template that shows tools puts them there)."""
    if not name.startswith("tools_first:"):
        return with_tools_in_system_prompt(messages_of(name, question), schemas)
    system, user = messages_of(name.removeprefix("tools_first:"), question)
    return [{"role": "system", "content": f"{hermes_system_prompt(schemas)}\n\n{system['content']}"}, user]


def probe(name: str, model, tokenizer, problems: list[dict], max_new_tokens: int, group: int) -> dict:
    schemas = [tool_schema(calculator)]
    prompts = [rendered(name, p["question"], schemas) for p in problems]
    settings = SamplingSettings(
        max_new_tokens=max_new_tokens,
        eos_token_ids=(tokenizer.eos_token_id,),
        pad_token_id=tokenizer.pad_token_id,
        temperature=0.7,
        share_prompt=True,  # one prefill of each long prompt for its group
    )
    runner = ToolRunner([calculator], ToolOptions(max_calling_iterations=2, max_response_length=64))
    loop = ToolRollouts(EagerEngine(settings), tokenizer, runner)
    ids, mask = PromptEncoder(tokenizer).encode(prompts, "cpu")
    torch.manual_seed(0)
    started = time.perf_counter()
    _, turns = loop.generate(model, ids, mask, num_generations=group)
    seconds = time.perf_counter() - started
    calls = right_after = right = 0
    examples = []
    rows = [problem for problem in problems for _ in range(group)]
    for problem, messages in zip(rows, turns.messages, strict=True):
        answer = problem["answer"].split("####")[-1].strip()
        called = any(m.get("tool_calls") for m in messages)
        results = [i for i, m in enumerate(messages) if m["role"] == "tool"]
        after = " ".join(m["content"] or "" for m in messages[results[-1] + 1 :]) if results else ""
        said = re.findall(r"####\s*(-?[\d.,]+)", " ".join(str(m.get("content") or "") for m in messages))
        calls += called
        right_after += bool(results) and answer in re.findall(r"####\s*(-?\d+)", after)
        right += bool(said) and said[-1].rstrip(".").replace(",", "") == answer
        if len(examples) < 2:
            examples.append(messages)
    return {
        "prompt": name,
        "samples": len(rows),
        "calls": calls,
        "right_after_result": right_after,
        "right": right,
        "seconds": round(seconds, 1),
        "examples": examples,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="models/smollm2-135m-instruct")
    parser.add_argument("--prompts", default=",".join(PROMPTS))
    parser.add_argument("--problems", type=int, default=8)
    parser.add_argument("--group", type=int, default=4, help="answers sampled per problem")
    parser.add_argument("--max_new_tokens", type=int, default=96)
    parser.add_argument("--examples", action="store_true", help="print two transcripts per prompt")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    problems = arithmetic_problems(args.problems, seed=1)
    for name in args.prompts.split(","):
        result = probe(name, model, tokenizer, problems, args.max_new_tokens, args.group)
        examples = result.pop("examples")
        print(json.dumps(result), flush=True)
        if args.examples:
            for messages in examples:
                print("   ", json.dumps(messages)[:600], flush=True)


if __name__ == "__main__":
    main()
