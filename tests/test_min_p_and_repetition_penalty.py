"""`min_p` and `repetition_penalty`, as every engine draws with them (vLLM's order: the penalty on the logits,
then the temperature, min-p, top-k, top-p), each drawn token's log-prob that of the distribution it came from:

- min-p never draws a token whose probability is below `min_p` times the most likely one's (a model whose
  logits are fixed), and its log-probs are those of the kept tokens renormalised;
- the repetition penalty is CTRL's formula over the row's own tokens, its prompt without the padding and its
  completion so far, on the eager and the static engine (row dropping included): each drawn token's
  log-prob is the one a full forward pass gives under that formula (`processed_logprobs`, which the vLLM
  engines' tests hold them to as well);
- the colocated engine's `SamplingParams` and the server engine's request carry both; greedy decoding none.
"""

from __future__ import annotations

import math
import sys
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from torch import Tensor, nn

from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.generation.engines import EagerEngine
from grpo_lightning.core.generation.logprobs import completion_logprobs, position_ids
from grpo_lightning.core.generation.sampling import SamplingSettings, generate_completions
from grpo_lightning.core.generation.static_engine import StaticEngine
from grpo_lightning.core.generation.vllm_client import completion_body
from grpo_lightning.core.generation.vllm_requests import sampling_params
from grpo_lightning.core.types import Rollout
from grpo_lightning.offline.tiny import build_model

VOCAB, EOS, PAD = 300, 2, 0


class FixedHead(nn.Module):
    """An LM head whose logits `[V]` are the same at every position, whatever the input."""

    def __init__(self, logits: Tensor) -> None:
        super().__init__()
        self.register_buffer("logits", logits)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.logits.expand(*hidden.shape[:-1], -1)


def fixed_logits_model(probs: dict[int, float]) -> nn.Module:
    """The tiny model with a head that gives token i probability `probs[i]` at every step, the rest 0."""
    model = build_model(VOCAB, hidden_size=32, num_layers=1, num_heads=4).eval()
    logits = torch.full((VOCAB,), -math.inf)
    for token, p in probs.items():
        logits[token] = math.log(p)
    model.lm_head = FixedHead(logits)
    return model


def test_min_p_never_draws_a_token_below_min_p_times_the_most_likely_ones():
    probs = {10: 0.30, 11: 0.20, 12: 0.15, 13: 0.10, 14: 0.07, 15: 0.05, 16: 0.13}  # EOS never: full rows
    model = fixed_logits_model(probs)
    prompt = torch.tensor([[5, 6, 7]])  # [1, 3]
    settings = SamplingSettings(max_new_tokens=16, eos_token_ids=(EOS,), pad_token_id=PAD, temperature=0.7)
    tempered = {t: p ** (1 / 0.7) for t, p in probs.items()}
    total = sum(tempered.values())
    tempered = {t: p / total for t, p in tempered.items()}  # what min-p compares: after the temperature
    threshold = 0.3 * max(tempered.values())
    kept = {t for t, p in tempered.items() if p >= threshold}
    assert kept == {10, 11, 12, 16}, "the case under test: three tokens below the threshold"

    def draws(min_p: float) -> Rollout:
        torch.manual_seed(0)
        rollout = generate_completions(
            model, prompt, torch.ones_like(prompt), replace(settings, min_p=min_p), num_generations=64
        )
        assert rollout.completion_mask.all()
        return rollout

    rollout = draws(0.3)
    drawn = rollout.completion_ids.flatten().tolist()  # 1024 draws
    assert set(drawn) <= kept
    kept_mass = sum(tempered[t] for t in kept)
    expected = torch.tensor([math.log(tempered[t] / kept_mass) for t in drawn])
    torch.testing.assert_close(rollout.sampler_logprobs.flatten(), expected, atol=1e-5, rtol=0)
    without = draws(0.0).completion_ids.flatten().tolist()
    assert sum(t not in kept for t in without) > 100, "without min-p, the tokens below it are drawn"


