"""The asynchronous group source (`core/async_group_source.py`) and the correction of stale batches, without
servers: the loss and gradient of a stale batch equal the hand computation of the corrected objective (TIS,
AReaL's decoupled, none) in float32; a source sampling ahead on a stand-in sampler trains every batch exactly
once, in order, each group stamped with the version it was sampled under and never older than
`max_staleness` (a stale one sampled again, dropped or waited for); its batches in flight survive a
checkpoint; with `max_staleness` 0 it gives the synchronous source's groups exactly; the in-process engines
refuse it in one line, and so does a module with a `rollout_func` when it is built (tools and environments
sample ahead: `tests/vllm_backend/test_vllm_server_tools.py`)."""

from __future__ import annotations

import pytest
import torch

from grpo_lightning.core.algorithm.sampler_correction import decoupled_weights
from grpo_lightning.core.async_group_source import AsyncGroupSource, AsyncRolloutOptions
from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.group_source import SynchronousGroupSource, group_source
from grpo_lightning.core.rewards.scoring import trainer_state
from grpo_lightning.core.tools.calculator import calculator
from grpo_lightning.core.types import Rollout, ScoredGroups
from grpo_lightning.core.update import MicroBatchSums, build_trajectory, micro_batch_loss
from grpo_lightning.training.module import GRPOModule
from grpo_lightning.training.training_state import load_grpo_state, save_grpo_state
from tests.helpers import digit_reward

SERVER = dict(generation_backend="vllm_server", num_generations=2, max_completion_length=6)


# ------------------------------------------------------------------------ the corrected objective
def stale_batch(seed: int = 0) -> tuple[ScoredGroups, torch.Tensor, torch.Tensor]:
    """Two groups of 2 sampled one policy ago: the sampler's log-probs, the proximal policy's (the weights
    the step starts from, `old_logprobs`) and the policy's now, each `[4, 6]` float32, moved apart by
    about a step's worth, with padding after each row's end."""
    gen = torch.Generator().manual_seed(seed)
    B, T = 4, 6
    lengths = torch.tensor([6, 4, 5, 2])
    mask = (torch.arange(T)[None] < lengths[:, None]).long()  # [B, T]
    behaviour = -torch.rand(B, T, generator=gen) * 3  # [B, T]
    proximal = behaviour + 0.6 * torch.randn(B, T, generator=gen)  # [B, T]: some weights past the cap
    rollout = Rollout(
        torch.ones(B, 3, dtype=torch.long),
        torch.ones(B, 3, dtype=torch.long),
        torch.randint(3, 50, (B, T), generator=gen) * mask,
        mask,
        torch.zeros(B, dtype=torch.bool),
        behaviour * mask,
    )
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0])
    groups = ScoredGroups(["a", "b"], rollout, ["x"] * B, rewards[:, None], rewards, 2, policy_version=3)
    now = proximal + 0.3 * torch.randn(B, T, generator=gen)  # [B, T]: some ratios clipped
    return groups, proximal * mask, now * mask


