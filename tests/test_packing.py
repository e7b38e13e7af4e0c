"""Padding-free passes (`scoring.packed_sequences`): rows packed end to end into lines give every completion
token exactly the context it has in its padded row, so the log-probs, the loss and the gradients are the
padded path's, shared prompt or not."""

import lightning as L
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.generation.logprobs import completion_logprobs
from grpo_lightning.core.generation.packing import (
    PackedLogProbScorer,
    pack_rows,
    packed_completion_logprobs,
    packing_unsupported,
)
from grpo_lightning.core.ranks import OneProcess
from grpo_lightning.core.types import Rollout
from grpo_lightning.core.update import (
    MicroBatchSums,
    logprobs_in_micro_batches,
    micro_batch_losses,
    micro_batches,
    mini_batch_denominators,
)
from grpo_lightning.training.data import GSM8KDataModule
from tests.helpers import length_reward, quiet_trainer, sliding_window_model, tiny_module
from tests.test_share_prompt import PlainSGD, float64_norms, grads, load_tiny, make_rollout
from tests.test_token_budget import float64_trajectory


def random_rollout(prompt_lengths: list[int], completion_lengths: list[int], G: int, T: int) -> Rollout:
    """Token ids that say where they are: prompt i's token j is 1000 * (i + 1) + j, row r's completion
    token t is 100000 * (r + 1) + t; 0 is padding."""
    N, P = len(prompt_lengths), max(prompt_lengths)
    prompt_ids = torch.zeros(N * G, P, dtype=torch.long)
    prompt_mask = torch.zeros(N * G, P, dtype=torch.long)
    for i, p in enumerate(prompt_lengths):
        prompt_ids[i * G : (i + 1) * G, P - p :] = 1000 * (i + 1) + torch.arange(p)
        prompt_mask[i * G : (i + 1) * G, P - p :] = 1
    lengths = torch.tensor(completion_lengths)  # [B]
    completion_mask = (torch.arange(T)[None, :] < lengths[:, None]).long()  # [B, T]
    completion_ids = (100000 * (torch.arange(N * G)[:, None] + 1) + torch.arange(T)) * completion_mask
    return Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, lengths == T)


