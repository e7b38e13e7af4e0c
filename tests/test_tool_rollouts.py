"""TRL's multi-turn entry points on `GRPOModule` (`training/tool_rollouts.py`): a `rollout_func` whose
`env_mask` keeps its tokens out of the loss (black-box: the loss and gradients of one training step), its
extra fields reaching the rewards; `environment_factory` (one instance per sample, `reset`, methods as
tools, `get_reward` as a reward) over a scripted engine; `tools` as import paths from the CLI."""

import copy
import json
import re
import warnings

import lightning as L
import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_lightning.cli import build_cli
from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.generation.engines import RolloutEngine
from grpo_lightning.core.generation.sampling import SamplingSettings
from grpo_lightning.core.rewards.verifiable import completion_text
from grpo_lightning.core.tools.calculator import calculator
from grpo_lightning.core.types import Rollout
from grpo_lightning.demo.heldout import heldout_correct
from grpo_lightning.offline.tool_caller import QUESTION, teach_tool_call
from grpo_lightning.training.callbacks.results_writer import ValidationResultsWriter
from grpo_lightning.training.data import PromptDataModule
from grpo_lightning.training.module import GRPOModule
from grpo_lightning.training.rollout_lists import rollout_of_lists
from tests.helpers import quiet_trainer

TAIL = 3  # the tokens that end every scripted completion, which the rollout function may mark as not ours


def given_score(completions, score, **kwargs):
    """The reward a rollout function hands over in its `score` field: independent of the tokens."""
    return list(score)


def scripted_rollout(tail: list[int], env: int):
    """A rollout function: each sample's completion is a few body tokens of its own (by row), then `tail`
    and the end-of-sequence id, those last `TAIL` tokens marked `env_mask = env`."""

    def rollout_func(prompts, module):
        tok = module.tokenizer
        prompt_ids = [
            tok.apply_chat_template(p, add_generation_prompt=True, return_dict=False) for p in prompts
        ]
        body = tok("The answer is 12 and 3", add_special_tokens=False)["input_ids"]
        completions = [body[: 3 + row % 4] + tail + [tok.eos_token_id] for row in range(len(prompts))]
        return {
            "prompt_ids": [list(ids) for ids in prompt_ids],
            "completion_ids": completions,
            "logprobs": [[-1.0] * len(c) for c in completions],
            "env_mask": [[1] * (len(c) - TAIL) + [env] * TAIL for c in completions],
            "score": [float(row % 3) for row in range(len(prompts))],
        }

    return rollout_func