@pytest.mark.parametrize("correction", ["importance_sampling", "decoupled", "none"])
def test_a_stale_batch_s_loss_and_gradient_are_the_corrected_objective(correction):
    """dapo's loss of a batch one step old, with rho = pi / pi_prox and A the group advantages:
    sum(-w * min(rho A, clip(rho, 0.8, 1.2) A)) / tokens, w = min(pi_prox / pi_behaviour, 2) (TIS),
    pi_prox / pi_behaviour unbounded (decoupled) or 1 (none); its gradient d/dlog pi = -w * rho * A where
    the unclipped branch is the minimum, else 0."""
    cfg = GRPOConfig(**SERVER, max_staleness=1, off_policy_correction=correction)
    groups, proximal, now = stale_batch()
    trajectory = build_trajectory(groups, cfg, old_logprobs=proximal)
    logprobs = now.clone().requires_grad_(True)  # [B, T]
    mask = trajectory.loss_mask.bool()  # [B, T]
    tokens = mask.sum()
    loss, stats = micro_batch_loss(
        trajectory, slice(None), logprobs, torch.zeros_like(now), cfg, tokens.float(), torch.tensor(4.0)
    )
    loss.backward()

    behaviour = groups.rollout.sampler_logprobs  # [B, T]
    raw = torch.exp(proximal - behaviour)  # [B, T]
    weights = {"importance_sampling": raw.clamp(max=2.0), "decoupled": raw, "none": torch.ones_like(raw)}
    w = weights[correction]
    assert (raw[mask] > 2.0).any() and (raw[mask] < 0.9).any(), "the batch is off-policy both ways"
    A = trajectory.advantages[:, None]  # [B, 1]
    rho = torch.exp(now - proximal)  # [B, T]
    unclipped, clipped = rho * A, rho.clamp(0.8, 1.2) * A  # [B, T]
    expected = (-w * torch.min(unclipped, clipped))[mask].sum() / tokens
    active = (unclipped <= clipped) & mask  # where the gradient flows
    assert active.any() and (mask & ~active).any(), "some ratios are clipped"
    gradient = torch.where(active, -w * rho * A, torch.zeros(())) / tokens  # [B, T]
    torch.testing.assert_close(loss.detach(), expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(logprobs.grad, gradient, atol=1e-6, rtol=0)
    if correction != "none":
        counted = w[mask]
        torch.testing.assert_close(stats["rollout/is_weight_mean"], counted.mean(), atol=1e-6, rtol=0)
        assert float(stats["rollout/is_weight_min"]) == pytest.approx(float(counted.min()), abs=1e-6)
        assert float(stats["rollout/is_weight_max"]) == pytest.approx(float(counted.max()), abs=1e-6)
        capped = float((raw[mask] > 2.0).float().mean()) if correction == "importance_sampling" else 0.0
        assert float(stats["rollout/is_weight_frac_capped"]) == pytest.approx(capped)
    else:
        assert "rollout/is_weight_mean" not in stats
    gap = (proximal - behaviour).abs()[mask].mean()
    torch.testing.assert_close(stats["rollout/logp_gap_mean"], gap, atol=1e-6, rtol=0)


def test_the_correction_is_off_with_max_staleness_0_and_warned_when_turned_off():
    groups, proximal, now = stale_batch()
    trajectory = build_trajectory(groups, GRPOConfig(**SERVER), old_logprobs=proximal)
    _, stats = micro_batch_loss(
        trajectory, slice(None), now, torch.zeros_like(now), GRPOConfig(**SERVER), None, None
    )
    assert "rollout/is_weight_mean" not in stats  # synchronous: as before, the section decides
    with pytest.warns(UserWarning, match="off_policy_correction: none with max_staleness=2") as caught:
        GRPOConfig(**SERVER, max_staleness=2, off_policy_correction="none")
    assert len(caught) == 1


def test_decoupled_weights_are_unbounded_ratios_on_the_counted_tokens_only():
    proximal = torch.tensor([[0.0, -1.0, 30.0], [-2.0, -0.5, 0.0]])
    behaviour = torch.tensor([[-3.0, -1.0, 0.0], [-1.0, -0.5, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    weights, bounded = decoupled_weights(proximal, behaviour, mask)
    expected = torch.tensor([[torch.e**3, 1.0, 0.0], [torch.e**-1, 1.0, 1.0]])
    torch.testing.assert_close(weights, expected)
    assert not bounded.any()


def test_the_micro_batch_sums_keep_the_weights_extremes():
    sums = MicroBatchSums()
    for low, high in [(0.5, 1.5), (0.2, 1.1), (0.9, 3.0)]:
        stats = {"rollout/is_weight_min": torch.tensor(low), "rollout/is_weight_max": torch.tensor(high)}
        sums.add(torch.tensor(1.0), stats, torch.tensor(1 / 3))
    assert float(sums.values["rollout/is_weight_min"]) == pytest.approx(0.2)
    assert float(sums.values["rollout/is_weight_max"]) == pytest.approx(3.0)


# ------------------------------------------------------------------------ the source on a stand-in sampler
class Pending:
    def __init__(self, rollout: Rollout, texts: list[str]) -> None:
        self.rollout, self.texts, self.waits = rollout, texts, 0

    def wait(self) -> None:
        self.waits += 1

    def result(self):
        return self.rollout, self.texts, None

    sampled_seconds = 1.0


class VersionedSampler:
    """Samples under `self.version`, the weights the trainer last 'pushed': every completion of a batch
    carries it (its first token, and its log-probs), so the test can read which weights sampled what."""

    def __init__(self) -> None:
        self.version, self.submitted = 0, []

    def rollout(self, prompts: list[str], G: int) -> Rollout:
        B = len(prompts) * G
        ids = torch.full((B, 3), 10 + self.version, dtype=torch.long)
        return Rollout(
            torch.ones(B, 2, dtype=torch.long),
            torch.ones(B, 2, dtype=torch.long),
            ids,
            torch.ones(B, 3, dtype=torch.long),
            torch.zeros(B, dtype=torch.bool),
            torch.full((B, 3), -float(self.version)),
        )

    def submit_batch(self, batch, G):
        self.submitted.append((list(batch["prompt"]), self.version))
        return Pending(self.rollout(batch["prompt"], G), [f"v{self.version}"] * len(batch["prompt"]) * G)

    def sample_batch(self, batch, G):
        return self.rollout(batch["prompt"], G), [f"v{self.version}"] * len(batch["prompt"]) * G, None

    def check(self, rollout, completions) -> None:
        pass


def reward(prompts, completions, **kwargs) -> list[float]:
    return [float(len(p)) + i for i, p in enumerate(prompts)]


def sources(max_staleness: int, stale_groups: str = "drop", **grpo):
    cfg = GRPOConfig(**SERVER, max_staleness=max_staleness, stale_groups=stale_groups, **grpo)
    sampler = VersionedSampler()
    return cfg, sampler, group_source(cfg, sampler, [reward], [1.0], ["reward"], pad_token_id=0)


def run(source, sampler, batches, steps_of=lambda i: 1, start: int = 0):
    """Train on `batches` as the module does: each update makes `steps_of(i)` optimizer steps, after which
    the sampler holds the new weights. Each update's (prompts, staleness, the weights that sampled it)."""
    trained, version = [], start
    sampler.version = version
    for i, batch in enumerate(batches):
        groups = source.next(batch, trainer_state(version))
        if groups is None:
            continue
        sampled_under = int(groups.rollout.completion_ids[0, 0]) - 10
        trained.append((groups.prompts, version - groups.policy_version, sampled_under))
        assert groups.policy_version == sampled_under, "the stamp is the weights that sampled"
        assert -groups.rollout.sampler_logprobs[0, 0] == sampled_under
        version += steps_of(i)
        sampler.version = version
    return trained, version


BATCHES = [{"prompt": [f"p{i}a", f"p{i}b"]} for i in range(8)]


@pytest.mark.parametrize("k", [1, 2])
def test_sampling_k_batches_ahead_trains_each_batch_once_in_order_k_steps_old(k):
    _, sampler, source = sources(k)
    assert isinstance(source, AsyncGroupSource)
    trained, _ = run(source, sampler, BATCHES)
    assert [t[0] for t in trained] == [b["prompt"] for b in BATCHES[: 8 - k]]
    # the pipeline fills for k steps (no update, no step taken): every later batch is exactly k steps old
    assert [t[1] for t in trained] == list(range(k)) + [k] * (8 - 2 * k)
    assert max(t[1] for t in trained) <= k
    in_flight = [e.batch["prompt"] for e in source.in_flight]
    assert in_flight == [b["prompt"] for b in BATCHES[8 - k :]], "the last k batches wait in flight"
    report = source.report.stats
    assert float(report["async/staleness_max"]) == trained[-1][1]
    assert float(report["async/in_flight"]) == k


@pytest.mark.parametrize("policy", ["drop", "wait"])
def test_a_batch_older_than_max_staleness_never_reaches_the_loss_and_is_sampled_again(policy):
    """Update 3 makes 3 optimizer steps (as if it had planned more): the batch in flight is then 3 steps old
    with max_staleness 2. Dropped, its prompts are sampled again under the current weights behind the
    others; waited for, sampled again at once. Every prompt is still trained once."""
    _, sampler, source = sources(2, policy)
    trained, _ = run(source, sampler, BATCHES, steps_of=lambda i: 3 if i == 3 else 1)
    assert max(t[1] for t in trained) <= 2
    assert source.resampled >= 1
    prompts = [p for t in trained for p in t[0]] + [p for e in source.in_flight for p in e.batch["prompt"]]
    assert sorted(prompts) == sorted(p for b in BATCHES for p in b["prompt"]), "each prompt once"
    if policy == "wait":
        assert any(t[1] == 0 for t in trained[1:]), "the resampled batch is trained fresh"


def test_the_batches_in_flight_are_saved_with_a_checkpoint_and_resume_goes_on_with_them(tmp_path):
    """Stopped after 5 batches, the state saved through a weights-only checkpoint (the module's own calls),
    a new source goes on:
    the two runs together train what one straight run trains, in the same order, with the same stamps."""
    _, sampler, straight = sources(2)
    expected, _ = run(straight, sampler, BATCHES)

    _, sampler, first = sources(2)
    before, version = run(first, sampler, BATCHES[:5])
    checkpoint = {"global_step": version}
    save_grpo_state(checkpoint, 0, {}, first.state_dict())
    torch.save(checkpoint, tmp_path / "state.ckpt")
    own = load_grpo_state(torch.load(tmp_path / "state.ckpt", weights_only=True), 0, 1)
    _, sampler, resumed = sources(2)
    resumed.load_state_dict(own.group_source)
    assert [e.scored.policy_version for e in resumed.in_flight] == [1, 2], "saved scored, with their stamps"
    after, _ = run(resumed, sampler, BATCHES[5:], start=version)
    assert before + after == expected


def test_max_staleness_0_gives_the_synchronous_source_s_groups_exactly():
    cfg, sampler, synchronous = sources(0)
    assert isinstance(synchronous, SynchronousGroupSource)
    options = AsyncRolloutOptions(max_staleness=0)
    asynchronous = AsyncGroupSource(options, VersionedSampler(), sources(0)[2], 2)
    for batch in BATCHES[:3]:
        a = synchronous.next(batch, trainer_state(0))
        b = asynchronous.next(batch, trainer_state(0))
        assert (a.prompts, a.completions, a.policy_version) == (b.prompts, b.completions, b.policy_version)
        torch.testing.assert_close(a.rewards, b.rewards, atol=0, rtol=0)
        torch.testing.assert_close(a.rollout.completion_ids, b.rollout.completion_ids, atol=0, rtol=0)


@pytest.mark.parametrize("backend", ["auto", "eager", "static", "vllm"])
def test_the_in_process_engines_refuse_sampling_ahead_in_one_line(backend):
    with pytest.raises(ValueError, match="needs engine.backend: vllm_server") as caught:
        GRPOConfig(max_staleness=1, generation_backend=backend)
    assert "\n" not in str(caught.value)


def own_rollout(prompts: list, module: GRPOModule) -> dict:
    raise AssertionError("never called: the module is refused first")


def test_a_rollout_func_is_refused_sampling_ahead_when_the_module_is_built(tiny_model_dir, no_weights):
    grpo = GRPOConfig(**SERVER, max_staleness=1, preflight=False)
    said = r"^rollout_func with async_rollouts.max_staleness=1: a rollout function samples on its own"
    with pytest.raises(ValueError, match=said) as refused:
        GRPOModule(tiny_model_dir, reward_funcs=[digit_reward], grpo=grpo, rollout_func=own_rollout)
    assert "\n" not in str(refused.value)
    module = GRPOModule(tiny_model_dir, reward_funcs=[digit_reward], grpo=grpo, tools=[calculator])
    assert isinstance(module.group_source, AsyncGroupSource) and module.rollouts.multi_turn.fresh_environments


def test_max_staleness_counts_optimizer_steps_a_multiple_of_those_per_batch():
    with pytest.raises(ValueError, match="multiple of the optimizer steps per batch"):
        GRPOConfig(**SERVER, max_staleness=1, steps_per_generation=2)
    _, sampler, source = sources(4, steps_per_generation=2)
    assert source.ahead == 2


def half_informative(prompts, completions, **kwargs) -> list[float]:
    """Rewards that differ within the groups of prompts ending in "a" only: dynamic sampling drops the
    others."""
    return [float(i % 2) if p.endswith("a") else 1.0 for i, p in enumerate(prompts)]


def test_dynamic_sampling_waits_for_more_batches_without_aging_its_groups():
    """Half of each batch's groups informative: dynamic sampling's buffer fills an update of 2 groups from
    two batches, making no update on every other; since a step without an update moves no weights, the
    groups it keeps grow no older, and no update's groups are older than max_staleness."""
    cfg = GRPOConfig(**SERVER, max_staleness=1, dynamic_sampling=True, dynamic_sampling_metric=None)
    sampler = VersionedSampler()
    source = group_source(cfg, sampler, [half_informative], [1.0], ["half"], pad_token_id=0)
    version, updates = 0, []
    for batch in BATCHES:
        groups = source.next(batch, trainer_state(version))
        if groups is not None:
            updates.append((groups.prompts, version - groups.policy_version))
            version += 1
            sampler.version = version
    assert [len(prompts) for prompts, _ in updates] == [2, 2, 2]
    assert all(p.endswith("a") for prompts, _ in updates for p in prompts), "only informative groups"
    assert max(staleness for _, staleness in updates) <= 1
