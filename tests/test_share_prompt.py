"""Encoding each group's prompt once (`grpo.scoring.share_prompt`, Prefix Grouper arXiv:2506.05433) changes no
number: hidden states, log-probs, entropies and gradients equal the unshared path's, and generation from a
shared prefill draws the same tokens. The 2-process FSDP2 and DDP runs of tests/test_distributed.py compare a
shared distributed update with an unshared single-process one."""

import functools

import lightning as L
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
)

from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.generation.logprobs import completion_logprobs, position_ids
from grpo_lightning.core.generation.sampling import (
    Rollout,
    SamplingSettings,
    generate_completions,
    prefill_groups,
)
from grpo_lightning.core.generation.scorer import rows_share_prompts
from grpo_lightning.core.generation.shared_prompt import (
    group_completion_logprobs,
    shared_prompt_hidden,
    sharing_unsupported,
)
from grpo_lightning.core.rewards.verifiable import completion_text
from grpo_lightning.io.models import LoraOptions, apply_lora
from grpo_lightning.training.data import GSM8KDataModule
from grpo_lightning.training.module import GRPOModule
from tests.helpers import quiet_trainer, sliding_window_model

PROMPTS = ["Natalia sold 48 clips in April and", "Weng", "How many clips did she sell in May?"]


def make_rollout(tokenizer, num_generations: int, T: int = 6, seed: int = 0) -> Rollout:
    """3 left-padded prompts of different lengths, G random completions each, some ended early (mask 0)."""
    enc = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    G, n = num_generations, len(PROMPTS)
    g = torch.Generator().manual_seed(seed)
    completion_ids = torch.randint(3, len(tokenizer), (n * G, T), generator=g)  # [B, T]
    lengths = torch.randint(1, T + 1, (n * G,), generator=g)  # [B]
    completion_mask = (torch.arange(T)[None, :] < lengths[:, None]).long()  # [B, T]
    completion_ids = completion_ids.masked_fill(completion_mask == 0, tokenizer.pad_token_id)
    return Rollout(
        enc["input_ids"].repeat_interleave(G, 0),
        enc["attention_mask"].repeat_interleave(G, 0),
        completion_ids,
        completion_mask,
        lengths == T,
    )


def load_tiny(model_dir: str, dtype: torch.dtype, lora: bool = False, checkpointing: bool = False):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora:
        model = apply_lora(model, LoraOptions(r=4))
        for name, p in model.named_parameters():
            if (
                "lora_B" in name
            ):  # PEFT starts B at zero: the adapter would change nothing, nor get A's gradient
                torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(1))
    return model.train()


def float64_norms(model) -> None:
    """LlamaRMSNorm computes in float32 whatever its dtype: summing G rows' gradients before it (shared) or
    after it (unshared) then differs at float32 precision. A float64 norm leaves only the sharing's maths."""

    def rms_norm(norm, hidden: torch.Tensor) -> torch.Tensor:
        return (
            norm.weight * hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
        )

    norms = [m for m in model.modules() if type(m).__name__ == "LlamaRMSNorm"]
    assert norms
    for norm in norms:
        norm.forward = functools.partial(rms_norm, norm)


def micro_batches(size: int, step: int | None) -> list[slice]:
    step = step or size
    return [slice(i, min(i + step, size)) for i in range(0, size, step)]


def grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


class LayerCalls:
    """The batch and length of every run of the first decoder layer's MLP (a checkpointed layer runs it
    again in backward; the layer's own hooks would not see that, checkpointing wraps inside them)."""

    def __init__(self, model) -> None:
        self.shapes: list[tuple[int, int]] = []
        mlp = model.get_decoder().layers[0].mlp
        mlp.register_forward_pre_hook(lambda module, args: self.shapes.append(tuple(args[0].shape[:2])))


