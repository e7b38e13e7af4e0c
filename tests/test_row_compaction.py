"""Finished rows stop costing: once half of a batch's rows have ended, the live ones decode on alone
(`sampling.generate_completions`, both engines), and nothing about what is sampled changes. Each drawn
token is still scored as it was drawn, the tokens follow the scorer's distribution, greedy rollouts are
those of one uncompacted call, every row keeps its exact completion and truncation flag, a seed gives the
same rollout twice, and the model's forward really runs fewer rows, as the rule says.
"""

from __future__ import annotations

import pytest
import torch

from grpo_lightning.core.generation.engines import EagerEngine
from grpo_lightning.core.generation.logprobs import completion_logprobs
from grpo_lightning.core.generation.sampling import COMPACT_LIVE_SHARE, SamplingSettings
from grpo_lightning.core.generation.static_engine import StaticEngine
from grpo_lightning.offline.tiny import build_model
from tests.helpers import sliding_window_model

VOCAB, PAD = 300, 0
ENDS = tuple(range(3, VOCAB, 8))  # an eighth of the vocabulary ends a completion: lengths spread over 1-16
BUDGET = 16


def tiny() -> torch.nn.Module:
    return build_model(VOCAB, hidden_size=32, num_layers=2, num_heads=4).double().eval()


def prompts(n: int, length: int = 7, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`[n, length]` left-padded prompts of different lengths (row i has i % 4 pad columns)."""
    ids = torch.randint(1, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))
    ids[torch.isin(ids, torch.tensor(ENDS))] = 1
    mask = torch.ones_like(ids)
    for i in range(n):
        ids[i, : i % 4], mask[i, : i % 4] = PAD, 0
    return ids, mask


def settings(**options) -> SamplingSettings:
    base = dict(max_new_tokens=BUDGET, eos_token_ids=ENDS, pad_token_id=PAD, share_prompt=False)
    return SamplingSettings(**{**base, **options})


def build_engine(kind: str, compact_above_rows: int | None, **options):
    s = settings(**options)
    if kind == "eager":
        return EagerEngine(s, compact_above_rows=compact_above_rows)
    return StaticEngine(s, prompt_bucket=8, compact_above_rows=compact_above_rows)


def decoder_of(engine, model: torch.nn.Module) -> torch.nn.Module:
    """The decoder that `engine` runs: the policy's, or the static engine's inference copy's."""
    if isinstance(engine, StaticEngine):
        engine.refresh(model, torch.device("cpu"))
        return engine.copy.model.get_decoder()
    return model.get_decoder()


class ForwardRows:
    """The batch size of every forward of `decoder`: with a shared prompt the first is its prefill (one row
    per prompt), then one forward per completion column."""

    def __init__(self, decoder: torch.nn.Module) -> None:
        self.rows: list[int] = []
        self.handle = decoder.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs) -> None:
        self.rows.append(kwargs["input_ids"].size(0))

    def __enter__(self) -> ForwardRows:
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()


def expected_rows(completion_mask: torch.Tensor, truncated: torch.Tensor, above: int) -> list[int]:
    """The rows decoded for each completion column, as the rule says: a batch of more than `above` rows goes
    on with its live rows once at most `COMPACT_LIVE_SHARE` (half) of it is live, while tokens remain."""
    T = completion_mask.size(1)
    lengths = completion_mask.sum(1)  # [B]
    ends_at = torch.where(truncated, T, lengths - 1)  # [B] the column of each row's end token
    batch, rows = completion_mask.size(0), []
    for t in range(T):
        rows.append(batch)
        live = int((ends_at > t).sum())  # rows without an end token after column t
        if batch > above and 0 < live <= int(COMPACT_LIVE_SHARE * batch) and t + 1 < BUDGET:
            batch = live
    return rows


def check_rows(rollout, ids: torch.Tensor) -> None:
    """Every row is a well-formed completion: pad after its end token, masked up to and including it, and
    truncated exactly when it never ended within the budget."""
    ends = torch.isin(rollout.completion_ids, torch.tensor(ENDS))  # [B, T]
    lengths = rollout.completion_mask.sum(1)
    assert torch.equal(rollout.truncated, ~ends.any(1))
    assert (lengths[rollout.truncated] == BUDGET).all()
    finished = ~rollout.truncated
    last = rollout.completion_ids[finished].gather(1, (lengths[finished] - 1)[:, None]).squeeze(1)
    assert torch.isin(last, torch.tensor(ENDS)).all() and (ends.cumsum(1) <= 1).all()
    assert (rollout.completion_ids[rollout.completion_mask == 0] == PAD).all()
    assert torch.equal(rollout.prompt_ids, ids)


