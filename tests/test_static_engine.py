"""The static-cache rollout engine samples what the loss scores, from the weights the optimizer just wrote:
the same distribution (each drawn token's log-prob, as the engine reports it, is what `completion_logprobs`
scores under the trainer's precision; token frequencies as eager's), the same greedy rollouts after
optimizer steps (full model, LoRA unmerged), an inference copy refreshed in place once per rollout, one KV
storage for every row bucket, and a compiled decoding step that never recompiles after warm-up and says so
when it falls back.

The engine inside `GRPOModule` is tested in tests/test_static_module.py, under FSDP2 in
tests/test_static_fsdp2.py; both use this file's tiny models, prompts and engines.
"""

from __future__ import annotations

import copy

import pytest
import torch

from grpo_lightning.core.generation.inference_copy import copy_precision
from grpo_lightning.core.generation.logprobs import completion_logprobs
from grpo_lightning.core.generation.sampling import SamplingSettings, generate_completions
from grpo_lightning.core.generation.static_engine import StaticEngine, static_unsupported
from grpo_lightning.io.models import LoraOptions, apply_lora
from grpo_lightning.offline.tiny import build_model
from tests.helpers import sliding_window_model

VOCAB, EOS, PAD = 300, 2, 0
SAMPLING = {
    "max_new_tokens": 8,
    "min_new_tokens": 0,
    "eos_token_ids": (EOS,),
    "pad_token_id": PAD,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
}


def tiny(seed: int = 0) -> torch.nn.Module:
    return build_model(VOCAB, hidden_size=32, num_layers=2, num_heads=4, seed=seed)


def prompts(n: int = 3, length: int = 7, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`[n, length]` left-padded prompts of different lengths (row i has i pad columns)."""
    ids = torch.randint(3, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    for i in range(n):
        ids[i, :i], mask[i, :i] = PAD, 0
    return ids, mask


def engine(share_prompt: bool = True, **options) -> StaticEngine:
    settings = {**SAMPLING, **{k: v for k, v in options.items() if k in SAMPLING}}
    extra = {k: v for k, v in options.items() if k not in SAMPLING}
    return StaticEngine(SamplingSettings(**settings, share_prompt=share_prompt), prompt_bucket=8, **extra)


def eager_greedy(model, ids, mask, G: int = 2, **options):
    settings = SamplingSettings(
        **{**SAMPLING, **options, "eos_token_ids": tuple(options.get("eos_token_ids", (EOS,)))}
    )
    return generate_completions(model, ids, mask, settings, num_generations=G, do_sample=False)


def train_steps(model, steps: int, on_step=None, seed: int = 0) -> None:
    """Real AdamW steps on a next-token loss over random text; `on_step()` after each."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=3e-2)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(3, VOCAB, (4, 10), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if on_step is not None:
            on_step()


# ----------------------------------------------------------------------------------------- distribution
@pytest.mark.parametrize(
    ("precision", "share_prompt", "tolerance"),
    [(None, True, 1e-5), (None, False, 1e-5), ("bf16-mixed", True, 1e-2)],
    ids=["float32-shared", "float32", "bf16-mixed-shared"],
)
def test_each_drawn_token_is_scored_as_it_was_drawn(precision, share_prompt, tolerance):
    """The engine's own sampler log-probs against the scorer's: float32, and under `bf16-mixed`, where the
    copy holds bf16 linear weights and float32 embeddings and norms, and runs under the same autocast."""
    model = tiny().eval()
    # A checkpoint generation config that would reshape sampling if `generate` applied it.
    model.generation_config.update(do_sample=True, repetition_penalty=1.5, top_k=5, suppress_tokens=[3, 4, 5])
    ids, mask = prompts()
    rollouts = engine(share_prompt, temperature=0.7, precision=copy_precision(precision))
    torch.manual_seed(0)
    rollout = rollouts.generate(model, ids, mask, num_generations=4)
    T = rollout.completion_ids.size(1)
    assert rollout.prompt_ids.shape == (12, 7) and torch.equal(
        rollout.prompt_ids, ids.repeat_interleave(4, 0)
    )
    autocast = precision is not None
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        scored, _ = completion_logprobs(model, rollout.input_ids, rollout.attention_mask, T, temperature=0.7)
    drawn = rollout.completion_mask.bool()  # [B, T]
    difference = (rollout.sampler_logprobs - scored)[drawn].abs()
    assert difference.max() < tolerance, difference.max()
    assert (rollout.sampler_logprobs[~drawn] == 0).all()
    assert drawn.sum() > 40  # enough tokens to mean something
    if autocast:
        assert difference.mean() < tolerance / 10
        copy = rollouts.copy.model
        assert copy.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16  # autocast's matmuls
        assert copy.model.embed_tokens.weight.dtype == torch.float32  # float32 residual stream, as scored
        assert copy.model.norm.weight.dtype == torch.float32


def test_copy_computes_as_the_autocast_scorer():
    """Full fine-tuning under `bf16-mixed`: float32 master weights scored under bf16 autocast. On the same
    tokens, in one pass, the copy's log-probs are the scorer's exactly; a copy with every weight in bf16
    (norms and the residual stream in bf16 too) is not."""
    model = tiny().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8)  # logits of a few units, as a trained model's
    ids = torch.randint(3, VOCAB, (4, 24), generator=torch.Generator().manual_seed(1))

    def scored(m) -> torch.Tensor:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            return completion_logprobs(m, ids, torch.ones_like(ids), 12)[0]

    rollouts = engine(precision=copy_precision("bf16-mixed"))
    rollouts.refresh(model, torch.device("cpu"))
    torch.testing.assert_close(scored(rollouts.copy.model), scored(model), rtol=0, atol=0)
    all_bf16 = copy.deepcopy(model).to(torch.bfloat16)
    assert (scored(all_bf16) - scored(model)).abs().max() > 1e-3