@pytest.mark.parametrize(
    "G, micro_batch, lora, checkpointing",
    [
        (2, None, False, False),
        (4, 4, False, True),  # micro-batch = one group, checkpointed layers
        (3, 2, True, False),  # micro-batches cut groups; LoRA
        (3, 5, True, True),
    ],
)
def test_shared_hidden_states_and_gradients_equal_unshared_in_float64(
    tiny_model_dir, G, micro_batch, lora, checkpointing
):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir, padding_side="left")
    model = load_tiny(tiny_model_dir, torch.float64, lora, checkpointing)
    float64_norms(model)
    rollout = make_rollout(tok, G)
    assert (rollout.prompt_mask == 0).any(), "the prompts must be padded"
    P, T = rollout.prompt_ids.size(1), rollout.completion_ids.size(1)
    weights = torch.randn(*rollout.completion_ids.shape, 64, dtype=torch.float64)  # [B, T, H]
    decoder = model.get_decoder()
    calls = LayerCalls(model)

    expected, expected_grads = [], {}
    for rows in micro_batches(rollout.completion_ids.size(0), micro_batch):
        mask = rollout.attention_mask[rows]
        hidden = decoder(
            input_ids=rollout.input_ids[rows], attention_mask=mask, position_ids=position_ids(mask)
        )
        hidden = hidden.last_hidden_state[:, P - 1 : -1]  # [b, T, H] the states predicting the completion
        (hidden * weights[rows]).sum().backward()
        expected.append(hidden.detach())
    expected_grads = grads(model)
    calls.shapes.clear()

    got = []
    for rows in micro_batches(rollout.completion_ids.size(0), micro_batch):
        start, stop, _ = rows.indices(rollout.completion_ids.size(0))
        first = start // G
        groups = torch.arange(start, stop) // G - first
        hidden = shared_prompt_hidden(
            model,
            rollout.prompt_ids[first * G : stop : G],
            rollout.prompt_mask[first * G : stop : G],
            groups,
            rollout.completion_ids[rows],
            rollout.completion_mask[rows],
        )
        (hidden * weights[rows]).sum().backward()
        got.append(hidden.detach())
        # One prompt pass per group the micro-batch touches, then the completions but their last token.
        n = int(groups.max()) + 1
        assert calls.shapes[:2] == [(n, P), (stop - start, T - 1)]
        # Checkpointed layers run again in backward; with the cache kept, not dropped (it would fail above).
        assert len(calls.shapes) == (4 if checkpointing else 2)
        calls.shapes.clear()
    torch.testing.assert_close(torch.cat(got), torch.cat(expected), rtol=0, atol=1e-10)
    got_grads = grads(model)
    assert got_grads.keys() == expected_grads.keys() and len(got_grads) > 0
    for name, grad in expected_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=0, atol=1e-10, msg=name)
    if lora:
        assert all("lora" in name for name in got_grads)


@pytest.mark.parametrize("G, micro_batch, lora", [(2, None, False), (3, 4, True)])
def test_shared_logprobs_entropies_and_gradients_equal_unshared_in_float32(
    tiny_model_dir, G, micro_batch, lora
):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir, padding_side="left")
    model = load_tiny(tiny_model_dir, torch.float32, lora)
    rollout = make_rollout(tok, G, seed=1)
    mask = rollout.completion_mask.float()  # [B, T]
    advantages = torch.randn(mask.size(0), 1, generator=torch.Generator().manual_seed(2))  # [B, 1]
    options = {"temperature": 0.7, "with_entropy": True, "entropy_grad": True}

    def run(scorer) -> tuple[torch.Tensor, torch.Tensor, dict]:
        logprobs, entropies = [], []
        for rows in micro_batches(mask.size(0), micro_batch):
            lp, ent = scorer(rows)
            (-(lp * advantages[rows] * mask[rows]).sum() - 0.1 * (ent * mask[rows]).sum()).backward()
            logprobs.append(lp.detach())
            entropies.append(ent.detach())
        return torch.cat(logprobs), torch.cat(entropies), grads(model)

    T = rollout.completion_ids.size(1)
    expected = run(
        lambda r: completion_logprobs(model, rollout.input_ids[r], rollout.attention_mask[r], T, **options)
    )
    got = run(lambda r: group_completion_logprobs(model, rollout, r, G, **options))
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(got[1], expected[1], rtol=0, atol=1e-5)
    for name, grad in expected[2].items():
        torch.testing.assert_close(got[2][name], grad, rtol=1e-4, atol=1e-5, msg=name)
    if lora:  # the reference: the same weights with the adapter off, no gradient
        with torch.no_grad(), model.disable_adapter():
            on = group_completion_logprobs(model, rollout, slice(None), G)[0]
            off = completion_logprobs(model, rollout.input_ids, rollout.attention_mask, T)[0]
        torch.testing.assert_close(on, off, rtol=0, atol=1e-5)
        assert (on - got[0]).abs().max() > 1e-3, "the adapter was not switched off"


def test_absolute_position_embeddings_see_the_same_positions(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir, padding_side="left")
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=4)
    model = GPT2LMHeadModel(config).double().eval()  # eval: no dropout
    assert sharing_unsupported(model) is None
    rollout = make_rollout(tok, 2)
    T = rollout.completion_ids.size(1)
    with torch.no_grad():
        got = group_completion_logprobs(model, rollout, slice(None), 2)[0]
        expected = completion_logprobs(model, rollout.input_ids, rollout.attention_mask, T)[0]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    # GPT-2 drops any cache under gradient checkpointing: scoring stops instead of ignoring the prompt.
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with pytest.raises(RuntimeError, match="GPT2Model ignored the KV cache of the shared prompt"):
        group_completion_logprobs(model.train(), rollout, slice(None), 2)


