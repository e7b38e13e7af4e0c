"""A few GRPO steps of a random ~0.5B model (150k vocabulary) under bf16 FSDP2 and under LoRA, timed.

    bash scripts/gpu_check.sh              # one GPU, under 5 minutes on an H200
    bash scripts/gpu_check.sh --cpu --tiny # the same code paths on CPU in seconds (a test runs this)

No network: the tokenizer is trained on generated arithmetic problems and the model has random weights,
so the figures are about throughput and memory, not learning. Per run it prints the mean over the steps
after the first (warm-up) of: the step-time split (generate / reference log-probs / the rest, which is
the policy's forward-backward and the optimizer step), completion tokens per second, and peak memory.
"""

from __future__ import annotations

import argparse
import gc
import resource
import time
from dataclasses import dataclass

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy

from grpo_lightning.config import GRPOConfig
from grpo_lightning.data import GSM8KDataModule, arithmetic_problems
from grpo_lightning.distributed import close_process_group
from grpo_lightning.models import LoraOptions, ModelOptions
from grpo_lightning.module import GRPOModule
from grpo_lightning.tiny import build_model, build_tokenizer

# Qwen2.5-0.5B's vocabulary and width; Llama blocks with an MLP of 2x the width: 465M parameters.
FULL = {"vocab": 151936, "hidden_size": 896, "num_layers": 24, "num_heads": 14}
TINY = {"vocab": 1024, "hidden_size": 64, "num_layers": 2, "num_heads": 4}


@dataclass
class StepTimes:
    generate: float = 0.0
    reference: float = 0.0
    step: float = 0.0
    tokens: int = 0


class TimedGRPOModule(GRPOModule):
    """GRPOModule that records, per training step, where the time goes."""

    def on_fit_start(self) -> None:
        super().on_fit_start()
        self.times: list[StepTimes] = []

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def training_step(self, batch, batch_idx):
        self.times.append(StepTimes())
        start = self._now()
        loss = super().training_step(batch, batch_idx)
        self.times[-1].step = self._now() - start
        return loss

    def sample(self, prompts, num_generations, do_sample=True):
        start = self._now()
        rollout, completions = super().sample(prompts, num_generations, do_sample)
        if self.trainer.training and self.times:
            self.times[-1].generate += self._now() - start
            self.times[-1].tokens += int(rollout.completion_mask.sum())
        return rollout, completions

    def _frozen_logprobs(self, rollout, model):
        start = self._now()
        logprobs = super()._frozen_logprobs(rollout, model)
        self.times[-1].reference += self._now() - start
        return logprobs


def peak_memory_gib(device: str) -> float:
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # the process's peak RSS (KiB on Linux)


def run(name: str, args: argparse.Namespace, shape: dict, tokenizer, lora: bool) -> dict:
    gpu = not args.cpu
    gc.collect()  # the previous run's models, so that its memory does not count in this run's peak
    if gpu:
        torch.cuda.empty_cache()
    torch.manual_seed(0)
    model = build_model(shape["vocab"], shape["hidden_size"], shape["num_layers"], shape["num_heads"])
    model.config.eos_token_id = model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = model.generation_config.pad_token_id = tokenizer.pad_token_id
    params = sum(p.numel() for p in model.parameters())
    grpo = GRPOConfig(
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        beta=0.04,
        learning_rate=1e-6,
        micro_batch_size=args.micro_batch_size,
        preflight=False,
    )
    module = TimedGRPOModule(
        model,
        tokenizer=tokenizer,
        grpo=grpo,
        lora=LoraOptions(r=16) if lora else None,
        model_options=ModelOptions(gradient_checkpointing=True),
    )
    if lora:  # bf16 base weights, as a LoRA run on a small card; the reference is the adapter switched off
        strategy, precision = "auto", "bf16-true"
    else:  # FSDP2, world size 1: float32 shards, bf16 all-gathers and compute, a sharded reference
        strategy = ModelParallelStrategy(
            data_parallel_size=1, tensor_parallel_size=1, process_group_backend=None if gpu else "gloo"
        )
        precision = "bf16-mixed"
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    trainer = L.Trainer(
        accelerator="gpu" if gpu else "cpu",
        devices=1,
        strategy=strategy,
        precision=precision,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    data = GSM8KDataModule(source="arithmetic", batch_size=args.batch_size, val_size=8, arithmetic_size=200)
    trainer.fit(module, data)
    measured = module.times[1:] or module.times  # the first step warms up kernels and allocators
    n = len(measured)
    mean = {key: sum(getattr(t, key) for t in measured) / n for key in ("generate", "reference", "step")}
    tokens = sum(t.tokens for t in measured) / n
    close_process_group()  # the next run starts its own (or none)
    return {
        "run": name,
        "params_M": params / 1e6,
        "generate_s": mean["generate"],
        "reference_s": mean["reference"],
        "fwd_bwd_opt_s": mean["step"] - mean["generate"] - mean["reference"],
        "step_s": mean["step"],
        "tokens_per_s": tokens / mean["step"],
        "gen_tokens_per_s": tokens / mean["generate"],
        "peak_GiB": peak_memory_gib("cuda" if gpu else "cpu"),
    }


def table(rows: list[dict]) -> str:
    headers = list(rows[0])
    cells = [[f"{v:.3f}" if isinstance(v, float) else str(v) for v in row.values()] for row in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="run on CPU (gloo process group)")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model and short rollouts")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch_size", type=int, default=8, help="prompts per step")
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--max_completion_length", type=int, default=256)
    parser.add_argument("--micro_batch_size", type=int, default=16)
    args = parser.parse_args()
    if args.tiny:
        args.steps, args.batch_size, args.num_generations = min(args.steps, 2), 2, 2
        args.max_completion_length, args.micro_batch_size = 8, 4
    if not args.cpu and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: pass --cpu (and --tiny for a quick run)")
    shape = TINY if args.tiny else FULL
    texts = [row["question"] + "\n" + row["answer"] for row in arithmetic_problems(2000)]
    tokenizer = build_tokenizer(texts, vocab_size=min(shape["vocab"], 1024))
    start = time.perf_counter()
    rows = [
        run("fsdp2-bf16", args, shape, tokenizer, lora=False),
        run("lora-bf16", args, shape, tokenizer, lora=True),
    ]
    device = "cpu" if args.cpu else torch.cuda.get_device_name()
    print(
        f"\nGRPO GPU check: {device}, torch {torch.__version__}, {args.steps} steps of {args.batch_size} "
        f"prompts x {args.num_generations} completions x {args.max_completion_length} tokens "
        "(means over steps 2..)"
    )
    print(table(rows))
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