class Gradients(L.Callback):
    """The policy's gradients at the step's optimizer step, and the step's logged loss."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads = {n: p.grad.clone() for n, p in pl_module.policy.named_parameters() if p.grad is not None}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.loss = float(trainer.callback_metrics["train/loss"])


def one_step(model_dir: str, tail: list[int], env: int) -> Gradients:
    torch.manual_seed(0)
    # An entropy bonus: the loss's value, not only its gradient, reads the tokens' distributions (with one
    # optimizer step per rollout the clipped term's value is the advantages' alone).
    options = dict(num_generations=4, max_completion_length=32, entropy_coef=0.01)
    grpo = GRPOConfig(**options, preflight=False, log_completions_every=0)
    module = GRPOModule(
        model_dir, reward_funcs=[given_score], grpo=grpo, rollout_func=scripted_rollout(tail, env)
    )
    data = [{"prompt": [{"role": "user", "content": "What is 4 times 3?"}], "answer": "12"}] * 2
    grads = Gradients()
    trainer = quiet_trainer(max_steps=1, callbacks=[grads], limit_val_batches=0)
    trainer.fit(module, train_dataloaders=loader_of(data))
    return grads


def _collate(rows: list[dict]) -> dict[str, list]:
    return {key: [row[key] for row in rows] for key in rows[0]}


def test_tokens_marked_env_mask_0_change_neither_the_loss_nor_the_gradients(tiny_model_dir):
    first, second = [30, 31], [200, 201]  # then the end-of-sequence id: the last TAIL tokens
    masked = one_step(tiny_model_dir, first, env=0), one_step(tiny_model_dir, second, env=0)
    assert masked[0].grads and masked[0].loss == pytest.approx(masked[1].loss, abs=0)
    for name, grad in masked[0].grads.items():
        assert torch.equal(grad, masked[1].grads[name]), name
    counted = one_step(tiny_model_dir, first, env=1), one_step(tiny_model_dir, second, env=1)
    assert counted[0].loss != counted[1].loss
    assert any(not torch.equal(g, counted[1].grads[n]) for n, g in counted[0].grads.items())


def test_a_rollout_functions_lists_become_a_padded_rollout():
    rollout = rollout_of_lists(
        [[5, 6], [7]],
        [[1, 2, 9], [3]],
        [[-0.5, -0.5, -0.5], [-1.0]],
        [[1, 0, 1], [1]],
        rows=2,
        pad_token_id=0,
        eos_token_ids=[9],
    )
    assert rollout.prompt_ids.tolist() == [[5, 6], [0, 7]] and rollout.prompt_mask.tolist() == [
        [1, 1],
        [0, 1],
    ]
    assert rollout.completion_ids.tolist() == [[1, 2, 9], [3, 0, 0]]
    assert rollout.model_mask.tolist() == [[1, 0, 1], [1, 0, 0]]
    assert rollout.truncated.tolist() == [False, True]
    with pytest.raises(ValueError, match=r"logprobs\[1\] has 2 values for 1 completion ids"):
        rollout_of_lists(
            [[5], [7]], [[1], [3]], [[0.0], [0.0, 0.0]], None, rows=2, pad_token_id=0, eos_token_ids=[9]
        )
    with pytest.raises(ValueError, match="returned 1 prompt_ids for 2 samples"):
        rollout_of_lists([[5]], [[1], [3]], None, None, rows=2, pad_token_id=0, eos_token_ids=[9])


class Shop:
    """An environment: the row's answer is its stock; buying empties it; empty is a reward of 1."""

    def __init__(self) -> None:
        self.stock = 0

    def reset(self, answer: str, **row) -> str:
        self.stock = int(answer)
        return f" (stock {self.stock})"

    def buy(self, n: int) -> str:
        """Buy from the shop.

        Args:
            n: how many
        """
        self.stock -= n
        return f"left {self.stock}"

    def get_reward(self) -> float:
        return float(self.stock == 0)


class Bank:
    """Another environment, without a reward of its own and with other tools."""

    def reset(self, **row) -> None:
        return None

    def deposit(self, n: int) -> str:
        """Deposit money.

        Args:
            n: how much
        """
        return "ok"


class BuyingEngine(RolloutEngine):
    """A `RolloutEngine` whose model buys the whole stock its prompt shows, then says it is done; it keeps
    every context it was given."""

    def __init__(self, tokenizer, max_new_tokens: int = 160) -> None:
        self.tokenizer, self.contexts = tokenizer, []
        eos = (tokenizer.eos_token_id,)
        self.settings = SamplingSettings(max_new_tokens=max_new_tokens, eos_token_ids=eos, pad_token_id=0)

    def turn(self, context: str) -> str:
        if "<tool_response>" in context:
            return "Done.<|im_end|>"
        stock = re.search(r"\(stock (\d+)\)", context).group(1)
        return f'<tool_call>{{"name": "buy", "arguments": {{"n": {stock}}}}}</tool_call><|im_end|>'

    def generate(self, model, prompt_ids, prompt_mask, *, num_generations, do_sample=True, settings=None):
        s = settings or self.settings
        prompt_ids = prompt_ids.repeat_interleave(num_generations, 0)  # [B, P]
        prompt_mask = prompt_mask.repeat_interleave(num_generations, 0)
        turns = []
        for ids, mask in zip(prompt_ids, prompt_mask, strict=True):
            context = self.tokenizer.decode(ids[mask.bool()])
            self.contexts.append(context)
            turns.append(self.tokenizer(self.turn(context), add_special_tokens=False)["input_ids"])
        ids = torch.full((len(turns), max(map(len, turns))), s.pad_token_id)  # [B, T]
        mask = torch.zeros_like(ids)
        for row, turn in enumerate(turns):
            ids[row, : len(turn)], mask[row, : len(turn)] = torch.tensor(turn), 1
        return Rollout(prompt_ids, prompt_mask, ids, mask, torch.zeros(len(turns), dtype=torch.bool))

    def weights_changed(self) -> None: ...
    def refresh(self, model, device) -> None: ...
    def metrics(self) -> dict:
        return {}