def two_sample_chi_square(a: torch.Tensor, b: torch.Tensor, bins: int = 12) -> tuple[float, int]:
    """Chi-square statistic of two equal-size samples of token ids over the `bins - 1` most frequent tokens
    and the rest, and its degrees of freedom."""
    pooled = torch.bincount(torch.cat([a, b]), minlength=VOCAB)
    top = pooled.argsort(descending=True)[: bins - 1]
    counts = []
    for sample in (a, b):
        per_token = torch.bincount(sample, minlength=VOCAB).double()
        counts.append(torch.cat([per_token[top], (per_token.sum() - per_token[top].sum())[None]]))
    x, y = counts
    return float(((x - y) ** 2 / (x + y).clamp(min=1)).sum()), bins - 1


def test_token_frequencies_match_eager_sampling():
    model = tiny().eval()
    with torch.no_grad():  # a peaked distribution: a few tokens carry most of the mass
        model.lm_head.weight.mul_(40)
    ids, mask = prompts(1, 5)  # bucket-padded to 8 columns in the static path
    G, draws = 800, {}
    for name in ("eager", "static"):
        torch.manual_seed(1 if name == "eager" else 2)
        if name == "eager":
            settings = SamplingSettings(**{**SAMPLING, "max_new_tokens": 3})
            rollout = generate_completions(model, ids, mask, settings, num_generations=G)
        else:
            rollout = engine(max_new_tokens=3).generate(model, ids, mask, num_generations=G)
        draws[name] = rollout.completion_ids  # [G, 3]
    for position in range(3):  # the first token comes from the prefill, the others through the cache
        a, b = draws["eager"][:, position], draws["static"][:, position]
        statistic, df = two_sample_chi_square(a, b)
        assert statistic < 35.0, (position, statistic)  # chi-square(11) is above 31.3 with probability 1e-3
    # Not a vacuous comparison: a different policy's draws are told apart.
    torch.manual_seed(3)
    other = engine(max_new_tokens=3).generate(tiny(seed=5).eval(), ids, mask, num_generations=G)
    assert two_sample_chi_square(draws["eager"][:, 0], other.completion_ids[:, 0])[0] > 100


