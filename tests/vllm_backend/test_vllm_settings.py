"""What the engine decides before vLLM starts: a float32 LoRA engine on CUDA serves in bfloat16 (vLLM's CUDA
LoRA kernels take 16-bit only), with one warning; a rank's local index comes from its CUDA device, else
`LOCAL_RANK`, else `SLURM_LOCALID`. The engine: `core.generation.vllm_engine`."""

from __future__ import annotations

import warnings

import pytest
import torch

from grpo_lightning.core.generation.vllm_engine import serving_dtype
from grpo_lightning.core.generation.vllm_process import local_rank


def test_a_float32_lora_engine_on_cuda_serves_bf16():
    with pytest.warns(UserWarning, match="bf16/fp16 only") as caught:
        assert serving_dtype(torch.float32, lora=True, cuda=True) == torch.bfloat16
    assert len(caught) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert serving_dtype(torch.float32, lora=True, cuda=False) == torch.float32  # CPU LoRA takes fp32
        assert serving_dtype(torch.float32, lora=False, cuda=True) == torch.float32
        assert serving_dtype(torch.float16, lora=True, cuda=True) == torch.float16


def test_local_rank_from_the_device_then_the_launcher(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("SLURM_LOCALID", "3")
    assert local_rank(torch.device("cpu")) == 3, "srun's local index"
    assert local_rank(torch.device("cuda", 5)) == 5, "the rank's own device first"
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert local_rank(torch.device("cpu")) == 2, "Lightning's and torchrun's over srun's"
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.delenv("SLURM_LOCALID")
    assert local_rank(torch.device("cpu")) == 0