@pytest.mark.parametrize(
    ("kind", "share_prompt"), [("eager", False), ("eager", True), ("static", True), ("static", False)]
)
def test_compacted_rollouts_are_scored_as_drawn(kind, share_prompt):
    """32 rows (4 prompts x 8), compacting above 4 rows: the batch goes 32 -> 16 or fewer -> ... as rows end,
    and every drawn token's log-prob is the scorer's on the finished rollout."""
    model = tiny()
    ids, mask = prompts(4)
    engine = build_engine(kind, 4, share_prompt=share_prompt, temperature=0.7)
    torch.manual_seed(0)
    with ForwardRows(decoder_of(engine, model)) as forwards:
        rollout = engine.generate(model, ids, mask, num_generations=8)
    T = rollout.completion_ids.size(1)
    check_rows(rollout, ids.repeat_interleave(8, 0))
    rows = forwards.rows[1:] if share_prompt else forwards.rows  # [T] after the shared prompts' prefill
    assert rows == expected_rows(rollout.completion_mask, rollout.truncated, 4)
    assert rows[-1] < 16 and sum(rows) < 0.75 * 32 * T, rows  # work saved
    scored, _ = completion_logprobs(model, rollout.input_ids, rollout.attention_mask, T, temperature=0.7)
    drawn = rollout.completion_mask.bool()
    assert (rollout.sampler_logprobs - scored)[drawn].abs().max() < 1e-5
    assert (rollout.sampler_logprobs[~drawn] == 0).all()
    lengths = rollout.completion_mask.sum(1)
    assert lengths.min() < 4 and lengths.max() > 8  # rows that end early and rows that go on


@pytest.mark.parametrize("kind", ["eager", "static"])
def test_greedy_rollouts_are_those_of_one_call(kind):
    """Greedy decoding of 32 distinct prompts, compacted above 4 rows, against one uncompacted eager call:
    the same tokens, masks and truncation flags, row by row, those that ended first included."""
    model = tiny()
    ids, mask = prompts(32, seed=1)
    reference = build_engine("eager", None).generate(model, ids, mask, num_generations=1, do_sample=False)
    engine = build_engine(kind, 4)
    with ForwardRows(decoder_of(engine, model)) as forwards:
        rollout = engine.generate(model, ids, mask, num_generations=1, do_sample=False)
    assert torch.equal(rollout.completion_ids, reference.completion_ids)
    assert torch.equal(rollout.completion_mask, reference.completion_mask)
    assert torch.equal(rollout.truncated, reference.truncated)
    assert rollout.sampler_logprobs is None
    assert len(set(forwards.rows)) >= 3, forwards.rows  # at least two compactions
    assert 0 < int(reference.truncated.sum()) < 32 and int(reference.completion_mask.sum(1).min()) <= 4


def test_a_seed_gives_the_same_rollout():
    model = tiny()
    ids, mask = prompts(4)
    rollouts = []
    for kind in ("eager", "eager", "static"):
        engine = build_engine(kind, 4)
        decoder_of(
            engine, model
        )  # the static engine's copy is built (random initial weights) before the seed
        torch.manual_seed(3)
        rollouts.append(engine.generate(model, ids, mask, num_generations=8))
    first, again, static = rollouts
    for other in (again, static):  # the static engine draws the same numbers for the same rows
        assert torch.equal(first.completion_ids, other.completion_ids)
        torch.testing.assert_close(first.sampler_logprobs, other.sampler_logprobs, rtol=0, atol=1e-6)


def test_static_compaction_reuses_the_storage():
    """The live rows move down into the storage's first rows: no new storage, and the next call of the full
    batch starts from a clean cache (its rollout is the first call's again)."""
    model = tiny()
    ids, mask = prompts(32, seed=1)
    engine = build_engine("static", 4)
    first = engine.generate(model, ids, mask, num_generations=1, do_sample=False)
    nbytes, generation = engine.cache_nbytes(), engine.caches.generation
    assert len(engine.caches.caches) >= 3  # the full batch's cache and two smaller buckets' views
    again = engine.generate(model, ids, mask, num_generations=1, do_sample=False)
    assert torch.equal(first.completion_ids, again.completion_ids)
    assert (engine.cache_nbytes(), engine.caches.generation) == (nbytes, generation)