def test_min_new_tokens_and_eos_as_in_eager():
    model = tiny().eval()
    ends = tuple(range(3, VOCAB, 4))  # a quarter of the vocabulary ends a completion
    options = {"eos_token_ids": ends, "min_new_tokens": 3}
    rollout = engine(**options).generate(model, *prompts(), num_generations=2, do_sample=False)
    expected = eager_greedy(model, *prompts(), **{**options, "eos_token_ids": list(ends)})
    assert torch.equal(rollout.completion_ids, expected.completion_ids)
    assert torch.equal(rollout.completion_mask, expected.completion_mask)
    assert torch.equal(rollout.truncated, expected.truncated)
    lengths = rollout.completion_mask.sum(1)
    assert (lengths >= 4).all() and (lengths < SAMPLING["max_new_tokens"]).any()  # EOS at 4th token or later
    is_end = torch.isin(rollout.completion_ids, torch.tensor(ends))
    assert not is_end[:, :3].any()
    after = rollout.completion_mask == 0
    assert (rollout.completion_ids[after] == PAD).all()


# ----------------------------------------------------------------------------------------- fresh weights
def assert_copy_holds(engine_: StaticEngine, model) -> None:
    """The copy's tensors are the policy's current weights (float32, unsharded), name by name."""
    copy = dict(engine_.copy.model.named_parameters())
    policy = dict(
        model.get_base_model().named_parameters()
        if hasattr(model, "get_base_model")
        else model.named_parameters()
    )
    assert set(copy) == set(policy)
    for name, value in policy.items():
        torch.testing.assert_close(copy[name], value.detach(), rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_copy_follows_optimizer_steps_in_place(lora):
    """Real AdamW steps, the engine told after each: the copy, refreshed in place before the next rollout,
    holds the trained weights (LoRA's adapters unmerged, the trained base untouched), and greedy rollouts
    are eager's on the live model."""
    model = tiny()
    if lora:
        model = apply_lora(model, LoraOptions(r=4, alpha=8))
        base = {n: p.detach().clone() for n, p in model.named_parameters() if "base_layer" in n}
    ids, mask = prompts()
    rollouts = engine()
    assert torch.equal(
        rollouts.generate(model, ids, mask, num_generations=2, do_sample=False).completion_ids,
        eager_greedy(model, ids, mask).completion_ids,
    )
    pointers = {n: p.data_ptr() for n, p in rollouts.copy.model.named_parameters()}
    before = {n: p.clone() for n, p in rollouts.copy.model.named_parameters()}
    greedy = []

    def after_step():
        rollouts.weights_changed()
        greedy.append(
            (
                rollouts.generate(model, ids, mask, num_generations=2, do_sample=False).completion_ids,
                eager_greedy(model, ids, mask).completion_ids,
            )
        )

    train_steps(model, 3, after_step)
    assert {n: p.data_ptr() for n, p in rollouts.copy.model.named_parameters()} == pointers, "in place"
    assert_copy_holds(rollouts, model)
    assert rollouts.refreshes == 4  # the first fill, then once per rollout after a step
    copy = dict(rollouts.copy.model.named_parameters())
    moved = {n for n in copy if not torch.equal(copy[n], before[n])}
    if lora:
        assert moved and all(".lora_" in n for n in moved), "only the adapters train"
        for name, value in base.items():
            assert torch.equal(dict(model.named_parameters())[name], value), name
    else:
        assert len(moved) == len(copy)
    for static, eager in greedy:
        assert torch.equal(static, eager)
    assert not torch.equal(greedy[0][0], greedy[-1][0]), "the steps changed what greedy decoding writes"


def test_one_kv_storage_serves_every_row_bucket():
    """Batches of 6, 4 and 2 rows after each other: one storage of the largest (6 rows) backs all three
    caches, and every rollout is eager's."""
    model = tiny()
    rollouts = engine()
    sizes = []
    for n in (3, 2, 1):
        ids, mask = prompts(n)
        static = rollouts.generate(model, ids, mask, num_generations=2, do_sample=False)
        assert torch.equal(static.completion_ids, eager_greedy(model, ids, mask).completion_ids), n
        sizes.append(rollouts.cache_nbytes())
    layer = rollouts.caches.caches[6].layers[0]
    config = model.config
    per_row = (
        2
        * config.num_hidden_layers
        * config.num_key_value_heads
        * layer.keys.size(-2)
        * layer.keys.size(-1)
        * 4
    )
    assert sizes == [6 * per_row] * 3
    assert rollouts.caches.caches[2].layers[0].keys.data_ptr() == layer.keys.data_ptr(), "a view"


def test_compiled_decoding_never_recompiles_after_warm_up(recwarn):
    """One compile (CPU inductor, tens of seconds), then rollouts after weight refreshes, greedy and sampled,
    with prompts in two length buckets (one cache length: `max_prompt_tokens`) and 6 rows (padded to 8):
    no graph is compiled again. Then a new row bucket with dynamo's recompile limit at 1: decoding falls
    back to eager, with the same rollouts, one warning naming the cause, and the fallback counted."""
    model = tiny()
    rollouts = engine(compile=True, max_prompt_tokens=16)
    pointers = None
    for step in range(3):
        ids, mask = prompts(3, length=12 if step % 2 else 6, seed=step)
        static = rollouts.generate(model, ids, mask, num_generations=2, do_sample=False)
        assert torch.equal(static.completion_ids, eager_greedy(model, ids, mask).completion_ids), step
        rollouts.generate(model, ids, mask, num_generations=2)  # sampled, same compiled step
        pointers = pointers or [p.data_ptr() for p in rollouts.copy.model.parameters()]
        train_steps(model, 1, rollouts.weights_changed, seed=step)
    assert rollouts.warmup_compiles == 1, "one graph for both prompt lengths"
    report = rollouts.watch.report
    assert report.recompiles == report.graph_breaks == report.eager_fallbacks == report.cudagraph_skips == 0
    assert [p.data_ptr() for p in rollouts.copy.model.parameters()] == pointers
    assert not [w for w in recwarn if "fast path" in str(w.message)]
    ids, mask = prompts(5, length=6)  # 10 rows: a bucket of 16, which needs a graph of its own
    with torch._dynamo.config.patch(recompile_limit=1):
        for _ in range(2):
            static = rollouts.generate(model, ids, mask, num_generations=2, do_sample=False)
            assert torch.equal(static.completion_ids, eager_greedy(model, ids, mask).completion_ids)
    assert report.eager_fallbacks == 2 and report.recompiles == 0
    messages = [str(w.message) for w in recwarn if "fast path" in str(w.message)]
    assert len(messages) == 1 and "recompile limit (1)" in messages[0], messages
    assert rollouts.metrics()["eager_fallbacks"] == 2.0


def test_fast_path_degradations_are_counted_and_warned_once(recwarn):
    """What torch's counters say happened inside a decoding call: graphs compiled on a shape's first call
    are its warm-up, on a later call recompiles; CUDA-graph skips and graph breaks count whenever. Each
    cause is warned about once, by name."""
    from torch._dynamo.utils import counters

    from grpo_lightning.core.generation.compile_watch import CompileWatch

    watch = CompileWatch()
    for _ in range(3):  # one shape: a warm-up that compiles a graph, then two calls that compile again
        with watch.call("rows=8"):
            counters["stats"]["unique_graphs"] += 1
    with watch.call("rows=16"):  # a new shape's warm-up
        counters["stats"]["unique_graphs"] += 1
        counters["inductor"]["cudagraph_skips"] += 1
    report = watch.report
    assert (report.graphs_compiled, report.recompiles, report.cudagraph_skips) == (4, 2, 1)
    messages = [str(w.message) for w in recwarn if "fast path" in str(w.message)]
    assert len(messages) == 2 and "recompiles=1" in messages[0] and "cudagraph_skips=1" in messages[1]
    assert "TORCH_LOGS=recompiles" in messages[0]


# ----------------------------------------------------------------------------------------- unsupported models
def test_unsupported_models_say_why():
    assert static_unsupported(tiny()) is None
    assert static_unsupported(apply_lora(tiny(), LoraOptions(r=4))) is None
    assert "not all full attention" in static_unsupported(sliding_window_model(VOCAB))
    from peft import LoraConfig, get_peft_model

    dora = get_peft_model(tiny(), LoraConfig(r=4, target_modules="all-linear", use_dora=True))
    assert static_unsupported(dora) == "DoRA adapters are not served by the inference copy (LoRA only)"
