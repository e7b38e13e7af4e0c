"""Tools, environments and rollout functions as a hostile policy or a careless user writes them: every call is
bounded in time, whatever a call does is its result (never an exception or an exit of the trainer), a
signal to the trainer is answered while a tool hangs, and what can never work is refused when the module is
built, in one line naming the tool."""

import ast
import asyncio
import copy
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.generation.multi_turn import ToolRollouts
from grpo_lightning.core.generation.prompts import PromptEncoder
from grpo_lightning.core.tools import calculator as calculator_module
from grpo_lightning.core.tools.calculator import calculator
from grpo_lightning.core.tools.calls import ToolCall, ToolOptions, ToolRunner
from grpo_lightning.core.tools.formats import TOOL_CALL_FORMATS
from grpo_lightning.training.module import GRPOModule
from grpo_lightning.training.tool_rollouts import ToolSampling
from tests.helpers import cli_error, one_error_line, write_rows
from tests.test_interrupt import fit_args
from tests.test_multi_turn import SCRIPTS, ScriptedEngine, settings_of
from tests.test_multi_turn import tokenizer as tokenizer  # noqa: F401  the fixture
from tests.test_tool_rollouts import BuyingEngine, Shop, saw_environments


def never_returns(text: str) -> str:
    """Wait for ever.

    Args:
        text: anything.
    """
    threading.Event().wait()
    return text


async def never_awaited(text: str) -> str:
    """Wait for ever, asynchronously.

    Args:
        text: anything.
    """
    await asyncio.Event().wait()
    return text


async def blocks_its_loop(text: str) -> str:
    """Block the event loop it runs on.

    Args:
        text: anything.
    """
    time.sleep(30)
    return text


def error_of(content: str) -> str:
    """The message of TRL's error result, `str({"error": message})`."""
    return ast.literal_eval(content)["error"]


def results_of(runner: ToolRunner, *calls: ToolCall) -> list[tuple[str, str]]:
    return runner([list(calls)])[0]


def test_a_tool_that_never_returns_is_the_calls_error_after_call_timeout():
    runner = ToolRunner([never_returns, never_awaited, blocks_its_loop], ToolOptions(call_timeout=0.3))
    start = time.perf_counter()
    results = results_of(
        runner,
        ToolCall("never_returns", {"text": "a"}),
        ToolCall("never_awaited", {"text": "b"}),
        ToolCall("blocks_its_loop", {"text": "c"}),
    )
    assert time.perf_counter() - start < 5  # 0.3 s for the sync call, 1.3 s at most for the async ones
    for name, text in results:
        assert "did not return within 0.3 s" in error_of(text), (name, text)
    assert runner.counts.failures == 3


class Interrupted(Exception):
    pass


def test_a_signal_to_the_trainer_is_answered_while_a_tool_hangs():
    """A handler that raises (as a scheduler's SIGTERM handler may) ends the wait at once: the tool's bound
    (60 s here) does not hold the trainer."""

    def interrupt(signum, frame):
        raise Interrupted

    previous = signal.signal(signal.SIGUSR1, interrupt)
    timer = threading.Timer(0.3, lambda: signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1))
    try:
        start = time.perf_counter()
        timer.start()
        with pytest.raises(Interrupted):
            results_of(ToolRunner([never_returns]), ToolCall("never_returns", {"text": "a"}))
        assert time.perf_counter() - start < 3
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, previous)


class Unprintable:
    def __str__(self) -> str:
        raise RuntimeError("no text")


def returns(value: object):
    def tool(text: str) -> object:
        """Return a fixed value.

        Args:
            text: anything.
        """
        return value

    return tool


def raises(error: BaseException):
    def tool(text: str) -> str:
        """Raise.

        Args:
            text: anything.
        """
        raise error

    return tool


def named(tool, name: str):
    tool.__name__ = name
    return tool


