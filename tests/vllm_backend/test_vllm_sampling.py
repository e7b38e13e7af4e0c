"""vLLM samples what the settings ask and what the scorer scores: one engine for the module, on the tiny
model with a peaked head (its logits scaled up, so that a few tokens carry most of the mass). The group
shape, length bounds and stop ids; sampled log-probs equal to the scorer's at temperature 1 and 0.7; first
tokens drawn with the scorer's softmax (total variation and chi-square over 4000 draws) at temperature 1,
0.7 and with top-p; min-p and the repetition penalty as the eager engine defines them; the checkpoint's
generation config left out; greedy equal to eager greedy; the
trainer's threads kept.
The engine: `core.generation.vllm_engine`."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo_lightning.core.generation.sampling import SamplingSettings
from tests.test_min_p_and_repetition_penalty import processed_logprobs
from tests.test_static_engine import eager_greedy
from tests.vllm_backend.helpers import MASK, PROMPTS, engine_for, sampled_gap, scored

DRAWS = 4000
CHI2_Z = 3.09  # the normal quantile of p = 0.999: the test fails by chance once in a thousand runs


@pytest.fixture(scope="module")
def model(vllm_model_dir):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(vllm_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(12)  # [V, H] a peaked next-token distribution
    model.generation_config.top_k, model.generation_config.temperature = 1, 0.05  # must not leak in
    model.generation_config.do_sample = True
    return model


@pytest.fixture(scope="module")
def engine(model):
    threads = torch.get_num_threads()
    engine = engine_for(model)
    engine.refresh(model, torch.device("cpu"))
    assert torch.get_num_threads() == threads, "vLLM's start-up kept the trainer's threads"
    yield engine
    engine.close()


def test_groups_lengths_and_stop_ids(engine, model):
    settings = SamplingSettings(max_new_tokens=6, min_new_tokens=3, eos_token_ids=(2, 5), pad_token_id=0)
    rollout = engine.generate(model, PROMPTS, MASK, num_generations=3, settings=settings)
    assert rollout.completion_ids.shape[0] == 6 and rollout.completion_ids.size(1) <= 6
    assert torch.equal(rollout.prompt_ids, PROMPTS.repeat_interleave(3, dim=0))
    lengths = rollout.completion_mask.sum(1)  # [6]
    for row, length, truncated in zip(rollout.completion_ids, lengths, rollout.truncated, strict=True):
        tokens = row[:length].tolist()
        assert length >= 3 and not set(tokens[:2]) & {2, 5}, "no stop id before min_new_tokens"
        assert set(tokens[:-1]).isdisjoint({2, 5}) and (tokens[-1] in {2, 5}) != bool(truncated)
        assert (row[length:] == 0).all(), "padded with the pad id"
    assert (rollout.sampler_logprobs[rollout.completion_mask == 0] == 0).all()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_are_the_scorers(engine, model, temperature):
    settings = SamplingSettings(max_new_tokens=8, eos_token_ids=(2,), pad_token_id=0, temperature=temperature)
    rollout = engine.generate(model, PROMPTS, MASK, num_generations=4, settings=settings)
    gap = (rollout.sampler_logprobs - scored(model, rollout, temperature))[rollout.completion_mask.bool()]
    assert gap.abs().max() < 1e-5


def test_min_p_and_the_repetition_penalty_are_drawn_as_every_engine_draws(engine, model):
    """vLLM's processed log-probs with a repetition penalty and min-p are those of their definition on the
    eager engine (`processed_logprobs`: the penalty over the prompt's and the completion's tokens, then the
    temperature, then min-p)."""
    settings = SamplingSettings(
        max_new_tokens=8,
        eos_token_ids=(2,),
        pad_token_id=0,
        temperature=0.8,
        min_p=0.05,
        repetition_penalty=1.8,
    )
    rollout = engine.generate(model, PROMPTS, MASK, num_generations=4, settings=settings)
    done = rollout.completion_mask.bool()
    expected = processed_logprobs(model, rollout, settings)
    assert (rollout.sampler_logprobs - expected)[done].abs().max() < 1e-5
    raw = scored(model, rollout, settings.temperature)
    assert (rollout.sampler_logprobs - raw)[done].abs().max() > 1e-2, "the knobs changed the distribution"


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """`probs` `[V]` kept on the most likely tokens whose mass reaches `top_p` (the first one past it
    included), renormalised."""
    ordered, order = probs.sort(descending=True)
    before = ordered.cumsum(0) - ordered  # [V] the mass of the more likely tokens
    kept = torch.zeros_like(probs)
    kept[order[before < top_p]] = probs[order[before < top_p]]
    return kept / kept.sum()


def _chi2_limit(df: int) -> float:
    """The 0.999 quantile of chi-square with `df` degrees of freedom (Wilson-Hilferty)."""
    a = 2 / (9 * df)
    return df * (1 - a + CHI2_Z * math.sqrt(a)) ** 3


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 1.0), (1.0, 0.8)])
def test_first_tokens_follow_the_scorers_softmax(engine, model, temperature, top_p):
    prompt, mask = PROMPTS[1:], MASK[1:]
    settings = SamplingSettings(
        max_new_tokens=1, eos_token_ids=(2,), pad_token_id=0, temperature=temperature, top_p=top_p
    )
    rollout = engine.generate(model, prompt, mask, num_generations=DRAWS, settings=settings)
    with torch.no_grad():
        logits = model(input_ids=prompt).logits[0, -1].float()  # [V]
    expected = _nucleus(torch.softmax(logits / temperature, -1), top_p)  # [V]
    assert expected.max() > 0.1 and (expected > 0.01).sum() >= 3, "peaked, but not one token"
    counts = torch.bincount(rollout.completion_ids[:, 0], minlength=expected.numel()).double()  # [V]
    assert counts[expected == 0].sum() == 0, "nothing drawn outside the nucleus"
    tv = float(0.5 * (counts / DRAWS - expected).abs().sum())
    # What sampling noise alone gives: E|count/N - p| ~ sqrt(2 p (1 - p) / (pi N)) per token.
    noise = float(0.5 * (2 * expected * (1 - expected) / (math.pi * DRAWS)).sqrt().sum())
    assert tv < 1.5 * noise, f"total variation {tv:.3f}, sampling noise alone {noise:.3f}"
    big = expected * DRAWS >= 5  # chi-square's cells: the tokens expected 5 times or more, the rest pooled
    observed = torch.cat([counts[big], counts[~big].sum().view(1)])
    wanted = torch.cat([expected[big], expected[~big].sum().view(1)]) * DRAWS
    chi2 = float(((observed - wanted) ** 2 / wanted.clamp(min=1e-9))[wanted > 0].sum())
    assert chi2 < _chi2_limit(int(big.sum())), f"chi-square {chi2:.1f} over {int(big.sum())} cells"


def test_greedy_is_eager_greedy(engine, model):
    rollout = engine.generate(model, PROMPTS, MASK, num_generations=2, do_sample=False)
    expected = eager_greedy(model, PROMPTS, MASK, G=2, max_new_tokens=8, pad_token_id=0, eos_token_ids=[2])
    assert torch.equal(rollout.completion_ids, expected.completion_ids)
    assert rollout.sampler_logprobs is None


def test_the_trainers_threads_stay_settable(engine):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    assert torch.get_num_threads() == 1
    torch.set_num_threads(threads)


def test_a_stale_engine_samples_its_old_weights_until_told(engine, model):
    """Weights changed without `weights_changed`: the engine still samples the pushed ones (the gap is
    large); told, it pushes once and samples the new ones."""
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    pushes = engine.refreshes
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.add_(0.5)
    assert sampled_gap(engine, model) > 1e-3
    engine.weights_changed()
    assert sampled_gap(engine, model) < 1e-5
    assert engine.refreshes == pushes + 1
    assert sampled_gap(engine, model) < 1e-5 and engine.refreshes == pushes + 1, "pushed once"
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(saved[n])
    engine.weights_changed()
