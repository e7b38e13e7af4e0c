"""Sampling and scoring agree: the loss sees the log-probs of the distribution the sampler drew from."""

import math

import pytest
import torch
from torch import Tensor
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
)

from grpo_lightning.core.generation import sampling
from grpo_lightning.core.generation.logprobs import _token_logprobs_and_entropy, completion_logprobs
from grpo_lightning.core.generation.sampling import InverseCDFSampler, SamplingSettings, generate_completions
from grpo_lightning.io.models import LoraOptions, apply_lora


@pytest.mark.parametrize("architecture", ["llama", "gpt2"])
def test_logprobs_match_generate_scores_with_left_padding(tiny_model_dir, architecture):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir, padding_side="left")
    if architecture == "llama":  # rotary positions: indifferent to the padding's shift
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    else:  # absolute position embeddings: wrong positions would change every log-prob of a padded row
        torch.manual_seed(0)
        config = GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=4, n_positions=256)
        model = GPT2LMHeadModel(config).eval()
    enc = tok(["Natalia sold 48 clips in April and", "Weng"], return_tensors="pt", padding=True)
    assert (enc["attention_mask"] == 0).any()
    out = model.generate(
        **enc,
        max_new_tokens=6,
        min_new_tokens=6,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=tok.pad_token_id,
    )
    completion = out.sequences[:, enc["input_ids"].size(1) :]  # [B, T]
    expected = torch.stack(
        [
            torch.log_softmax(s.float(), -1).gather(-1, completion[:, t : t + 1]).squeeze(-1)
            for t, s in enumerate(out.logits)
        ],
        dim=1,
    )  # [B, T]
    mask = torch.cat([enc["attention_mask"], torch.ones_like(completion)], dim=1)
    with torch.no_grad():
        logprobs, _ = completion_logprobs(model, out.sequences, mask, completion.size(1))
    torch.testing.assert_close(logprobs, expected, atol=1e-4, rtol=0)


def test_inverse_cdf_sampler_draws_the_softmax_distribution():
    torch.manual_seed(0)
    scores = torch.tensor([[2.0, 1.0, 0.0, -1.0, -math.inf]]).repeat(20000, 1)  # [N, V]
    draws = InverseCDFSampler()(None, scores).argmax(dim=-1)  # the one 0 among -inf
    freq = torch.bincount(draws, minlength=5).float() / draws.numel()
    probs = torch.softmax(scores[0], -1)
    # 4 standard deviations of a binomial frequency.
    tolerance = 4 * torch.sqrt(probs * (1 - probs) / draws.numel()) + 1e-9
    assert (freq - probs).abs().le(tolerance).all(), (freq, probs)
    assert freq[4] == 0  # a token of probability 0 is never drawn


class HeadOnly(torch.nn.Module):
    """A model whose decoder returns fixed hidden states: only the LM head and its log-softmax run."""

    config = LlamaConfig()  # a plain head: no transform of the logits

    def __init__(self, hidden: Tensor, head: torch.nn.Module) -> None:
        super().__init__()
        self.hidden, self.head = hidden, head

    def get_decoder(self):
        return lambda input_ids, attention_mask, position_ids: type(
            "O", (), {"last_hidden_state": self.hidden}
        )()

    def get_output_embeddings(self):
        return self.head


def test_written_head_backward_matches_autograd():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=False).double()
    hidden = torch.randn(2, 7, 8, dtype=torch.float64)
    targets = torch.randint(0, 50, (2, 4))

    for chunk_elements in (10_000, 60):  # one chunk (logits kept) and several (recomputed)
        h = hidden.clone().requires_grad_()
        ids = torch.cat([torch.zeros(2, 3, dtype=torch.long), targets], 1)
        lp, _ = completion_logprobs(
            HeadOnly(h, head),
            ids,
            torch.ones_like(ids),
            4,
            temperature=0.7,
            max_logits_elements=chunk_elements,
        )
        (lp * torch.arange(8.0, dtype=torch.float64).view(2, 4)).sum().backward()
        h_ref = hidden.clone().requires_grad_()
        ref, _ = _token_logprobs_and_entropy(
            head, h_ref[:, 2:6].reshape(-1, 8), targets.reshape(-1), 0.7, False
        )
        (ref.view(2, 4) * torch.arange(8.0, dtype=torch.float64).view(2, 4)).sum().backward()
        torch.testing.assert_close(lp, ref.view(2, 4).float())
        torch.testing.assert_close(h.grad, h_ref.grad)
        head.weight.grad = None


