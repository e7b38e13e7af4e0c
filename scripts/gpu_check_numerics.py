"""The GPU check's numerics (each prints PASS or FAIL with its numbers; any FAIL exits with status 1):
- on-policy, sampled by the eager path and by the static engine: float32 weights under bf16 autocast (the
  static engine samples from its copy, bf16 linear weights under the same autocast), a checkpoint
  generation config as Qwen2.5-Instruct's (repetition penalty 1.1, top-k 20, top-p 0.8, temperature 0.7)
  plus every other token suppressed; the log-prob each engine reports for each sampled token
  (`Rollout.sampler_logprobs`) equals `completion_logprobs`' (the sampler/scorer gap, on ~16k tokens), and
  the share of suppressed tokens sampled equals the raw policy's probability of them;
- LoRA updates kept: B at 1e-4, 1e-3, 1e-2 on 2 layers of Qwen2.5-0.5B's width, the static copy reproduces
  >= 0.99 of the scorer's log-prob change at each;
- weights move: 2 GRPO steps at the shipped one-GPU config's lr 1e-6 with 10 warm-up steps, under its
  precision (bf16-mixed, float32 weights) and, for contrast, under bf16-true; the model's vocabulary is the
  tokenizer's (with the 150k one, sampled ids past the tokenizer's 1,024 decode to nothing, the length
  reward is 0 everywhere and no weight moves, whatever the precision);
- head gradients: `completion_logprobs`' written LM-head backward under bf16 autocast, with the chunk's
  logits kept and recomputed, against autograd through the same autocast ops (relative error under 5e-3;
  before the backward ran under autocast, recomputed logits gave 1.3e-2 on the tiny CPU model).
"""

from __future__ import annotations

import argparse
import functools
import math

import torch
from gpu_check_shared import ROLLOUT_SHAPES, Check, quiet_trainer
from transformers import LlamaConfig, Qwen2Config, Qwen2ForCausalLM

from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.generation import logprobs, sampling
from grpo_lightning.core.generation.inference_copy import copy_precision
from grpo_lightning.core.generation.sampling import SamplingSettings
from grpo_lightning.core.generation.static_engine import StaticEngine
from grpo_lightning.core.rewards.verifiable import completion_text
from grpo_lightning.io.arithmetic_task import arithmetic_problems
from grpo_lightning.io.models import LoraOptions, apply_lora
from grpo_lightning.io.rows import DEFAULT_SYSTEM_PROMPT, chat_prompt
from grpo_lightning.offline.tiny import build_model
from grpo_lightning.training.data import GSM8KDataModule
from grpo_lightning.training.module import GRPOModule

# Qwen2.5-Instruct's generation_config.json: what `generate` would apply unless told otherwise.
QWEN_GENERATION_CONFIG = {
    "do_sample": True,
    "repetition_penalty": 1.1,
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
}