def processed_logprobs(model: nn.Module, rollout: Rollout, settings: SamplingSettings) -> Tensor:
    """Each completion token's log-prob `[B, T]` (0 after the end) under the policy's logits from one full
    forward pass, processed in vLLM's order: CTRL's repetition penalty over the row's unpadded prompt and
    completion so far (a logit > 0 divided by the penalty, else multiplied), the temperature, min-p. What
    every engine's sampler log-probs must be."""
    ids, mask = rollout.input_ids, rollout.attention_mask
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits.double()
    P, (B, T) = rollout.prompt_ids.size(1), rollout.completion_ids.shape
    penalty, expected = settings.repetition_penalty, torch.zeros(B, T, dtype=torch.float64)
    for row in range(B):
        seen = set(rollout.prompt_ids[row][rollout.prompt_mask[row].bool()].tolist())
        for t in range(int(rollout.completion_mask[row].sum())):
            step = logits[row, P + t - 1].clone()  # [V]
            present = torch.tensor(sorted(seen))
            step[present] = torch.where(step[present] > 0, step[present] / penalty, step[present] * penalty)
            step = step / settings.temperature
            probs = torch.softmax(step, -1)
            step[probs < settings.min_p * probs.max()] = -math.inf
            token = int(rollout.completion_ids[row, t])
            expected[row, t] = torch.log_softmax(step, -1)[token]
            seen.add(token)
    return expected.float()


def padded_prompts() -> tuple[Tensor, Tensor]:
    """`[4, 7]` prompts that repeat their tokens, left-padded to different lengths (row i: i pad columns)."""
    ids = torch.tensor([[40, 41, 40, 42, 41, 40, 43]]).repeat(4, 1) + torch.arange(4)[:, None]
    mask = torch.ones_like(ids)
    for row in range(4):
        ids[row, :row], mask[row, :row] = PAD, 0
    return ids, mask


@pytest.mark.parametrize("engine", ["eager", "static"])
def test_the_repetition_penalty_is_ctrls_formula_over_each_rows_own_tokens(engine):
    """4 prompts x 4 samples, 30 stop ids (rows end at different steps, so the eager engine drops its
    finished rows midway): every drawn token's log-prob is the penalised distribution's, where a penalty
    over the padding, or over no token at all, would be off."""
    torch.manual_seed(0)
    model = build_model(VOCAB, hidden_size=32, num_layers=2, num_heads=4).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # logits of some units: the penalty moves log-probs by tenths
    settings = SamplingSettings(
        max_new_tokens=12,
        eos_token_ids=tuple(range(3, 33)),
        pad_token_id=PAD,
        temperature=0.8,
        repetition_penalty=1.8,
    )
    ids, mask = padded_prompts()
    sampler = EagerEngine(settings) if engine == "eager" else StaticEngine(settings, prompt_bucket=8)
    torch.manual_seed(1)
    rollout = sampler.generate(model, ids, mask, num_generations=4)
    lengths = rollout.completion_mask.sum(1)
    assert lengths.min() < lengths.max() and lengths.max() > 4
    expected = processed_logprobs(model, rollout, settings)
    done = rollout.completion_mask.bool()
    torch.testing.assert_close(rollout.sampler_logprobs[done], expected[done], atol=1e-5, rtol=0)
    T = rollout.completion_ids.size(1)
    with torch.no_grad():
        raw, _ = completion_logprobs(model, rollout.input_ids, rollout.attention_mask, T, temperature=0.8)
    assert (rollout.sampler_logprobs - raw)[done].abs().max() > 1e-2, "the penalty changed what was drawn"


def test_the_options_reach_the_settings_and_every_engines_request(monkeypatch):
    config = GRPOConfig(min_p=0.05, repetition_penalty=1.2)
    assert (config.sampling.min_p, config.sampling.repetition_penalty) == (0.05, 1.2)
    assert GRPOConfig(min_p=None).sampling.min_p == 0.0, "TRL's None: off"
    with pytest.raises(
        ValueError, match=r"^GRPOConfig.sampling.min_p=1.5: must be >= 0 and <= 1 \(0 disables it\)$"
    ):
        GRPOConfig(min_p=1.5)
    with pytest.raises(ValueError, match=r"^GRPOConfig.sampling.repetition_penalty=0: must be > 0"):
        GRPOConfig(repetition_penalty=0)
    settings = config.sampling.settings([EOS], PAD, share_prompt=False)
    assert (settings.min_p, settings.repetition_penalty) == (0.05, 1.2)
    body = completion_body("tiny", [5, 6], settings, 4, do_sample=True)
    assert (body["min_p"], body["repetition_penalty"]) == (0.05, 1.2)
    greedy = completion_body("tiny", [5, 6], settings, 4, do_sample=False)
    assert (greedy["min_p"], greedy["repetition_penalty"]) == (0.0, 1.0), "greedy: the raw policy's argmax"
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(SamplingParams=lambda **given: given))
    params = sampling_params(settings, 4, do_sample=True)
    assert (params["min_p"], params["repetition_penalty"]) == (0.05, 1.2)
    greedy = sampling_params(settings, 4, do_sample=False)
    assert "min_p" not in greedy and "repetition_penalty" not in greedy  # vLLM's defaults: off