def test_tokens_after_a_compaction_follow_the_scorers_distribution():
    """2000 rows of one prompt on a peaked model, whose likeliest first token ends a completion: most rows
    end at the first token, the rest (about 730) decode on in a batch of their own. The second token of
    those rows against the scorer's distribution given each row's first token (a chi-square goodness of
    fit over the 11 likeliest tokens and the rest); a different model's distribution is told apart."""
    model = tiny()
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # one first token carries 63% of the mass
    ids = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        first = model(ids).logits[0, -1].softmax(-1)  # [V]
    order = first.argsort(descending=True)
    ends = order[: int((first[order].cumsum(0) < 0.6).sum()) + 1]  # the likeliest tokens, 60% of the mass
    s = settings(max_new_tokens=3, eos_token_ids=tuple(ends.tolist()))
    torch.manual_seed(4)
    with ForwardRows(model.get_decoder()) as forwards:
        rollout = EagerEngine(s).generate(model, ids, torch.ones_like(ids), num_generations=2000)
    live = ~torch.isin(rollout.completion_ids[:, 0], ends)  # [B] rows that decoded a second token
    assert forwards.rows[0] == 2000 and forwards.rows[1] == int(live.sum()) < 1000, forwards.rows
    seen = rollout.completion_ids[live, 1]  # [b]
    prefix = torch.cat([ids.expand(int(live.sum()), -1), rollout.completion_ids[live, :1]], dim=1)

    def statistic(scorer: torch.nn.Module) -> float:
        with torch.no_grad():
            expected = scorer(prefix).logits[:, -1].softmax(-1).sum(0)  # [V] expected counts
        top = expected.argsort(descending=True)[:11]
        observed = torch.bincount(seen, minlength=VOCAB).double()
        rest = torch.ones(VOCAB, dtype=torch.bool)
        rest[top] = False
        e = torch.cat([expected[top], expected[rest].sum()[None]])
        o = torch.cat([observed[top], observed[rest].sum()[None]])
        return float(((o - e) ** 2 / e).sum())

    assert statistic(model) < 35.0  # chi-square(11) is above 31.3 with probability 1e-3
    other = build_model(VOCAB, hidden_size=32, num_layers=2, num_heads=4, seed=5).double().eval()
    with torch.no_grad():
        other.lm_head.weight.mul_(20)
    assert statistic(other) > 100


def test_models_with_other_attention_layers_decode_every_row():
    """A model with a sliding-window layer keeps every row in one `generate` call (its cache is left as
    `generate` made it), and still samples what it scores."""
    model = sliding_window_model(VOCAB).eval()
    ids, mask = prompts(4)
    torch.manual_seed(0)
    with ForwardRows(model.get_decoder()) as forwards:
        rollout = build_engine("eager", 4).generate(model, ids, mask, num_generations=8)
    T = rollout.completion_ids.size(1)
    assert forwards.rows == [32] * T and int(rollout.completion_mask.sum(1).min()) < T
    scored, _ = completion_logprobs(model, rollout.input_ids, rollout.attention_mask, T)
    drawn = rollout.completion_mask.bool()
    assert (rollout.sampler_logprobs - scored)[drawn].abs().max() < 1e-5


def test_a_compiling_engine_keeps_its_rows_in_their_bucket(recwarn):
    """Compiled decoding has one graph per row bucket, so its rows stay in their power-of-two bucket until
    the call ends. Shown without compiling (tens of seconds on CPU): the engine's uncompiled fallback
    decodes the same shapes as its compiled step would."""
    model = tiny()
    engine = StaticEngine(settings(), prompt_bucket=8, compile=True, compact_above_rows=4)
    engine.compile_failed = "not compiled in this test"
    ids, mask = prompts(12, seed=1)  # 12 rows: a bucket of 16
    with ForwardRows(decoder_of(engine, model)) as forwards:
        rollout = engine.generate(model, ids, mask, num_generations=1, do_sample=False)
    T = rollout.completion_ids.size(1)
    assert forwards.rows == [16] * T
    dropping = expected_rows(rollout.completion_mask, rollout.truncated, 4)
    assert dropping != [12] * T, "rows ended early enough for an uncompiled engine to drop them"


@pytest.mark.parametrize("scale", [1e-4, 1e-3, 1e-2])
def test_a_lora_policy_under_bf16_mixed_is_scored_as_drawn_after_compaction(scale):
    """The users' road: a bf16 base with float32 LoRA adapters under bf16 autocast, the static engine's copy
    (adapters unmerged), rows dropped as they end. At every adapter size each drawn token's log-prob is the
    scorer's within bf16 rounding, and the dropped rows' keys and values moved in the bf16 cache unchanged."""
    from grpo_lightning.core.generation.inference_copy import copy_precision
    from grpo_lightning.io.models import LoraOptions, apply_lora

    torch.manual_seed(0)
    policy = apply_lora(
        build_model(VOCAB, hidden_size=32, num_layers=2, num_heads=4).to(torch.bfloat16),
        LoraOptions(r=4, alpha=8),
    )
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, weight in policy.named_parameters():
            if "lora_B" in name:
                weight.copy_(torch.randn(weight.shape, generator=g) * scale)
    engine = StaticEngine(
        settings(share_prompt=True, temperature=0.7),
        precision=copy_precision("bf16-mixed"),
        prompt_bucket=8,
        compact_above_rows=4,
    )
    ids, mask = prompts(4)
    torch.manual_seed(0)
    with ForwardRows(decoder_of(engine, policy)) as forwards:
        rollout = engine.generate(policy, ids, mask, num_generations=8)
    T = rollout.completion_ids.size(1)
    assert sum(forwards.rows[1:]) < 0.75 * 32 * T, forwards.rows  # rows were dropped
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        scored, _ = completion_logprobs(policy, rollout.input_ids, rollout.attention_mask, T, temperature=0.7)
    drawn = rollout.completion_mask.bool()
    gap = (rollout.sampler_logprobs - scored)[drawn].abs()
    assert gap.max() < 0.05 and gap.mean() < 5e-3, (gap.max(), gap.mean())