def test_whatever_a_call_does_is_its_result_naming_the_tool():
    looped: list = []
    looped.append(looped)
    tools = [
        named(raises(SystemExit(0)), "exits"),
        named(raises(KeyboardInterrupt()), "interrupts"),
        named(raises(RecursionError("deep")), "recurses"),
        named(returns(looped), "self_referencing"),
        named(returns({(1, 2): 3}), "tuple_keys"),
        named(returns(Unprintable()), "unprintable"),
        named(returns("a\udc80b"), "surrogate"),
    ]
    runner = ToolRunner(tools)
    results = dict(results_of(runner, *(ToolCall(t.__name__, {"text": "x"}) for t in tools)))
    assert error_of(results["exits"]) == "0"  # TRL's str(error)
    assert error_of(results["interrupts"]) == ""
    assert error_of(results["recurses"]) == "deep"
    error = error_of(results["self_referencing"])  # a list is the list itself, but not one holding itself
    assert error.startswith("the result of self_referencing cannot be turned into text: ValueError: Circular")
    assert results["tuple_keys"] == "{(1, 2): 3}"
    error = error_of(results["unprintable"])
    assert error == "the result of unprintable cannot be turned into text: RuntimeError: no text"
    assert results["surrogate"] == "a?b"
    results["surrogate"].encode("utf-8")


def test_a_call_nested_thousands_deep_is_no_call_or_a_failed_one():
    deep = "[" * 3000 + "]" * 3000
    runner = ToolRunner([named(returns(1), "tool")])
    for text in (
        f"<tool_call>{deep}</tool_call>",
        f'<tool_call>{{"name": "tool", "arguments": {{"a": {deep}}}}}</tool_call>',
    ):
        parsed = runner.parse(TOOL_CALL_FORMATS["hermes"], text, plain_text=text)
        assert parsed.calls == [] and parsed.message["content"] == text  # TRL's plain turn
    as_string = f'<tool_call>{{"name": "tool", "arguments": "{{\\"a\\": {deep}}}"}}</tool_call>'
    [call] = runner.parse(TOOL_CALL_FORMATS["hermes"], as_string, plain_text=as_string).calls
    assert isinstance(call.arguments, str)  # left as written: the call cannot take it
    [[(_, result)]] = runner([[ToolCall(call.name, call.arguments)]])
    assert "argument after ** must be a mapping, not str" in error_of(result)


def test_a_tool_that_exits_and_a_deep_call_go_through_the_loop_as_results(tokenizer, monkeypatch):  # noqa: F811
    """The whole unit on the scripted model: a `SystemExit(0)` from the tool is a result the next turn
    follows, a call nested 3000 deep is a plain turn that ends its sample, and the process is still here."""
    deep = "[" * 3000 + "]" * 3000
    exiting = '<tool_call>{"name": "exits", "arguments": {"text": "x"}}</tool_call><|im_end|>'
    monkeypatch.setitem(SCRIPTS, "p0", [exiting, "after exit<|im_end|>"])
    monkeypatch.setitem(SCRIPTS, "p1", [f"<tool_call>{deep}</tool_call><|im_end|>", "after deep<|im_end|>"])
    monkeypatch.setitem(SCRIPTS, "p2", ["done<|im_end|>"])
    engine = ScriptedEngine(tokenizer, settings_of(tokenizer, 20000))
    tool = named(raises(SystemExit(0)), "exits")
    rollouts = ToolRollouts(engine, tokenizer, ToolRunner([tool]))
    prompts = [[{"role": "user", "content": name}] for name in SCRIPTS]
    ids, mask = PromptEncoder(tokenizer).encode(prompts, "cpu")
    rollout, turns = rollouts.generate(torch.nn.Linear(1, 1), ids, mask, num_generations=1)
    first, second, _ = turns.messages
    assert first[1]["role"] == "tool" and error_of(first[1]["content"]) == "0"
    assert first[2]["content"] == "after exit"
    assert second == [{"role": "assistant", "content": f"<tool_call>{deep}</tool_call>"}]
    assert turns.counts.calls == 1 and turns.counts.failures == 1


class HangingShop(Shop):
    """A shop whose `reset` hangs on the row whose answer is "0", and whose `get_reward` hangs after buying
    of 5."""

    def reset(self, answer: str, **row) -> str:
        if answer == "0":
            threading.Event().wait()
        return super().reset(answer, **row)

    def get_reward(self) -> float:
        if self.stock == 0 and self.bought == 5:
            threading.Event().wait()
        return super().get_reward()

    def buy(self, n: int) -> str:
        """Buy from the shop.

        Args:
            n: how many
        """
        self.bought = n
        return super().buy(n)