@settings(max_examples=150, deadline=None)
@given(
    G=st.integers(1, 4),
    prompts=st.lists(st.integers(1, 12), min_size=1, max_size=4),
    shared=st.booleans(),
    scores_per_position=st.sampled_from([1.0, 30.0, 1e9]),
    data=st.data(),
)
def test_every_token_sees_its_padded_context(G, prompts, shared, scores_per_position, data):
    """For every scored token: the position that predicts it holds the token before it, and under the
    mask that position sees exactly its row's prompt and completion so far, at the padded row's positions
    (whatever the line width chosen, the slice, the sharing)."""
    T = data.draw(st.integers(1, 10))
    B = len(prompts) * G
    lengths = data.draw(st.lists(st.integers(1, T), min_size=B, max_size=B))
    start = data.draw(st.integers(0, B - 1))
    stop = data.draw(st.integers(start + 1, B))
    rollout = random_rollout(prompts, lengths, G, T)
    packed = pack_rows(rollout, slice(start, stop), G if shared else None, scores_per_position)

    ids, positions = packed.input_ids.reshape(-1), packed.position_ids.reshape(-1)  # [lines * W]
    visible = packed.attention_mask("sdpa", torch.float32)[:, 0]  # [lines, W, W]
    W = packed.input_ids.size(1)
    assert packed.source.numel() == sum(lengths[start:stop]) == int(packed.scored.sum())
    source = iter(packed.source.tolist())
    for r in range(start, stop):
        p = prompts[r // G]
        prompt = [(1000 * (r // G + 1) + j, j) for j in range(p)]
        for t in range(lengths[r]):
            at = next(source)
            context = prompt + [(100000 * (r + 1) + j, p + j) for j in range(t)]  # (token, position)
            assert (int(ids[at]), int(positions[at])) == context[-1]  # the token before it
            line, column = divmod(at, W)
            seen = visible[line, column].nonzero().squeeze(1) + line * W
            assert sorted(zip(ids[seen].tolist(), positions[seen].tolist(), strict=True)) == sorted(context)
    # Positions that predict nothing are padding only where the lines end.
    assert int((packed.segment == -1).sum()) < packed.segment.numel()


def test_a_shared_line_holds_the_prompt_once():
    """Four completions of one prompt: whichever width is chosen, the prompt is copied at most as many
    times as there are lines, and fewer positions run than in the padded rows."""
    rollout = random_rollout([6], [3, 1, 2, 3], G=4, T=3)
    shared = pack_rows(rollout, slice(None), 4, scores_per_position=1e9)
    unshared = pack_rows(rollout, slice(None), None, scores_per_position=1e9)
    prompt_tokens = lambda packed: int(((packed.input_ids >= 1000) & (packed.input_ids < 2000)).sum())  # noqa: E731
    assert prompt_tokens(shared) == 6 and shared.input_ids.numel() == 6 + 2 + 0 + 1 + 2
    assert prompt_tokens(unshared) == 4 * 6 and unshared.input_ids.numel() >= 4 * 6 + 5
    assert shared.input_ids.numel() < 4 * (6 + 3)  # the padded rows


def test_bad_rows_are_refused():
    rollout = random_rollout([3], [2, 2], G=2, T=2)
    with pytest.raises(ValueError, match="non-empty contiguous slice"):
        pack_rows(rollout, slice(1, 1))
    rollout.prompt_mask[1] = 0
    with pytest.raises(ValueError, match="row 1 has an empty prompt"):
        pack_rows(rollout, slice(None))
    rollout = random_rollout([3], [2, 2], G=2, T=2)
    rollout.completion_mask[0] = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="completion_mask must be 1 on a prefix"):
        pack_rows(rollout, slice(None))


@pytest.mark.parametrize(
    "share_prompt, lora, checkpointing",
    [(True, False, False), (False, False, False), (True, True, True)],
    ids=["shared", "unshared", "shared-lora-checkpointed"],
)
def test_packed_passes_give_the_padded_loss_and_gradients_in_float64(
    tiny_model_dir, share_prompt, lora, checkpointing
):
    """Fixed micro-batches of 5 rows (which cut the groups of 4) and token-budget ones: the packed frozen
    passes give the padded passes' log-probs on every completion token (0 after each row's end), and the
    packed policy pass their loss and gradients, with a sequence-level (grpo) and a token-level (dapo)
    normalisation across micro-batches. Packing changes the log-probs' computation only: the loss types
    of tests/test_token_budget.py read them alike."""
    model, scorer, trajectory = float64_trajectory(tiny_model_dir, share_prompt)
    if lora or checkpointing:
        torch.manual_seed(0)  # LoRA's A matrices start random: the same adapter whatever test ran before
        model = load_tiny(tiny_model_dir, torch.float64, lora, checkpointing)
        float64_norms(model)
    packed = PackedLogProbScorer(**vars(scorer))
    rollout, mask = trajectory.rollout, trajectory.completion_mask.bool()
    denominators = mini_batch_denominators(trajectory, OneProcess())
    fixed = micro_batches(rollout, 5)
    budget = micro_batches(rollout, None, 60, 4 if share_prompt else 1)
    cases = [(fixed, "dapo")] if lora else [(fixed, "grpo"), (fixed, "dapo"), (budget, "dapo")]
    for parts, loss_type in cases:
        padded_logprobs = logprobs_in_micro_batches(scorer, model, rollout, parts)
        packed_logprobs = logprobs_in_micro_batches(packed, model, rollout, parts)
        torch.testing.assert_close(packed_logprobs[mask], padded_logprobs[mask], rtol=1e-6, atol=1e-9)
        assert (packed_logprobs[~mask] == 0).all() and (~mask).any()
        cfg = GRPOConfig(num_generations=4, max_completion_length=12, beta=0.04, loss_type=loss_type)
        results = []
        for score in (scorer, packed):
            sums = MicroBatchSums()
            for loss in micro_batch_losses(score, model, trajectory, parts, cfg, *denominators, sums):
                loss.backward()
            results.append((sums.values, grads(model)))
        (expected, expected_grads), (got, got_grads) = results
        assert abs(float(expected["loss"])) > 1e-4, loss_type
        for key, value in expected.items():  # float32 sums (the log-probs are float32)
            torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-7, msg=f"{loss_type} {key}")
        assert got_grads.keys() == expected_grads.keys() and len(got_grads) > 0
        for name, grad in expected_grads.items():
            torch.testing.assert_close(got_grads[name], grad, rtol=1e-6, atol=1e-9, msg=f"{loss_type} {name}")
        if lora:
            assert all("lora" in name for name in got_grads)


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "unshared"])
def test_eager_attention_takes_the_additive_mask(tiny_model_dir, shared):
    """Eager attention reads an additive float mask: the same log-probs, entropies and gradients as its
    padded rows, in float32 (its padded path gives NaN in float64, a transformers matter)."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager").train()
    assert packing_unsupported(model) is None
    rollout = make_rollout(tok, 3, T=8, seed=2)
    mask = rollout.completion_mask.bool()
    T = rollout.completion_ids.size(1)
    results = []
    for packed in (False, True):
        if packed:
            lp, ent = packed_completion_logprobs(
                model, rollout, slice(None), 3 if shared else None, with_entropy=True
            )
        else:
            lp, ent = completion_logprobs(
                model, rollout.input_ids, rollout.attention_mask, T, with_entropy=True
            )
        (lp * mask).sum().backward()
        results.append((lp[mask].detach(), ent[mask], grads(model)))
    (lp, ent, expected_grads), (packed_lp, packed_ent, packed_grads) = results
    torch.testing.assert_close(packed_lp, lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(packed_ent, ent, rtol=0, atol=1e-5)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_absolute_position_embeddings_see_the_padded_positions(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir, padding_side="left")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=4)).double().eval()
    assert packing_unsupported(model) is None
    rollout = make_rollout(tok, 2)
    mask = rollout.completion_mask.bool()
    with torch.no_grad():
        expected = completion_logprobs(model, rollout.input_ids, rollout.attention_mask, mask.size(1))[0]
        for group_size in (2, None):
            got = packed_completion_logprobs(model, rollout, slice(None), group_size)[0]
            torch.testing.assert_close(got[mask], expected[mask], rtol=0, atol=1e-10)


def test_a_model_that_cannot_pack_falls_back_with_one_warning(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    flash = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    flash.config._attn_implementation = "flash_attention_2"  # its mask format; nothing runs here
    assert "'flash_attention_2' takes no 4-D mask" in packing_unsupported(flash)
    module = tiny_module(tiny_model_dir, num_generations=2)
    module.policy = module.rollouts.policy = sliding_window_model(len(tok))
    with pytest.warns(
        UserWarning,
        match="grpo.scoring.share_prompt, grpo.scoring.packed_sequences: its attention layers are not all",
    ):
        assert module.rollouts.packs_sequences is False
    assert module.rollouts.packs_sequences is False  # decided once


def one_step(model_dir: str, packed: bool):
    """One GRPO step with the reference, old-policy and policy passes (beta > 0, two iterations),
    micro-batches of 3 rows that cut the groups of 4."""
    L.seed_everything(0, verbose=False)
    module = tiny_module(
        model_dir,
        PlainSGD,  # AdamW's first step, about lr x sign(gradient), would magnify rounding
        reward_funcs=[length_reward],
        num_generations=4,
        beta=0.04,
        num_iterations=2,
        micro_batch_size=3,
        packed_sequences=packed,
    )
    data = GSM8KDataModule(
        source="arithmetic", system_prompt=None, arithmetic_size=8, batch_size=2, val_size=2
    )
    # One rollout, two optimizer steps (num_iterations): the second scores a moved policy, so KL > 0.
    trainer = quiet_trainer(max_steps=2, limit_val_batches=0)
    trainer.fit(module, data)
    assert module.rollouts.packs_sequences is packed
    return module, trainer.callback_metrics


def test_a_packed_training_step_updates_as_a_padded_one(tiny_model_dir):
    (packed, packed_metrics), (padded, padded_metrics) = (
        one_step(tiny_model_dir, True),
        one_step(tiny_model_dir, False),
    )
    assert packed.last_rollout.completions == padded.last_rollout.completions
    for key in ("train/policy_loss", "train/kl", "train/grad_norm"):
        assert float(packed_metrics[key]) == pytest.approx(float(padded_metrics[key]), rel=1e-4, abs=1e-7), (
            key
        )
    assert float(padded_metrics["train/kl"]) > 0
    initial = dict(AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters())
    expected = dict(padded.policy.named_parameters())
    for name, value in packed.policy.named_parameters():
        assert not torch.equal(value, initial[name]), f"{name} did not move"
        torch.testing.assert_close(value, expected[name], rtol=1e-4, atol=1e-6, msg=name)