def test_completion_mask_stops_after_first_eos(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir, padding_side="left")
    enc = tok(["a b c"], return_tensors="pt")
    torch.manual_seed(0)
    rollout = generate_completions(
        model,
        enc["input_ids"],
        enc["attention_mask"],
        SamplingSettings(max_new_tokens=5, eos_token_ids=(tok.eos_token_id,), pad_token_id=tok.pad_token_id),
        num_generations=4,
    )
    assert rollout.completion_ids.shape[0] == 4
    n = rollout.completion_mask.sum(1)
    assert ((n == 5) | ~rollout.truncated).all()


def off_policy_generation_config(model, tokenizer) -> None:
    """A checkpoint generation config that changes what `generate` samples, as Qwen2.5-Instruct's
    repetition penalty does, plus suppressed and banned tokens: half the vocabulary in all."""
    vocab = model.config.vocab_size
    special = set(tokenizer.all_special_ids)
    config = model.generation_config
    config.repetition_penalty = 1.5
    config.suppress_tokens = [i for i in range(0, vocab, 2) if i not in special]
    config.bad_words_ids = [[i] for i in range(1, 40, 2) if i not in special]
    config.no_repeat_ngram_size = 2
    config.min_length = 1000  # would suppress EOS throughout
    config.top_k, config.temperature, config.do_sample = 3, 0.1, True


class RecordingSampler(InverseCDFSampler):
    """Records the log-probability of each drawn token under the scores it was drawn from: what `generate`'s
    own processors left of the policy's distribution."""

    recorded: list[Tensor] = []

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        out = super().__call__(input_ids, scores)
        drawn = out.argmax(-1, keepdim=True)  # [B, 1]
        RecordingSampler.recorded.append(torch.log_softmax(scores.float(), -1).gather(-1, drawn).squeeze(-1))
        return out


def test_sampled_tokens_are_drawn_from_the_distribution_the_loss_scores(tiny_model_dir, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir, padding_side="left")
    off_policy_generation_config(model, tok)
    monkeypatch.setattr(sampling, "InverseCDFSampler", RecordingSampler)
    RecordingSampler.recorded = []
    enc = tok(["Natalia sold 48 clips", "Weng earns"], return_tensors="pt", padding=True)
    torch.manual_seed(0)
    rollout = generate_completions(
        model,
        enc["input_ids"],
        enc["attention_mask"],
        SamplingSettings(
            max_new_tokens=12,
            eos_token_ids=(tok.eos_token_id,),
            pad_token_id=tok.pad_token_id,
            temperature=0.7,
        ),
        num_generations=4,
    )
    T = rollout.completion_ids.size(1)
    recorded = torch.stack(RecordingSampler.recorded, dim=1)[:, :T]  # [B, T] at sampling time
    with torch.no_grad():
        scored, _ = completion_logprobs(model, rollout.input_ids, rollout.attention_mask, T, temperature=0.7)
    mask = rollout.completion_mask.bool()
    torch.testing.assert_close(recorded[mask], scored[mask], atol=1e-5, rtol=0)
    assert model.generation_config.repetition_penalty == 1.5  # the checkpoint's config is left as it was