def tiny_policy(shape: dict, tokenizer, device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model(shape["vocab"], shape["hidden_size"], shape["num_layers"], shape["num_heads"])
    model.config.eos_token_id = model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.to(device)


def check_on_policy(
    shape: dict, tokenizer, device: str, completions: int, length: int, static: bool
) -> Check:
    """`static`: sampled by `StaticEngine` (its copy as under `bf16-mixed`, compiled on GPU), else by the
    eager path under autocast; scored by `completion_logprobs` of the float32 weights under autocast either
    way, against the log-prob the engine reports for each token (`Rollout.sampler_logprobs`)."""
    model = tiny_policy(shape, tokenizer, device).eval()
    special = set(tokenizer.all_special_ids)
    suppressed = [i for i in range(0, shape["vocab"], 2) if i not in special]
    model.generation_config.update(**QWEN_GENERATION_CONFIG, suppress_tokens=suppressed)
    texts = [
        tokenizer.apply_chat_template(
            chat_prompt(row["question"], DEFAULT_SYSTEM_PROMPT), tokenize=False, add_generation_prompt=True
        )
        for row in arithmetic_problems(4, seed=1)
    ]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    torch.manual_seed(0)
    with torch.autocast(device, dtype=torch.bfloat16):
        settings = {"max_new_tokens": length, "pad_token_id": tokenizer.pad_token_id}
        if static:
            engine = StaticEngine(
                SamplingSettings(**settings, eos_token_ids=(tokenizer.eos_token_id,), share_prompt=True),
                precision=copy_precision("bf16-mixed"),
                compile=device == "cuda",
            )
            generate = engine.generate
        else:
            eager = SamplingSettings(**settings, eos_token_ids=(tokenizer.eos_token_id,))
            generate = functools.partial(sampling.generate_completions, settings=eager)
        rollout = generate(
            model, enc["input_ids"], enc["attention_mask"], num_generations=completions // len(texts)
        )
        T = rollout.completion_ids.size(1)
        with torch.no_grad():
            scored, _ = logprobs.completion_logprobs(model, rollout.input_ids, rollout.attention_mask, T)
            logits = model(input_ids=rollout.input_ids, attention_mask=rollout.attention_mask).logits
    mask = rollout.completion_mask.bool()  # [B, T]
    diff = (rollout.sampler_logprobs - scored)[mask].abs()
    probs = logits[:, -T - 1 : -1].float().softmax(-1)  # [B, T, V] the raw policy at each sampled position
    expected = probs[..., suppressed].sum(-1)[mask].mean().item()  # its mass on the suppressed tokens
    is_suppressed = torch.isin(rollout.completion_ids, torch.tensor(suppressed, device=device))
    observed = is_suppressed[mask].float().mean().item()
    n = int(mask.sum())
    tolerance = 5 * math.sqrt(expected * (1 - expected) / n) + 0.01  # tokens of a row are not independent
    passed = diff.max().item() < 0.1 and diff.mean().item() < 0.01 and abs(observed - expected) < tolerance
    numbers = (
        f"{n} tokens: |sampled - scored log-prob| max {diff.max().item():.2e} mean {diff.mean().item():.2e}, "
        f"share above 0.1 {(diff > 0.1).float().mean().item():.4f}; suppressed tokens sampled "
        f"{observed:.3f}, the raw policy's mass on them {expected:.3f} (+-{tolerance:.3f})"
    )
    path = "static copy as under bf16-mixed" if static else "eager, autocast"
    return Check(f"on-policy sampling (Qwen-like generation config), {path}", passed, numbers)


def check_lora_small_updates(device: str, tiny: bool) -> Check:
    """LoRA B at scale 1e-4, 1e-3, 1e-2 on 2 layers of Qwen2.5-0.5B's width (a bf16 base, float32 adapters,
    bf16 autocast): the static engine's copy reproduces >= 0.99 of the scorer's log-prob change from the
    base at each scale (a copy with the adapters merged into bf16 weights kept 0.4-0.5 of it at 1e-4 on
    CPU)."""
    config = Qwen2Config(
        vocab_size=4096,
        tie_word_embeddings=True,
        **{**ROLLOUT_SHAPES["qwen2.5-0.5b"][2], "num_hidden_layers": 2},
    )
    torch.manual_seed(0)
    with torch.device(device):
        policy = apply_lora(Qwen2ForCausalLM(config).to(torch.bfloat16), LoraOptions(r=16))
    rows, length = (4, 48) if tiny else (16, 128)
    ids = torch.randint(3, 4096, (rows, length), device=device)  # [B, P+T]
    engine = StaticEngine(
        SamplingSettings(max_new_tokens=8, eos_token_ids=(1,), pad_token_id=0),
        precision=copy_precision("bf16-mixed"),
    )

    def scored(model) -> torch.Tensor:
        with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16):
            return logprobs.completion_logprobs(model, ids, torch.ones_like(ids), length // 2)[0].flatten()

    shares = []
    for scale in (0.0, 1e-4, 1e-3, 1e-2):
        with torch.no_grad():
            for name, weight in policy.named_parameters():
                if "lora_B" in name:
                    weight.copy_(torch.randn_like(weight) * scale)
        engine.weights_changed()
        engine.refresh(policy, torch.device(device))
        if scale == 0.0:
            base_policy, base_copy = scored(policy), scored(engine.copy.model)
            continue
        change, reproduced = scored(policy) - base_policy, scored(engine.copy.model) - base_copy
        shares.append(float(reproduced @ change / (change @ change)))
    numbers = ", ".join(f"{s:.4f} at {scale:g}" for s, scale in zip(shares, (1e-4, 1e-3, 1e-2), strict=True))
    return Check(
        "LoRA updates kept in the static copy", min(shares) >= 0.99, f"share of the change: {numbers}"
    )


def check_weights_move(shape: dict, tokenizer, device: str) -> list[Check]:
    """The shipped one-GPU config's lr and warm-up, 2 steps: the share of trainable weights (the input
    embedding aside, whose rows of unseen tokens get no gradient) that changed."""
    checks = []
    for precision, dtype, expect_moving in (
        ("bf16-mixed", torch.float32, True),
        ("bf16-true", torch.bfloat16, False),
    ):
        # The tokenizer's vocabulary: ids it does not know would decode to nothing (see the docstring).
        model = tiny_policy({**shape, "vocab": len(tokenizer)}, tokenizer, "cpu").to(dtype)
        module = GRPOModule(
            model,
            tokenizer=tokenizer,
            reward_funcs=[lambda completions, **kw: [len(completion_text(c)) / 10 for c in completions]],
            grpo=GRPOConfig(
                num_generations=4,
                max_completion_length=16,
                learning_rate=1e-6,
                warmup_steps=10,
                epsilon_high=0.28,
                log_completions_every=0,
                preflight=False,
                generation_backend="eager",  # the optimizer's precision is checked here, not the rollouts
            ),
        )
        before = {n: p.detach().clone() for n, p in model.named_parameters() if "embed_tokens" not in n}
        trainer = quiet_trainer(device != "cpu", precision=precision, max_steps=2)
        data = GSM8KDataModule(source="arithmetic", batch_size=2, val_size=8, arithmetic_size=200)
        trainer.fit(module, data)
        after = dict(module.policy.named_parameters())
        moved = sum(int((after[n].detach().to(w.device, w.dtype) != w).sum()) for n, w in before.items())
        share = moved / sum(w.numel() for w in before.values())
        passed = share > 0.9 if expect_moving else True  # bf16-true is the contrast, reported only
        label = "shipped" if expect_moving else "contrast"
        checks.append(
            Check(f"weights move, {precision} ({label})", passed, f"{share:.1%} of the weights changed")
        )
    return checks


def check_head_gradients(shape: dict, device: str) -> list[Check]:
    """The LM head's written backward under bf16 autocast against autograd through the same ops."""
    torch.manual_seed(0)
    V, H, rows = shape["vocab"], shape["hidden_size"], 256
    head = torch.nn.Linear(H, V, bias=False, device=device)
    torch.nn.init.normal_(head.weight, std=4 / math.sqrt(H))  # logits of a few units, as a trained model's
    hidden = torch.randn(1, rows + 1, H, device=device)
    targets = torch.randint(0, V, (1, rows), device=device)
    ids = torch.cat([torch.zeros(1, 1, dtype=torch.long, device=device), targets], 1)  # [1, rows + 1]
    weights = torch.randn(1, rows, device=device)

    class HeadOnly(torch.nn.Module):
        config = LlamaConfig(vocab_size=V, hidden_size=H, num_attention_heads=1)  # no logit transform

        def __init__(self, h):
            super().__init__()
            self.h = h

        def get_decoder(self):
            return lambda **kwargs: type("O", (), {"last_hidden_state": self.h})()

        def get_output_embeddings(self):
            return head

    h_ref = hidden.clone().requires_grad_()
    with torch.autocast(device, dtype=torch.bfloat16):
        logits = (h_ref[:, :-1] @ head.weight.T).float()  # [1, rows, V]
    ref = logits.log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)
    (ref * weights).sum().backward()
    expected = h_ref.grad, head.weight.grad.clone()
    checks = []
    for path, elements in (("kept", rows * V), ("recomputed", rows * V // 4)):
        head.weight.grad = None
        h = hidden.clone().requires_grad_()
        with torch.autocast(device, dtype=torch.bfloat16):
            lp, _ = logprobs.completion_logprobs(
                HeadOnly(h), ids, torch.ones_like(ids), rows, max_logits_elements=elements
            )
        (lp * weights).sum().backward()
        errors = [
            ((g - e).norm() / e.norm()).item()
            for g, e in zip((h.grad, head.weight.grad), expected, strict=True)
        ]
        checks.append(
            Check(
                f"head gradient under bf16 autocast, {path} logits",
                max(errors) < 5e-3,
                f"relative error: hidden {errors[0]:.2e}, weight {errors[1]:.2e}",
            )
        )
    return checks


def numerics(args: argparse.Namespace, shape: dict, tokenizer) -> list[Check]:
    device = "cpu" if args.cpu else "cuda"
    completions, length = (8, 8) if args.tiny else (64, 256)  # on a GPU, ~16k sampled tokens
    checks = [
        check_on_policy(shape, tokenizer, device, completions, length, static) for static in (False, True)
    ]
    checks.append(check_lora_small_updates(device, args.tiny))
    checks += check_weights_move(shape, tokenizer, device)
    checks += check_head_gradients(shape, device)
    return checks
