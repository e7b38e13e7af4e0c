"""What the GPU check's parts share: the random models' shapes, a quiet one-device Trainer, the clock
after the device finished, peak memory, and a check's PASS/FAIL record."""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass

import lightning as L
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

# Qwen2.5-0.5B's vocabulary and width; Llama blocks with an MLP of 2x the width: 465M parameters.
FULL = {"vocab": 151936, "hidden_size": 896, "num_layers": 24, "num_heads": 14}
TINY = {"vocab": 1024, "hidden_size": 64, "num_layers": 2, "num_heads": 4}
# Random-weight models for the rollout comparison: the shapes of Qwen2.5-0.5B's and -1.5B's config.json,
# SmolLM2-135M's (for CPU figures), and a tiny one.
ROLLOUT_SHAPES = {
    "qwen2.5-0.5b": (
        Qwen2ForCausalLM,
        Qwen2Config,
        {
            "hidden_size": 896,
            "intermediate_size": 4864,
            "num_hidden_layers": 24,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
        },
    ),
    "qwen2.5-1.5b": (
        Qwen2ForCausalLM,
        Qwen2Config,
        {
            "hidden_size": 1536,
            "intermediate_size": 8960,
            "num_hidden_layers": 28,
            "num_attention_heads": 12,
            "num_key_value_heads": 2,
        },
    ),
    "smollm2-135m": (
        LlamaForCausalLM,
        LlamaConfig,
        {
            "vocab_size": 49152,
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_hidden_layers": 30,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
        },
    ),
    "tiny": (
        Qwen2ForCausalLM,
        Qwen2Config,
        {
            "vocab_size": 1024,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        },
    ),
}


def quiet_trainer(gpu: bool, **kwargs) -> L.Trainer:
    """A Trainer on one GPU (or the CPU) that logs, checkpoints, validates and prints nothing."""
    return L.Trainer(
        accelerator="gpu" if gpu else "cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        **kwargs,
    )


def now(device: str) -> float:
    """The clock, once the device has finished what was queued."""
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def peak_memory_gib(device: str) -> float:
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # the process's peak RSS (KiB on Linux)


@dataclass
class Check:
    name: str
    passed: bool
    numbers: str