SEEN = {}  # what the reward function below was handed, by keyword


def saw_environments(completions, environments, **kwargs):
    SEEN.update(completions=completions, environments=environments, prompts=kwargs["prompts"])
    return [0.0] * len(completions)


def shop_module(model_dir: str, factory, engine_holder: list) -> GRPOModule:
    grpo = GRPOConfig(num_generations=2, max_completion_length=160, preflight=False, log_completions_every=0)
    module = GRPOModule(model_dir, reward_funcs=[saw_environments], grpo=grpo, environment_factory=factory)
    engine = BuyingEngine(module.tokenizer)
    module.rollouts.build_engine = lambda: engine  # the scripted model samples every rollout
    engine_holder.append(engine)
    return module


def test_environment_factory_one_instance_per_sample_reset_with_its_row(tiny_model_dir):
    holder = []
    module = shop_module(tiny_model_dir, Shop, holder)
    assert module.reward_names == ["saw_environments", "Shop"]  # get_reward: a reward of its own
    prompts = [[{"role": "user", "content": "Buy them all."}]] * 2
    data = [{"prompt": p, "answer": a} for p, a in zip(prompts, ["3", "5"], strict=True)]
    metrics = Metrics()
    trainer = quiet_trainer(max_steps=1, callbacks=[metrics], limit_val_batches=0)
    trainer.fit(module, train_dataloaders=loader_of(data))
    environments = SEEN["environments"]
    assert len({id(e) for e in environments}) == 4 and all(e.stock == 0 for e in environments)
    assert [p[-1]["content"] for p in SEEN["prompts"]] == ["Buy them all. (stock 3)"] * 2 + [
        "Buy them all. (stock 5)"
    ] * 2
    call = {"type": "function", "function": {"name": "buy", "arguments": {"n": 5}}}
    assert SEEN["completions"][2] == [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "buy", "content": "left 0"},
        {"role": "assistant", "content": "Done."},
    ]
    # The template shows no tools: they are described in a Hermes system prompt, the environment's method.
    assert '"name": "buy"' in holder[0].contexts[0] and "<tools>" in holder[0].contexts[0]
    assert metrics.logged["train/rewards/Shop"] == 1.0
    assert metrics.logged["train/tools/call_frequency"] == 1.0
    assert torch.isfinite(torch.tensor(metrics.logged["train/loss"]))


def test_a_dict_of_environments_routes_each_row_by_its_environment_column(tiny_model_dir):
    holder = []
    module = shop_module(tiny_model_dir, {"shop": Shop, "bank": Bank}, holder)
    assert module.reward_names == ["saw_environments", "Shop"]
    prompt = [{"role": "user", "content": "Buy (stock 2)."}]
    batch = {"prompt": [prompt, prompt], "answer": ["2", "2"], "environment": ["shop", "bank"]}
    module.configure_model()  # the weights, as `fit` loads them
    rollout, _, turns = module.rollouts.sample_batch(batch, 2)
    assert [type(e) for e in turns.environments] == [Shop, Shop, Bank, Bank]
    assert "buy" in holder[0].contexts[0] and "deposit" not in holder[0].contexts[0]
    assert "deposit" in holder[0].contexts[2] and "buy" not in holder[0].contexts[2]
    assert (
        turns.messages[2][1]["content"] == "{'error': 'Tool buy not found.'}"
    )  # the bank has none: TRL's error
    assert turns.metrics == {"tools/call_frequency": 1.0, "tools/failure_frequency": 0.5}
    assert bool((rollout.model_mask < rollout.completion_mask).any())  # the results are not the model's
    with pytest.raises(ValueError, match="'environment' column"):
        module.rollouts.sample_batch({"prompt": [prompt], "answer": ["2"]}, 2)


