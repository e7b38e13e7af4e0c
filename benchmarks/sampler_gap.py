"""The sampler/scorer gap of each rollout path on the CPU: how far the log-prob each engine reports for the
tokens it drew is from the log-prob the loss scores them with.

A random model of Qwen2.5-0.5B's width (`--layers` of its 24, vocabulary `--vocab`, the LM head scaled so
that its logits spread over a few units, as a trained model's do), float32 master weights. Each path
samples `--prompts` x `--generations` completions of `--new_tokens` tokens (temperature 1, no top-k/p);
the scorer is `completion_logprobs` of the float32 policy, under bf16 autocast where the path trains under
`bf16-mixed`. Reported per path: tokens, mean and max |log p_sampler - log p_scorer| and the share of
tokens above 0.1 (what `rollout/logp_gap_*` logs every step):

- `eager fp32` / `eager bf16-mixed`: `generate` on the policy itself (under autocast for the second);
- `static fp32`: the static engine's copy of float32 weights;
- `static bf16-mixed`: the copy as the trainer builds it (bf16 linear weights, float32 embeddings and
  norms, the same autocast as the scorer);
- `static all-bf16`: a copy with every weight in bf16 run without autocast, for comparison (how a copy in
  the compute dtype alone computes);
- `static bf16-mixed, LoRA`: a bf16 base with LoRA r=16 (B at 1e-3), as the shipped LoRA config.

    python benchmarks/sampler_gap.py
    python benchmarks/sampler_gap.py --layers 8 --new_tokens 128
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torch  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from grpo_lightning.core.generation.engines import EagerEngine, SamplingSettings  # noqa: E402
from grpo_lightning.core.generation.inference_copy import CopyPrecision, copy_precision, own_weights  # noqa: E402
from grpo_lightning.core.generation.logprobs import completion_logprobs
from grpo_lightning.core.generation.static_engine import StaticEngine  # noqa: E402
from grpo_lightning.io.models import LoraOptions, apply_lora  # noqa: E402

QWEN_0_5B = {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
}


def policy_of(args: argparse.Namespace, lora: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=args.vocab, num_hidden_layers=args.layers, tie_word_embeddings=False, **QWEN_0_5B
    )
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(args.head_scale)  # logits of a few units: log-probs that differ
    if not lora:
        return model
    policy = apply_lora(model.to(torch.bfloat16), LoraOptions(r=16, alpha=32)).eval()
    with torch.no_grad():
        for name, weight in policy.named_parameters():
            if "lora_B" in name:
                weight.normal_(0, 1e-3)
    return policy


def all_bf16(model):
    """Every weight in bf16: the copy of a compute-dtype-only design."""
    return ((name, weight.to(torch.bfloat16)) for name, weight in own_weights(model))


def gap(args: argparse.Namespace, name: str, policy, engine, autocast: bool) -> dict:
    ids = torch.randint(
        3, args.vocab, (args.prompts, args.prompt_tokens), generator=torch.Generator().manual_seed(1)
    )
    torch.manual_seed(2)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        rollout = engine.generate(policy, ids, torch.ones_like(ids), num_generations=args.generations)
        T = rollout.completion_ids.size(1)
        scored, _ = completion_logprobs(policy, rollout.input_ids, rollout.attention_mask, T)
    mask = rollout.completion_mask.bool()
    diff = (rollout.sampler_logprobs - scored)[mask].abs()
    return {
        "path": name,
        "tokens": int(mask.sum()),
        "mean": diff.mean().item(),
        "max": diff.max().item(),
        "above": (diff > 0.1).float().mean().item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--head_scale", type=float, default=8.0)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--prompt_tokens", type=int, default=32)
    parser.add_argument("--new_tokens", type=int, default=64)
    args = parser.parse_args()
    settings = SamplingSettings(
        max_new_tokens=args.new_tokens,
        min_new_tokens=args.new_tokens,
        eos_token_ids=(1,),
        pad_token_id=0,
        share_prompt=True,
    )
    full, lora = policy_of(args, lora=False), policy_of(args, lora=True)
    mixed = copy_precision("bf16-mixed")
    rows = [
        gap(args, "eager fp32", full, EagerEngine(settings), autocast=False),
        gap(args, "eager bf16-mixed", full, EagerEngine(settings), autocast=True),
        gap(args, "static fp32", full, StaticEngine(settings), autocast=False),
        gap(args, "static bf16-mixed", full, StaticEngine(settings, precision=mixed), autocast=True),
        gap(
            args,
            "static all-bf16",
            full,
            StaticEngine(settings, precision=CopyPrecision(torch.bfloat16), weights=all_bf16),
            autocast=True,
        ),
        gap(args, "static bf16-mixed, LoRA", lora, StaticEngine(settings, precision=mixed), autocast=True),
    ]
    print(
        f"Qwen2.5-0.5B width, {args.layers} layers, vocabulary {args.vocab}, head x{args.head_scale}; "
        f"{args.prompts} x {args.generations} completions of {args.new_tokens} tokens; "
        f"{torch.get_num_threads()} threads; load {os.getloadavg()[0]:.1f}"
    )
    print("| path | tokens | mean gap | max gap | share > 0.1 |")
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        print(
            f"| {row['path']} | {row['tokens']} | {row['mean']:.2e} | {row['max']:.2e} | {row['above']:.4f} |"
        )


if __name__ == "__main__":
    main()