class BrokenShop(Shop):
    def __init__(self) -> None:
        raise KeyError("stock")


def hanging_module(model_dir: str, factory=HangingShop) -> GRPOModule:
    grpo = GRPOConfig(
        num_generations=2,
        max_completion_length=160,
        preflight=False,
        log_completions_every=0,
        tools=ToolOptions(environment_timeout=0.5),
    )
    module = GRPOModule(model_dir, reward_funcs=[saw_environments], grpo=grpo, environment_factory=factory)
    engine = BuyingEngine(module.tokenizer)
    module.rollouts.build_engine = lambda: engine
    module.configure_model()
    return module


def test_an_environment_past_environment_timeout_or_failing_is_named_in_one_line(tiny_model_dir):
    module = hanging_module(tiny_model_dir)
    prompt = [{"role": "user", "content": "Buy them all."}]
    batch = {"prompt": [prompt, prompt], "answer": ["3", "5"]}
    _, _, turns = module.rollouts.sample_batch(batch, 2)
    reward = next(r for r in module.rollouts.multi_turn.rewards if r.__name__ == "HangingShop")
    start = time.perf_counter()
    with pytest.warns(UserWarning, match=r"HangingShop.get_reward did not return within 0.5 s"):
        assert reward(environments=turns.environments) == [1.0, 1.0, None, None]
    assert time.perf_counter() - start < 5
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"^HangingShop.reset\(\*\*row\) did not return within 0.5 s"):
        module.rollouts.sample_batch({"prompt": [prompt], "answer": ["0"]}, 2)
    assert time.perf_counter() - start < 5
    with pytest.raises(RuntimeError, match=r"^environment_factory BrokenShop\(\) raised KeyError: 'stock'$"):
        hanging_module(tiny_model_dir, BrokenShop)


def test_a_rollout_func_that_raises_is_named(tiny_model_dir):
    def my_rollout(prompts, module):
        raise KeyError("prompt_ids")

    grpo = GRPOConfig(num_generations=2, max_completion_length=16, preflight=False, log_completions_every=0)
    module = GRPOModule(tiny_model_dir, reward_funcs=[saw_environments], grpo=grpo, rollout_func=my_rollout)
    module.configure_model()
    prompt = [{"role": "user", "content": "x"}]
    with pytest.raises(RuntimeError, match=r"^rollout_func .*my_rollout raised KeyError: 'prompt_ids'$"):
        module.rollouts.sample_batch({"prompt": [prompt], "answer": ["1"]}, 2)


COSTLY = [
    "round(1, -10**15)",  # CPython builds 10**(10**15) before any size bound sees a value
    "round(10**15, -999999999999999)",
    "round(7, 10**15)",
    "round(2.5, 0.5)",
    "1 << 10**15",
    "10**15 >> 1",
    "factorial(10**6)",
    "'a' * 10**15",
    "[1] * 10**15",
    "9**9**9",
    "2 ** 0.5 ** -100",
    "(" * 250 + "1" + ")" * 250,
]


@pytest.mark.parametrize("expression", COSTLY)
def test_the_calculator_bounds_every_operations_cost_before_it_runs(expression):
    """Each refused at once, in a process of its own so that a hang fails the test instead of holding it."""
    script = (
        "import sys, time\nfrom grpo_lightning.core.tools.calculator import evaluate_arithmetic\n"
        "start = time.perf_counter()\ntry:\n    evaluate_arithmetic(sys.argv[1])\nexcept ValueError as e:\n"
        "    print('refused', time.perf_counter() - start, e)"
    )
    run = subprocess.run(
        [sys.executable, "-c", script, expression], capture_output=True, text=True, timeout=30, check=False
    )
    said = run.stdout.split(maxsplit=2)
    assert said[:1] == ["refused"] and float(said[1]) < 0.05, (run.stdout, run.stderr[-300:])


