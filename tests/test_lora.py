"""LoRA through PEFT: the reference is the base with the adapter off, one copy of the base in memory."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.generation.logprobs import completion_logprobs
from grpo_lightning.core.types import Rollout
from grpo_lightning.io.models import LoraOptions, ModelOptions, load_model
from grpo_lightning.training.module import GRPOModule

LORA = LoraOptions(r=4, alpha=8)


def make_module(model_dir: str, lora: LoraOptions | None, **model_options) -> GRPOModule:
    module = GRPOModule(
        model_dir,
        lora=lora,
        grpo=GRPOConfig(beta=0.04, preflight=False),
        model_options=ModelOptions(**model_options),
    )
    module.configure_model()
    return module


def perturb_adapter(module: GRPOModule) -> None:
    # PEFT starts lora_B at zero (the adapter is a no-op); a trained adapter is not.
    torch.manual_seed(0)
    for name, p in module.policy.named_parameters():
        if "lora_B" in name:
            p.data.normal_(std=0.5)


def fixed_rollout(batch: int = 3, prompt: int = 5, completion: int = 7) -> Rollout:
    g = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(3, 300, (batch, prompt), generator=g)  # [B, P]
    completion_ids = torch.randint(3, 300, (batch, completion), generator=g)  # [B, T]
    return Rollout(
        prompt_ids,
        torch.ones_like(prompt_ids),
        completion_ids,
        torch.ones_like(completion_ids),
        torch.zeros(batch, dtype=torch.bool),
    )


def sizes(module: torch.nn.Module) -> tuple[int, int]:
    params = {id(p): p for p in module.parameters()}.values()  # a tied weight counts once
    return sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params)


def test_lora_with_kl_holds_one_copy_of_the_base(tiny_model_dir):
    base_count, base_bytes = sizes(AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    module = make_module(tiny_model_dir, LORA)
    assert module.reference is None
    lora = [p for n, p in module.policy.named_parameters() if "lora_" in n]
    lora_count = sum(p.numel() for p in lora)
    assert lora and all(p.requires_grad for p in lora)
    assert 0 < lora_count < base_count / 10
    assert sizes(module) == (base_count + lora_count, base_bytes + 4 * lora_count)
    trainable = [p for p in module.policy.parameters() if p.requires_grad]
    assert sum(p.numel() for p in trainable) == lora_count  # the base is frozen: it is the reference

    full = make_module(tiny_model_dir, None)  # without LoRA, beta > 0 needs a second, frozen copy
    assert full.reference is not None
    assert sizes(full) == (2 * base_count, 2 * base_bytes)


def test_reference_logprobs_are_the_untouched_base_model(tiny_model_dir):
    module = make_module(tiny_model_dir, LORA)
    perturb_adapter(module)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    rollout = fixed_rollout()
    T = rollout.completion_ids.size(1)
    expected, _ = completion_logprobs(base, rollout.input_ids, rollout.attention_mask, T)  # [B, T]
    with torch.no_grad():
        policy, _ = module.rollouts.scorer(module.policy, rollout, slice(None))
        with module.policy.disable_adapter():
            reference, _ = module.rollouts.scorer(module.policy, rollout, slice(None))
        after, _ = module.rollouts.scorer(module.policy, rollout, slice(None))
    assert (policy - expected).abs().max() > 1e-2, "the adapter should move the policy away from the base"
    torch.testing.assert_close(reference, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after, policy)  # the adapter is back on after the context


def test_gradient_checkpointing_keeps_the_lora_gradient(tiny_model_dir):
    module = make_module(tiny_model_dir, LORA, gradient_checkpointing=True)
    policy = module.policy
    assert policy.is_activation_checkpointing
    token = torch.zeros(1, 1, dtype=torch.long)
    assert policy.get_input_embeddings()(token).requires_grad, "input gradients must be enabled"
    perturb_adapter(module)
    rollout = fixed_rollout()
    logprobs, _ = module.rollouts.scorer(policy, rollout, slice(None))
    logprobs.sum().backward()
    for name, p in policy.named_parameters():
        if "lora_A" in name:  # the first LoRA factor: its gradient needs B != 0 and the input gradient path
            assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_four_bit_base_needs_lora_and_a_gpu(tiny_model_dir):
    with pytest.raises(ValueError, match="load_in_4bit trains LoRA adapters"):
        GRPOModule(tiny_model_dir, model_options=ModelOptions(load_in_4bit=True))
    if not torch.cuda.is_available():  # the CPU path: one clear message, nothing loaded
        with pytest.raises(RuntimeError, match="load_in_4bit needs a CUDA GPU"):
            load_model(tiny_model_dir, ModelOptions(load_in_4bit=True))