class Metrics(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.logged = {k: float(v) for k, v in trainer.callback_metrics.items()}


def loader_of(rows: list[dict]) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(rows, batch_size=len(rows), collate_fn=_collate)


@pytest.fixture(scope="module")
def calling_model(tiny_model_dir):
    """The tiny model taught (`teach_tool_call`: 120 AdamW steps on one conversation) to call the calculator
    for 6*7, then answer 42 from its result; the tokenizer's template shows tools."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    teach_tool_call(model, tokenizer)
    return model, tokenizer


def answered_42(completions, **kwargs):
    return [float("42" in completion_text(c)) for c in completions]


class Trajectories(L.Callback):
    """The trajectory of each training step (what the loss reads), and the step's logged metrics."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        build = pl_module.update.trajectory

        def recorded(*args, **kwargs):
            self.trajectory = build(*args, **kwargs)
            return self.trajectory

        pl_module.update.trajectory = recorded

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.logged = {k: float(v) for k, v in trainer.callback_metrics.items()}


@pytest.mark.parametrize("backend", ["eager", "static"])
def test_a_scripted_tool_call_trains_with_its_result_out_of_the_loss(calling_model, backend, tmp_path):
    model, tokenizer = calling_model
    options = dict(num_generations=2, max_completion_length=128, temperature=0.3, learning_rate=1e-4)
    grpo = GRPOConfig(**options, generation_backend=backend, preflight=False, log_completions_every=0)
    module = GRPOModule(
        copy.deepcopy(model), tokenizer, reward_funcs=[answered_42], grpo=grpo, tools=[calculator]
    )
    rows = [{"prompt": QUESTION, "answer": "42"}] * 3
    data = PromptDataModule(source=Dataset.from_list(rows), batch_size=2, val_size=1, val_batch_size=1)
    record, results = Trajectories(), ValidationResultsWriter(str(tmp_path / "val.jsonl"), overwrite=True)
    trainer = quiet_trainer(max_steps=1, callbacks=[record, results], num_sanity_val_steps=0)
    trainer.fit(module, data)
    trajectory, logged = record.trajectory, record.logged
    rollout = trajectory.rollout
    assert "42" in trajectory.completions[0] and logged["train/tools/call_frequency"] >= 1
    tool_tokens = rollout.completion_mask.bool() & ~rollout.tool_mask.bool()  # [B, T]
    assert tool_tokens.any(dim=1).all(), "every sample has a tool turn"
    assert torch.equal(trajectory.loss_mask, rollout.model_mask.float())  # the tool turn is out of the loss
    assert torch.isfinite(torch.tensor(logged["train/loss"]))
    assert logged["train/completion_length"] == float(rollout.model_mask.sum(1).float().mean())
    trainer.validate(module, data)  # greedy, through the same loop: each transcript written
    [line] = (tmp_path / "val.jsonl").read_text().splitlines()
    transcript = json.loads(line)["transcript"]
    assert [m["role"] for m in transcript] == ["assistant", "tool", "assistant"]
    assert transcript[0]["tool_calls"][0]["function"] == {
        "name": "calculator",
        "arguments": {"expression": "6*7"},
    }
    assert transcript[1]["content"] == "42" and transcript[2]["content"] == "The answer is 42."
    assert json.loads(line)["correct"] is True


def test_tool_options_without_tools_are_warned_naming_what_reads_them(tiny_model_dir):
    grpo = GRPOConfig(max_tool_calling_iterations=2, preflight=False)
    said = "GRPOConfig.tools.max_calling_iterations=2 has no effect without tools or environment_factory"
    for entry in ({}, {"rollout_func": scripted_rollout([30], env=1)}):  # a rollout_func samples itself
        with pytest.warns(UserWarning, match=f"^{re.escape(said)}$"):
            GRPOModule(tiny_model_dir, reward_funcs=[given_score], grpo=grpo, **entry)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module = GRPOModule(tiny_model_dir, reward_funcs=[given_score], grpo=grpo, tools=[calculator])
    assert module.rollouts.multi_turn.options.max_calling_iterations == 2


class CalculatingEngine(BuyingEngine):
    """A scripted model that asks the calculator for 48 + 48/2 (GSM8K's first problem), then answers with
    the result it reads."""

    def turn(self, context: str) -> str:
        results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", context)
        if results:
            return f"She sold {results[-1]} clips.\n#### {results[-1]}<|im_end|>"
        call = {"name": "calculator", "arguments": {"expression": "48 + 48/2"}}
        return f"<tool_call>{json.dumps(call)}</tool_call><|im_end|>"


def test_the_shipped_calculator_config_trains_and_validates_with_its_tool(tiny_model_dir, tmp_path):
    """`configs/gsm8k_calculator_smollm2.yaml` through the CLI on the tiny model: its tool and rewards by
    import path, the local GSM8K, a scripted model calling the calculator; one step, then validation writing
    each transcript."""
    results = tmp_path / "val.jsonl"
    cli = build_cli(
        [
            "--config=configs/gsm8k_calculator_smollm2.yaml",
            f"--model.policy={tiny_model_dir}",
            "--model.grpo.run.preflight=false",
            "--model.grpo.max_prompt_length=896",  # the tiny tokenizer's pieces are short: its 1024 positions
            # Without the worked exchanges, whose prompt the tiny tokenizer makes about 1,400 tokens, past
            # those positions (tests/test_few_shot.py follows them into a rollout's ids).
            "--data.few_shot=null",
            "--model.grpo.max_completion_length=128",
            "--trainer.max_steps=1",
            "--trainer.val_check_interval=1",
            "--trainer.enable_progress_bar=false",
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
            f"--trainer.logger.save_dir={tmp_path}",
            "--data.train_size=2",
            "--data.val_size=2",
            f"--results.path={results}",
        ],
        run=False,
    )
    module = cli.model
    assert [tool.__name__ for tool in module.rollouts.multi_turn.tools] == ["calculator"]
    assert module.reward_names[-1] == "tool_call_reward" and module.grpo.tools.max_calling_iterations == 4
    engine = CalculatingEngine(module.tokenizer)
    module.rollouts.build_engine = lambda: engine
    metrics = Metrics()
    cli.trainer.callbacks.append(metrics)
    cli.trainer.fit(module, cli.datamodule)
    assert cli.trainer.global_step == 1
    assert metrics.logged["train/tools/call_frequency"] == 1.0
    assert metrics.logged["train/rewards/tool_call_reward"] == 1.0  # every call well-formed
    system = "<|im_start|>system\nSolve the math problem step by step. Use the calculator tool"
    assert engine.contexts[0].startswith(system) and '"name": "calculator"' in engine.contexts[0]
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    assert len(lines) == 2
    for line in lines:
        assert [m["role"] for m in line["transcript"]] == ["assistant", "tool", "assistant"]
        assert line["transcript"][1]["content"] == "72"
    assert all(line["extracted"] == "72" and line["correct"] == (line["answer"] == "72") for line in lines)


def test_the_demo_evaluation_answers_through_the_tool_loop_and_counts_the_calls(calling_model):
    """`heldout_correct` (scripts/demo.py's evaluation) samples a module with tools as validation does: the
    taught model's call runs, its answer after the result is read, and each problem says it called."""
    model, tokenizer = calling_model
    rows = [{"prompt": QUESTION, "answer": "#### 42"}, {"prompt": QUESTION, "answer": "#### 41"}]
    with_tools = GRPOModule(
        copy.deepcopy(model),
        tokenizer,
        reward_funcs=[answered_42],
        grpo=GRPOConfig(preflight=False),
        tools=[calculator],
    )
    results = heldout_correct(with_tools, rows, 2, None)
    assert results["called"] == [True, True]
    assert results["lenient"] == [True, False]  # "The answer is 42." after the result
    assert results["formatted"] == [False, False] and results["strict"] == [False, False]
    without = GRPOModule(
        copy.deepcopy(model), tokenizer, reward_funcs=[answered_42], grpo=GRPOConfig(preflight=False)
    )
    assert heldout_correct(without, rows, 2, None)["called"] == [False, False]