def test_a_runaway_evaluation_is_stopped_and_the_calculator_goes_on(monkeypatch):
    """An evaluation that never answers (its process stopped, as a runaway holding the CPU would be) is
    the call's error after EVALUATION_SECONDS; the next call gets a fresh process."""
    monkeypatch.setattr(calculator_module, "EVALUATION_SECONDS", 0.5)
    assert calculator("6*7") == "42"
    process = calculator_module._EVALUATOR.process
    os.kill(process.pid, signal.SIGSTOP)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"took more than 0.5 s to evaluate"):
        calculator("1+1")
    assert time.perf_counter() - start < 3 and process.poll() is not None  # killed
    assert calculator("2+2") == "4" and calculator_module._EVALUATOR.process is not process


def star_args(*args: str) -> str:
    """Join.

    Args:
        args: the parts
    """
    return "".join(args)


def positional_only(a: int, /) -> int:
    """Echo.

    Args:
        a: a number
    """
    return a


def no_docstring(a: int) -> int:
    return a


def no_hint(a) -> int:
    """Echo.

    Args:
        a: a number
    """
    return a


def buy(n: int) -> str:
    """Buy elsewhere.

    Args:
        n: how many
    """
    return "bought"


class UndocumentedShop(Shop):
    def sell(self, n: int) -> str:
        return "sold"


@pytest.mark.parametrize(
    ("tools", "environment_factory", "said"),
    [
        ([star_args], None, r"tools\[0\] \('star_args'\) takes \*args, which a call cannot fill"),
        ([positional_only], None, r"tools\[0\] \('positional_only'\) takes a positional-only"),
        ([calculator, Shop], None, r"tools\[1\] \('Shop'\) is a class, not a function"),
        (
            ["tests.test_tool_rollouts.Shop.buy"],
            None,
            r"tools\[0\] \('buy'\) is the method Shop.buy taken from",
        ),
        ([lambda expression: expression], None, r"tools\[0\] \('<lambda>'\) is a lambda"),
        ([no_docstring], None, r"tools\[0\]: tool 'no_docstring' has no JSON schema"),
        ([no_hint], None, r"tools\[0\]: tool 'no_hint' has no JSON schema"),
        ([calculator, calculator], None, r"two tools are named 'calculator' \(tools\[0\], tools\[1\]\)"),
        ([buy], Shop, r"two tools are named 'buy' \(tools\[0\], environment_factory Shop's method buy\)"),
        (
            None,
            UndocumentedShop,
            r"environment_factory UndocumentedShop's method sell: tool 'sell' has no JSON",
        ),
    ],
)
def test_tools_that_can_never_be_called_are_refused_when_the_module_is_built(
    tiny_model_dir, tools, environment_factory, said
):
    grpo = GRPOConfig(num_generations=2, max_completion_length=16, preflight=False, log_completions_every=0)
    with pytest.raises(ValueError, match=f"^{said}") as refused:
        GRPOModule(
            tiny_model_dir,
            reward_funcs=[saw_environments],
            grpo=grpo,
            tools=tools,
            environment_factory=environment_factory,
        )
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    ("given", "option"),
    [
        ("--model.tools=[grpo_lightning.core.tools.calculator.calculator]", "model.tools"),
        ("--model.environment_factory=tests.test_tool_rollouts.Shop", "model.environment_factory"),
    ],
)
def test_tools_on_text_prompts_are_refused_before_any_weights_load(
    tiny_model_dir, tmp_path, capsys, no_weights, given, option
):
    source = write_rows(tmp_path / "rows.jsonl", [{"prompt": "2 + 3?", "answer": "5"}] * 6)  # TRL's text
    data = ["--data=grpo_lightning.training.data.PromptDataModule", f"--data.source={source}"]
    said = one_error_line(cli_error(fit_args(tiny_model_dir, str(tmp_path), 1, *data, given), capsys))
    assert said.startswith(f"error: {option} needs chat prompts (lists of messages), and data.source's")
    assert "data.chat_prompt: true" in said


