"""The GPU check's throughput, bf16 FSDP2 (world size 1) and LoRA: per run, the mean over the steps after the
first (warm-up) of the step-time split (generate / reference log-probs / the rest, which is the policy's
forward-backward and the optimizer step), completion tokens per second, and peak memory.
"""

from __future__ import annotations

import argparse
import gc
from dataclasses import dataclass

import torch
from gpu_check_shared import now, peak_memory_gib, quiet_trainer
from lightning.pytorch.strategies import ModelParallelStrategy

from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.generation.static_engine import StaticEngine
from grpo_lightning.io.distributed import close_process_group
from grpo_lightning.io.models import LoraOptions, ModelOptions
from grpo_lightning.offline.tiny import build_model
from grpo_lightning.training.data import GSM8KDataModule
from grpo_lightning.training.module import GRPOModule


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
        self.rollouts.sample = self._timed(self.rollouts.sample, "generate")
        self.update.frozen_logprobs = self._timed(self.update.frozen_logprobs, "reference")

    def _now(self) -> float:
        return now(self.device.type)

    def training_step(self, batch, batch_idx):
        self.times.append(StepTimes())
        start = self._now()
        loss = super().training_step(batch, batch_idx)
        self.times[-1].step = self._now() - start
        return loss

    def _timed(self, fn, field: str):
        """`fn`, its time in a training step added to that step's `field` (and the sampled tokens)."""

        def timed(*args, **kwargs):
            start = self._now()
            out = fn(*args, **kwargs)
            if self.trainer.training and self.times:
                times = self.times[-1]
                setattr(times, field, getattr(times, field) + self._now() - start)
                if field == "generate":
                    times.tokens += int(out[0].completion_mask.sum())
            return out

        return timed


def run(name: str, args: argparse.Namespace, shape: dict, tokenizer, lora: bool) -> dict:
    gpu = not args.cpu
    gc.collect()  # the previous run's models, so that its memory does not count in this run's peak
    if gpu:
        torch.cuda.empty_cache()
    torch.manual_seed(0)
    model = build_model(shape["vocab"], shape["hidden_size"], shape["num_layers"], shape["num_heads"])
    model.config.eos_token_id = model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = model.generation_config.pad_token_id = tokenizer.pad_token_id
    if lora:
        model.to(torch.bfloat16)  # the frozen base; PEFT creates the adapters in float32
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
    if lora:  # as configs/lora_1.5b_24gb.yaml: a frozen bf16 base, float32 adapters, bf16-mixed compute
        strategy, precision = "auto", "bf16-mixed"
    else:  # FSDP2, world size 1: float32 shards, bf16 all-gathers and compute, a sharded reference
        strategy = ModelParallelStrategy(
            data_parallel_size=1, tensor_parallel_size=1, process_group_backend=None if gpu else "gloo"
        )
        precision = "bf16-mixed"
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    trainer = quiet_trainer(gpu, strategy=strategy, precision=precision, max_steps=args.steps)
    data = GSM8KDataModule(source="arithmetic", batch_size=args.batch_size, val_size=8, arithmetic_size=200)
    trainer.fit(module, data)
    measured = module.times[1:] or module.times  # the first step warms up kernels and allocators
    n = len(measured)
    mean = {key: sum(getattr(t, key) for t in measured) / n for key in ("generate", "reference", "step")}
    tokens = sum(t.tokens for t in measured) / n
    engine = module.rollouts.engine
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
        "static": int(isinstance(engine, StaticEngine)),  # 1: the static-cache engine generated
        "recompiles": getattr(engine, "recompiles", 0),
    }