def test_token_frequencies_match_the_raw_policy(tiny_model_dir):
    """One token, 4000 draws: the share of the tokens that the checkpoint's config suppresses or bans is
    what the raw policy gives them (0 if generate applied the config)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir, padding_side="left")
    off_policy_generation_config(model, tok)
    banned = set(model.generation_config.suppress_tokens) | {
        w[0] for w in model.generation_config.bad_words_ids
    }
    enc = tok(["Natalia sold 48 clips"], return_tensors="pt")
    torch.manual_seed(0)
    rollout = generate_completions(
        model,
        enc["input_ids"],
        enc["attention_mask"],
        SamplingSettings(max_new_tokens=1, eos_token_ids=(tok.eos_token_id,), pad_token_id=tok.pad_token_id),
        num_generations=4000,
    )
    with torch.no_grad():
        probs = model(**enc).logits[0, -1].float().softmax(-1)  # [V] the raw policy
    expected = float(probs[sorted(banned)].sum())
    share = sum(int(t) in banned for t in rollout.completion_ids[:, 0]) / 4000
    assert 0.3 < expected < 0.7
    assert abs(share - expected) < 4 * math.sqrt(expected * (1 - expected) / 4000), (share, expected)


@pytest.mark.parametrize("lora", [False, True])
def test_greedy_decoding_takes_the_raw_policys_argmax(tiny_model_dir, lora):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir, padding_side="left")
    off_policy_generation_config(model, tok)
    if lora:  # PEFT's generate hands the wrapped model's generation config down: the same must hold
        model = apply_lora(model, LoraOptions(r=4)).eval()
    enc = tok(["Natalia sold 48 clips", "Weng earns"], return_tensors="pt", padding=True)
    rollout = generate_completions(
        model,
        enc["input_ids"],
        enc["attention_mask"],
        SamplingSettings(max_new_tokens=8, eos_token_ids=(tok.eos_token_id,), pad_token_id=tok.pad_token_id),
        num_generations=1,
        do_sample=False,
    )
    T = rollout.completion_ids.size(1)
    with torch.no_grad():
        logits = model(input_ids=rollout.input_ids, attention_mask=rollout.attention_mask).logits
    greedy = logits[:, -T - 1 : -1].argmax(-1)  # [B, T]
    mask = rollout.completion_mask.bool()
    assert torch.equal(rollout.completion_ids[mask], greedy[mask])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("chunk_elements", [2**20, 300], ids=["kept", "recomputed"])
def test_written_head_backward_is_exact_under_autocast(dtype, chunk_elements):
    """float32 weights under autocast (Lightning's bf16-mixed / 16-mixed): the written backward gives the
    gradient that autograd gives through the same autocast ops, whether it keeps or recomputes the logits."""
    torch.manual_seed(0)
    V, H = 400, 32
    head = torch.nn.Linear(H, V, bias=False)
    head.weight.data.mul_(16.0)  # logits of tens, as a trained model's: their rounding matters
    hidden = torch.randn(2, 9, H)
    targets = torch.randint(0, V, (2, 6))
    ids = torch.cat([torch.zeros(2, 3, dtype=torch.long), targets], 1)  # [2, 9]
    weights = torch.randn(2, 6)

    h = hidden.clone().requires_grad_()
    with torch.autocast("cpu", dtype=dtype):
        lp, _ = completion_logprobs(
            HeadOnly(h, head),
            ids,
            torch.ones_like(ids),
            6,
            temperature=0.7,
            max_logits_elements=chunk_elements,
        )
    (lp * weights).sum().backward()
    grads = h.grad, head.weight.grad
    head.weight.grad = None

    h_ref = hidden.clone().requires_grad_()
    with torch.autocast("cpu", dtype=dtype):
        logits = (h_ref[:, 2:8] @ head.weight.T).float() / 0.7  # [2, 6, V] the autocast matmul, upcast
    ref = logits.log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)  # [2, 6]
    (ref * weights).sum().backward()
    torch.testing.assert_close(lp, ref, rtol=0, atol=1e-5)
    assert grads[0].dtype == torch.float32 and grads[1].dtype == torch.float32
    # Measured before the backward ran under autocast: 2.7% (bf16) and 0.6% (fp16) relative error with
    # recomputed logits, 0.3% and 0.03% with kept ones. Now the hidden states' gradient is autograd's; the
    # weight's differs only where chunks are rounded to bf16 one by one before their float32 sum (0.08%).
    error = (grads[0] - h_ref.grad).norm() / h_ref.grad.norm()
    assert error < 1e-5, error
    error = (grads[1] - head.weight.grad).norm() / head.weight.grad.norm()
    assert error < 2e-3, error


@pytest.mark.parametrize(
    ("architecture", "options"),
    [
        ("gemma2", {"final_logit_softcapping": 2.0, "head_dim": 8}),
        ("cohere", {"logit_scale": 3.0}),
        ("granite", {"logits_scaling": 0.25}),
    ],
)
def test_models_that_transform_their_logits_are_scored_with_the_logits_they_sample_from(
    architecture, options
):
    config = AutoConfig.for_model(
        architecture,
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        **options,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    torch.nn.init.normal_(model.get_output_embeddings().weight, std=1.0)  # logits large enough to cap
    ids = torch.randint(0, 96, (2, 10))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.float()  # [2, 10, V] what generate samples
    expected = (logits[:, 3:-1] / 0.8).log_softmax(-1).gather(-1, ids[:, 4:, None]).squeeze(-1)  # [2, 6]
    scored, _ = completion_logprobs(model, ids, mask, 6, temperature=0.8)
    torch.testing.assert_close(scored, expected, atol=1e-5, rtol=1e-5)
    scored.sum().backward()  # the gradient reaches the head through the transform
    assert model.get_output_embeddings().weight.grad.abs().sum() > 0


def test_an_unknown_logit_transform_is_refused():
    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4
    )
    config.logits_scaling = 2.0  # HyperCLOVAX multiplies by it, Granite divides: unknown here
    model = AutoModelForCausalLM.from_config(config)
    ids = torch.randint(0, 64, (1, 6))
    with pytest.raises(ValueError, match=r"logits_scaling=2.0.*not supported"):
        completion_logprobs(model, ids, torch.ones_like(ids), 3)