def returning(**fields):
    """A rollout_func returning one prompt [5, 6] and one completion [7, 8] per sample, `fields` replacing
    any of its lists (given for the first sample; the others keep the valid ones)."""

    def rollout_func(prompts, module):
        output = {
            "prompt_ids": [[5, 6]] * len(prompts),
            "completion_ids": [[7, 8]] * len(prompts),
            "logprobs": [[-0.5, -0.5]] * len(prompts),
            "env_mask": [[1, 1]] * len(prompts),
        }
        for key, first in fields.items():
            output[key] = [first] + output[key][1:]
        return output

    return rollout_func


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        (
            {"completion_ids": [7, 10**6]},
            r"completion_ids\[0\] holds the id 1000000, past the model's vocabulary",
        ),
        (
            {"completion_ids": [7, "VOCAB"]},
            r"completion_ids\[0\] holds the id \d+, past the model's vocabulary",
        ),
        ({"prompt_ids": [-1, 6]}, r"prompt_ids\[0\] holds the id -1: token ids are not negative"),
        ({"completion_ids": [7.9, 8.2]}, r"completion_ids\[0\] holds torch.float32 values, not integers"),
        ({"env_mask": [1, 2]}, r"env_mask\[0\] holds 2: env_mask is 1 on the policy's tokens and 0"),
        ({"env_mask": [-1, 1]}, r"env_mask\[0\] holds -1"),
        ({"env_mask": [0.5, 1]}, r"env_mask\[0\] holds torch.float32 values, not integers"),
        ({"logprobs": [float("nan"), -1.0]}, r"logprobs\[0\] holds a value that is not a finite number"),
        ({"completion_ids": [7, None]}, r"completion_ids\[0\] is not a list of numbers"),
    ],
)
def test_a_rollout_funcs_ids_and_masks_are_checked_before_any_forward_pass(tiny_model_dir, fields, said):
    grpo = GRPOConfig(num_generations=2, max_completion_length=16, preflight=False, log_completions_every=0)
    module = GRPOModule(tiny_model_dir, reward_funcs=[saw_environments], grpo=grpo, rollout_func=returning())
    module.configure_model()
    vocab = module.policy.get_input_embeddings().num_embeddings
    fields = {k: [vocab if v == "VOCAB" else v for v in values] for k, values in fields.items()}
    assert isinstance(module.rollouts.multi_turn, ToolSampling)
    module.rollouts.multi_turn.rollout_func = returning(**fields)
    forward = []
    module.policy.register_forward_hook(lambda *args: forward.append(1))
    prompt = [{"role": "user", "content": "x"}]
    with pytest.raises(ValueError, match=f"^rollout_func's {said}") as refused:
        module.rollouts.sample_batch({"prompt": [prompt], "answer": ["1"]}, 2)
    assert "\n" not in str(refused.value) and forward == []
    module.rollouts.multi_turn.rollout_func = returning()
    rollout, _, _ = module.rollouts.sample_batch({"prompt": [prompt], "answer": ["1"]}, 2)
    assert rollout.completion_ids.tolist() == [[7, 8], [7, 8]]  # the valid lists pass


def test_a_result_the_chat_template_refuses_is_rendered_as_an_error(tokenizer, monkeypatch):  # noqa: F811
    """A template that raises on a result's text: the tool turn is rendered with the result replaced by an
    error naming the tool, and the sample goes on."""
    refusing = copy.copy(tokenizer)
    refusing.chat_template = (
        "{%- for m in messages %}{%- if m.role == 'tool' and 'BOOM' in m.content %}"
        "{{ raise_exception('refused') }}{%- endif %}{%- endfor %}" + tokenizer.chat_template
    )
    calling = '<tool_call>{"name": "booms", "arguments": {"text": "x"}}</tool_call><|im_end|>'
    monkeypatch.setitem(SCRIPTS, "p0", [calling, "after<|im_end|>"])
    monkeypatch.setitem(SCRIPTS, "p1", ["done<|im_end|>"])
    monkeypatch.setitem(SCRIPTS, "p2", ["done<|im_end|>"])
    engine = ScriptedEngine(refusing, settings_of(refusing, 2000))
    rollouts = ToolRollouts(engine, refusing, ToolRunner([named(returns("BOOM"), "booms")]))
    prompts = [[{"role": "user", "content": name}] for name in SCRIPTS]
    ids, mask = PromptEncoder(refusing).encode(prompts, "cpu")
    _, turns = rollouts.generate(torch.nn.Linear(1, 1), ids, mask, num_generations=1)
    first = turns.messages[0]
    error = error_of(first[1]["content"])
    assert error == "the chat template cannot render the result of booms: TemplateError: refused"
    assert first[2]["content"] == "after" and turns.counts.failures == 1
