"""What a tool turn costs a training step, per rollout engine: steps with the calculator (every sample calls
it, then answers) against single-turn steps of the same completion length without tools.

The policy is taught to call the calculator first (`grpo_lightning.offline.tool_caller.teach_tool_call`: a
random model, or a small instruct one, never calls a tool unprompted), so every sample of the multi-turn run
is two model turns around one tool result. The single-turn run then samples exactly the multi-turn run's
mean completion length, tool tokens included (`min_completion_length` = `max_completion_length` = that
mean, rounded), with no tools, so the two runs score, and train on, about as many tokens per step; what
is left is the loop's own cost: a second generation call per turn, parsing the call, running the tool,
appending its ids, and the masks.

Each run makes `--steps` training steps of `--prompts` prompts x `--generations` samples on the CPU; the
first step (engine set-up, the static engine's copy, vLLM's start) is left out, and the mean wall and
process CPU seconds of the others are reported, with the tokens per sample (the model's, the tool's) and
the calls per sample.

    python benchmarks/multi_turn_cost.py                     # eager and static, a random 4-layer Llama
    python benchmarks/multi_turn_cost.py --engines vllm      # in the vLLM environment (make test-vllm's)
    python benchmarks/multi_turn_cost.py --model models/smollm2-135m-instruct --steps 3
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import lightning as L  # noqa: E402
import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from grpo_lightning.core.config import GRPOConfig  # noqa: E402
from grpo_lightning.core.rewards.verifiable import completion_text  # noqa: E402
from grpo_lightning.core.tools.calculator import calculator  # noqa: E402
from grpo_lightning.offline.tiny import build_model, build_tokenizer  # noqa: E402
from grpo_lightning.offline.tool_caller import ANSWER, CALL, QUESTION, teach_tool_call  # noqa: E402
from grpo_lightning.training.data import PromptDataModule  # noqa: E402
from grpo_lightning.training.module import GRPOModule  # noqa: E402


def answered_42(completions: list, **kwargs) -> list[float]:
    return [float("42" in completion_text(c)) for c in completions]


class StepClock(L.Callback):
    """Wall and CPU seconds of each training step, and the tokens of each step's samples."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.tokens: list[
            tuple[float, float, float]
        ] = []  # per sample: all completion tokens, model's, calls

    def on_train_start(self, trainer, pl_module):
        build = pl_module.update.trajectory

        def recorded(*args, **kwargs):
            trajectory = build(*args, **kwargs)
            rollout = trajectory.rollout
            model = rollout.model_mask.sum(1).float()  # [B*G]
            every = rollout.completion_mask.sum(1).float()  # [B*G] the tool's tokens too
            tool = (rollout.completion_mask.bool() & ~rollout.model_mask.bool()).int()  # [B*G, T]
            results = (tool[:, 1:] > tool[:, :-1]).sum(1) + tool[:, 0]  # [B*G] tool turns (runs of ids)
            self.tokens.append((float(every.mean()), float(model.mean()), float(results.float().mean())))
            return trajectory

        pl_module.update.trajectory = recorded

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._started = (time.perf_counter(), time.process_time())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        wall, cpu = self._started
        self.wall.append(time.perf_counter() - wall)
        self.cpu.append(time.process_time() - cpu)


def policy(args: argparse.Namespace) -> tuple[torch.nn.Module, object]:
    """The policy taught to call the calculator, and its tokenizer (with `TOOLS_TEMPLATE`)."""
    if args.model:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    else:
        texts = [QUESTION[0]["content"], CALL, ANSWER, "The answer is 0 1 2 3 4 5 6 7 8 9."] * 50
        tokenizer = build_tokenizer(texts, 400)
        model = build_model(len(tokenizer), hidden_size=args.hidden, num_layers=args.layers)
        model.config.eos_token_id = model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.config.pad_token_id = model.generation_config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(0)
    teach_tool_call(model, tokenizer, steps=args.teach_steps)  # sets TOOLS_TEMPLATE on the tokenizer
    return model, tokenizer


def run(args: argparse.Namespace, model, tokenizer, engine: str, length: int | None) -> StepClock:
    """`args.steps` training steps on `engine`: with the calculator where `length` is None, else single-turn
    completions of exactly `length` tokens."""
    options = dict(
        num_generations=args.generations,
        temperature=args.temperature,
        learning_rate=1e-5,
        generation_backend=engine,
        preflight=False,
        log_completions_every=0,
    )
    if length is None:
        options["max_completion_length"] = args.max_completion_length
    else:
        options |= dict(max_completion_length=length, min_completion_length=length)
    tools = [calculator] if length is None else None
    module = GRPOModule(
        copy.deepcopy(model), tokenizer, reward_funcs=[answered_42], grpo=GRPOConfig(**options), tools=tools
    )
    rows = [{"prompt": QUESTION, "answer": "42"}] * (args.prompts * args.steps)
    data = PromptDataModule(source=Dataset.from_list(rows), batch_size=args.prompts, val_size=0)
    clock = StepClock()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=args.steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[clock],
    )
    L.seed_everything(0, verbose=False)
    trainer.fit(module, data)
    return clock


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engines", default="eager,static", help="comma-separated: eager, static, vllm")
    parser.add_argument(
        "--model", default=None, help="a model folder; default a random Llama (--hidden, --layers)"
    )
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--teach_steps", type=int, default=120)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--max_completion_length", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=4, help="training steps per run; the first is left out")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    # The single-turn run reaches its length on purpose: every step would say so.
    warnings.filterwarnings("ignore", "all .* completions of this step reached max_completion_length")
    model, tokenizer = policy(args)
    shape = f"{args.prompts} prompts x {args.generations}, steps 2..{args.steps}"
    print(f"load {os.getloadavg()[0]:.2f} at the start; {shape}")
    columns = [
        "engine",
        "run",
        "s per step",
        "CPU s per step",
        "tokens per sample (model's)",
        "calls per sample",
    ]
    print("| " + " | ".join([*columns, "x single-turn"]) + " |\n" + "|---" * 7 + "|")
    for engine in args.engines.split(","):
        tools = run(args, model, tokenizer, engine, None)
        every = statistics.mean(t[0] for t in tools.tokens[1:])
        single = run(args, model, tokenizer, engine, round(every))
        for name, clock in (("calculator", tools), ("single-turn", single)):
            wall, cpu = statistics.mean(clock.wall[1:]), statistics.mean(clock.cpu[1:])
            tokens = clock.tokens[1:]
            all_tokens, model_tokens = (
                statistics.mean(t[0] for t in tokens),
                statistics.mean(t[1] for t in tokens),
            )
            calls = statistics.mean(t[2] for t in tokens)
            ratio = wall / statistics.mean(single.wall[1:])
            print(
                f"| {engine} | {name} | {wall:.2f} | {cpu:.2f} | {all_tokens:.1f} ({model_tokens:.1f}) | "
                f"{calls:.2f} | {ratio:.2f} |",
                flush=True,
            )
    print(f"load {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