def test_rows_of_a_group_must_share_their_prompt(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir, padding_side="left")
    model = load_tiny(tiny_model_dir, torch.float32)
    rollout = make_rollout(tok, 3)
    assert rows_share_prompts(rollout, 3) and not rows_share_prompts(rollout, 2)  # the module's test
    with pytest.raises(ValueError, match="do not share their prompt: is num_generations right"):
        group_completion_logprobs(model, rollout, slice(None), 2)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_generation_from_a_shared_prefill_draws_the_same_tokens(tiny_model_dir, dtype):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype).train()
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    G = 4
    settings = SamplingSettings(
        max_new_tokens=12,
        eos_token_ids=(tok.eos_token_id,),
        pad_token_id=tok.pad_token_id,
        temperature=0.8,
        top_k=50,
    )
    rollouts = []
    for shared in (False, True):
        torch.manual_seed(3)
        cache = prefill_groups(model, enc["input_ids"], enc["attention_mask"], G) if shared else None
        rollouts.append(
            generate_completions(
                model,
                enc["input_ids"],
                enc["attention_mask"],
                settings,
                num_generations=G,
                prompt_cache=cache,
            )
        )
    unshared, shared = rollouts
    assert model.training, "the prefill restores training mode"
    assert len({tuple(row.tolist()) for row in shared.completion_ids}) > 6, (
        "the rows sampled different tokens"
    )
    torch.testing.assert_close(shared.completion_ids, unshared.completion_ids, rtol=0, atol=0)
    torch.testing.assert_close(shared.prompt_ids, unshared.prompt_ids, rtol=0, atol=0)
    # The prefill encoded each prompt once: the cache has N rows per prompt token before the repeat.
    cache = prefill_groups(model, enc["input_ids"], enc["attention_mask"], G)
    (keys,) = {layer.keys.shape[:1] + layer.keys.shape[2:3] for layer in next(iter(cache.values())).layers}
    assert keys == (len(PROMPTS) * G, enc["input_ids"].size(1) - 1)


def test_a_model_that_cannot_share_falls_back_with_one_warning(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    module = GRPOModule(sliding_window_model(len(tok)), tokenizer=tok, grpo=GRPOConfig(num_generations=2))
    assert "not all full attention" in sharing_unsupported(module.policy)
    with pytest.warns(
        UserWarning,
        match="grpo.scoring.share_prompt, grpo.scoring.packed_sequences: its attention layers are not all",
    ):
        assert module.rollouts.shares_prompt is False
    assert module.rollouts.shares_prompt is False  # decided once


class PlainSGD(GRPOModule):
    """The update is -lr * gradient (AdamW's first step is about lr * sign(gradient): gradients of ~1e-9
    that differ in sign by rounding would move a weight by 2 lr)."""

    def configure_optimizers(self):
        sgd = torch.optim.SGD([p for p in self.policy.parameters() if p.requires_grad], lr=0.1)
        return [sgd], [torch.optim.lr_scheduler.ConstantLR(sgd, factor=1.0)]


def one_step(model_dir: str, share: bool) -> GRPOModule:
    """One GRPO step: beta > 0, two passes over the rollout (old-policy log-probs), micro-batches of 4 rows
    that cut the groups of 3."""
    L.seed_everything(0, verbose=False)
    module = PlainSGD(
        model_dir,
        reward_funcs=[lambda completions, **kw: [float(len(completion_text(c)) % 3) for c in completions]],
        grpo=GRPOConfig(
            num_generations=3,
            max_completion_length=5,
            beta=0.04,
            num_iterations=2,
            micro_batch_size=4,
            share_prompt=share,
            preflight=False,
            log_completions_every=0,
        ),
    )
    data = GSM8KDataModule(
        source="arithmetic", system_prompt=None, arithmetic_size=8, batch_size=2, val_size=2
    )
    quiet_trainer(max_steps=1, limit_val_batches=0).fit(module, data)
    assert module.rollouts.shares_prompt is share
    return module


def test_a_shared_training_step_samples_and_updates_as_an_unshared_one(tiny_model_dir):
    shared, unshared = one_step(tiny_model_dir, True), one_step(tiny_model_dir, False)
    assert shared.last_rollout.completions == unshared.last_rollout.completions
    expected = dict(unshared.policy.named_parameters())
    initial = dict(AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters())
    for name, value in shared.policy.named_parameters():
        assert not torch.equal(value, initial[name]), f"{name} did not move"
        torch.testing.assert_close(value, expected[name], rtol=1e-4, atol=1e-6, msg=name)
