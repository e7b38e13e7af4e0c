"""grpo_loss against TRL 1.16's own `GRPOTrainer._compute_loss` on the same tensors: every loss type,
importance-sampling level, KL weight (the KL bias-corrected or not, TRL's `use_bias_correction_kl`) and
two-sided clip; bnpo and dapo over uneven micro-batches under gradient accumulation; the sampler's truncated
importance weights as TRL's "token_truncate" mode computes them."""

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from grpo_lightning.core.algorithm.loss import grpo_loss
from grpo_lightning.core.algorithm.sampler_correction import importance_weights, logprob_gap_stats
from tests.test_loss import LEVELS, LOSS_TYPES, loss_options, random_batch, sections


def _trl_compute_loss(
    data: dict,
    options: dict,
    importance_sampling_ratio: torch.Tensor | None = None,
    accumulation_steps: int = 1,
    num_items_in_batch: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """Run TRL's real ``GRPOTrainer._compute_loss`` with a stand-in ``self`` (1 process); with
    ``importance_sampling_ratio``, as TRL runs it with vLLM and its correction on. With
    ``accumulation_steps`` > 1, ``data`` is one of that many micro-batches of an optimizer step, each a
    generation step of its own (TRL's default ``steps_per_generation``, its accumulation steps), and
    ``num_items_in_batch`` the loss tokens of the whole step (default: this micro-batch's)."""
    trainer_cls = pytest.importorskip("trl.trainer.grpo_trainer").GRPOTrainer
    logprobs, mask = data["logprobs"], data["mask"].to(data["logprobs"].dtype)
    batch, length = logprobs.shape
    epsilon = options.get("epsilon", 0.2)
    entropy_coef = options.get("entropy_coef", 0.0)
    trainer = SimpleNamespace(
        loss_type=options["loss_type"],
        beta=options.get("beta", 0.0),
        epsilon_low=epsilon,
        epsilon_high=options.get("epsilon_high", epsilon),
        importance_sampling_level=options.get("importance_sampling_level", "token"),
        max_completion_length=options.get("max_completion_length"),
        args=SimpleNamespace(
            delta=options.get("delta"),
            use_bias_correction_kl=options.get("use_bias_correction_kl", True),
            steps_per_generation=accumulation_steps,
        ),
        top_entropy_quantile=options.get("top_entropy_quantile", 1.0),
        off_policy_mask_threshold=None,
        use_vllm=importance_sampling_ratio is not None,
        vllm_importance_sampling_correction=True,
        aux_loss_enabled=False,
        _entropy_bonus_enabled=entropy_coef != 0.0,
        entropy_coef=entropy_coef,
        use_adaptive_entropy=False,
        current_gradient_accumulation_steps=accumulation_steps,
        model=SimpleNamespace(training=True),
        accelerator=SimpleNamespace(
            num_processes=1,
            sync_gradients=True,
            reduce=lambda tensor, reduction: tensor,
            gather=lambda tensor: tensor,
            pad_across_processes=lambda tensor, dim, pad_index: tensor,
        ),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (logprobs, data["entropies"], None),
    )
    inputs = {
        "prompt_ids": torch.zeros(batch, 2, dtype=torch.long),
        "prompt_mask": torch.ones(batch, 2, dtype=torch.long),
        "completion_ids": torch.zeros(batch, length, dtype=torch.long),
        "completion_mask": mask,
        "advantages": data["advantages"],
        "old_per_token_logps": data["old_logprobs"],
        "ref_per_token_logps": data["ref_logprobs"],
        "num_items_in_batch": mask.sum() if num_items_in_batch is None else num_items_in_batch,
        "importance_sampling_ratio": importance_sampling_ratio,
    }
    trainer.get_high_entropy_mask = lambda *args: trainer_cls.get_high_entropy_mask(trainer, *args)
    loss = trainer_cls._compute_loss(trainer, None, inputs)
    return loss, trainer._metrics["train"]


@pytest.mark.parametrize("delta", [None, 1.3])
@pytest.mark.parametrize(
    ("beta", "bias_correction"),
    [(0.0, True), (0.04, True), (0.04, False)],
    ids=["no-kl", "kl", "kl-uncorrected"],
)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_matches_trl(
    loss_type: str, level: str, beta: float, bias_correction: bool, delta: float | None
) -> None:
    data = random_batch(7, batch=6, length=7)
    options = loss_options(
        loss_type,
        importance_sampling_level=level,
        beta=beta,
        delta=None if loss_type == "cispo" else delta,  # delta caps the clipped surrogate only
        epsilon_high=1.1 if loss_type == "cispo" else 0.28,
        entropy_coef=0.02 if beta else 0.0,
        use_bias_correction_kl=bias_correction,
    )

    logprobs = data["logprobs"].clone().requires_grad_()
    loss, stats = grpo_loss(**(data | {"logprobs": logprobs}), **sections(options))
    trl_logprobs = data["logprobs"].clone().requires_grad_()
    trl_loss, metrics = _trl_compute_loss(data | {"logprobs": trl_logprobs}, options)

    torch.testing.assert_close(loss, trl_loss, atol=1e-6, rtol=0)
    loss.backward()
    trl_loss.backward()
    torch.testing.assert_close(logprobs.grad, trl_logprobs.grad, atol=1e-6, rtol=0)
    assert stats["entropy"].item() == pytest.approx(metrics["entropy"][0], abs=1e-6)
    if beta:
        assert stats["kl"].item() == pytest.approx(metrics["kl"][0], abs=1e-6)
        assert stats["policy_loss"].item() == pytest.approx(metrics["policy_loss"][0], abs=1e-6)
    if loss_type == "cispo":
        assert stats["clip_ratio/high_mean"].item() == pytest.approx(metrics["cispo_clip_ratio"][0], abs=1e-6)
    else:
        for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
            assert stats[key].item() == pytest.approx(metrics[key][0], abs=1e-6)
    assert stats["clip_ratio/region_mean"] > 0 or level == "sequence"


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_top_entropy_quantile_keeps_trls_tokens(loss_type: str, beta: float) -> None:
    """The policy term of the 20% highest-entropy tokens only, TRL's selection; the others get no policy
    gradient (with beta 0 none at all), and the KL term still reaches every token."""
    data = random_batch(3, batch=6, length=9)
    options = loss_options(
        loss_type, top_entropy_quantile=0.2, beta=beta, epsilon_high=1.1 if loss_type == "cispo" else 0.28
    )
    logprobs = data["logprobs"].clone().requires_grad_()
    loss, _ = grpo_loss(**(data | {"logprobs": logprobs}), **sections(options))
    trl_logprobs = data["logprobs"].clone().requires_grad_()
    trl_loss, _ = _trl_compute_loss(data | {"logprobs": trl_logprobs}, options)
    torch.testing.assert_close(loss, trl_loss, atol=1e-6, rtol=0)
    loss.backward()
    trl_loss.backward()
    torch.testing.assert_close(logprobs.grad, trl_logprobs.grad, atol=1e-6, rtol=0)
    mask = data["mask"]
    kept = data["entropies"] >= torch.quantile(data["entropies"][mask], 0.8)  # [B, T]
    assert 0 < int((kept & mask).sum()) < int(mask.sum())
    untouched = mask & ~kept
    assert bool((logprobs.grad[untouched] == 0).all()) == (beta == 0.0)
    everything, _ = grpo_loss(**data, **sections(options | {"top_entropy_quantile": 1.0}))
    assert not torch.allclose(loss, everything)


@pytest.mark.parametrize("level", LEVELS)
def test_the_bias_corrected_kl_changes_the_on_policy_gradient_as_trl(level: str) -> None:
    """On-policy (the ratio is 1 with the gradient of log pi), beta 0.04: TRL's default
    use_bias_correction_kl=True leaves the loss as it is and changes the gradient; ours follows it, and with
    the option off follows TRL's off."""
    data = random_batch(3, batch=6, length=7) | {"old_logprobs": None}
    results = {}
    for bias_correction in (True, False):
        options = loss_options("dapo", importance_sampling_level=level, beta=0.04, epsilon_high=0.28)
        options["use_bias_correction_kl"] = bias_correction
        logprobs = data["logprobs"].clone().requires_grad_()
        loss, _ = grpo_loss(**(data | {"logprobs": logprobs}), **sections(options))
        loss.backward()
        trl_logprobs = data["logprobs"].clone().requires_grad_()
        trl_loss, _ = _trl_compute_loss(data | {"logprobs": trl_logprobs}, options)
        trl_loss.backward()
        torch.testing.assert_close(loss, trl_loss, atol=1e-6, rtol=0)
        torch.testing.assert_close(logprobs.grad, trl_logprobs.grad, atol=1e-6, rtol=0)
        results[bias_correction] = loss.detach(), logprobs.grad
    (corrected, corrected_grad), (plain, plain_grad) = results[True], results[False]
    torch.testing.assert_close(corrected, plain, atol=1e-12, rtol=0)
    assert (corrected_grad - plain_grad).abs().max() > 1e-4  # float64: far above rounding


@pytest.mark.parametrize("cap", [1.5, 2.0, 3.0, 3.5, 7.0])
def test_token_truncate_weights_and_their_capped_share_are_trls(cap: float) -> None:
    """The sampler's weights as TRL's "token_truncate" mode computes them (`_generate_and_score_completions`:
    exp of the masked log-ratio, clamped at `vllm_importance_sampling_clip_max`), the share of tokens that
    clamp lowers, and the loss TRL's `_compute_loss` gives with those weights."""
    data = random_batch(5, batch=6, length=7)
    gen = torch.Generator().manual_seed(6)
    sampler = data["old_logprobs"] - 1.5 * torch.randn(6, 7, generator=gen, dtype=torch.float64)  # [B, T]
    mask = data["mask"]
    raw = torch.exp((data["old_logprobs"] - sampler) * mask)  # [B, T] TRL's ratio before its clamp
    trl_weights = torch.clamp(raw, max=cap)
    correction = importance_weights(data["old_logprobs"], sampler, mask, "token_truncate", cap)
    weights = correction[0]
    torch.testing.assert_close(weights[mask], trl_weights[mask], rtol=1e-12, atol=0)
    stats = logprob_gap_stats(data["old_logprobs"], sampler, mask, correction)
    capped = float(stats["rollout/is_weight_frac_capped"])
    assert capped == pytest.approx(float((raw > cap)[mask].double().mean()), abs=1e-6)
    assert 0 < capped < 1

    options = loss_options("dapo", beta=0.04, epsilon_high=0.28)
    logprobs = data["logprobs"].clone().requires_grad_()
    loss, _ = grpo_loss(**(data | {"logprobs": logprobs}), **sections(options), importance_weights=weights)
    loss.backward()
    trl_logprobs = data["logprobs"].clone().requires_grad_()
    trl_loss, _ = _trl_compute_loss(data | {"logprobs": trl_logprobs}, options, trl_weights)
    trl_loss.backward()
    torch.testing.assert_close(loss, trl_loss, atol=1e-6, rtol=0)
    torch.testing.assert_close(logprobs.grad, trl_logprobs.grad, atol=1e-6, rtol=0)


UNEVEN_MICRO_BATCHES = (slice(0, 1), slice(1, 4), slice(4, 6))  # rows of a batch of 6


def _micro_batch_sums(data: dict, micro_batch_loss) -> tuple[torch.Tensor, torch.Tensor]:
    """The sum of ``micro_batch_loss(micro-batch data)`` over ``UNEVEN_MICRO_BATCHES`` and its gradient
    with respect to the whole batch's log-probs."""
    logprobs = data["logprobs"].clone().requires_grad_()
    whole = data | {"logprobs": logprobs}
    parts = [{key: value[rows] for key, value in whole.items()} for rows in UNEVEN_MICRO_BATCHES]
    loss = torch.stack([micro_batch_loss(part) for part in parts]).sum()
    loss.backward()
    return loss.detach(), logprobs.grad


def _ours_and_trls_over_uneven_micro_batches(data: dict, options: dict) -> tuple[tuple, tuple]:
    """Our micro-batch losses summed (the step's totals given) and TRL's, one accumulation step each."""
    mask, steps = data["mask"], len(UNEVEN_MICRO_BATCHES)
    totals = {"total_tokens": mask.sum().double(), "total_sequences": 6, "num_micro_batches": steps}
    ours = _micro_batch_sums(data, lambda part: grpo_loss(**part, **sections(options), **totals)[0])
    trls = _micro_batch_sums(
        data,
        lambda part: _trl_compute_loss(
            part, options, accumulation_steps=steps, num_items_in_batch=mask.sum()
        )[0],
    )
    return ours, trls


@pytest.mark.parametrize("level", LEVELS)
def test_bnpo_over_uneven_micro_batches_is_trls_and_dapo_is_not(level: str) -> None:
    """A batch of 6 cut into micro-batches of 1, 3 and 2 rows that hold different numbers of tokens, one
    optimizer step: the sum of our bnpo micro-batch losses and its gradient are those of TRL's bnpo with
    3 accumulation steps (each micro-batch's own token mean / 3). Our dapo (the step's token mean) is TRL's
    dapo there and differs from bnpo."""
    data = random_batch(13, batch=6, length=7)
    token_counts = [int(data["mask"][rows].sum()) for rows in UNEVEN_MICRO_BATCHES]
    assert len(set(token_counts)) == 3, token_counts  # the micro-batches' token means weigh tokens apart
    results = {}
    for loss_type in ("bnpo", "dapo"):
        options = loss_options(loss_type, importance_sampling_level=level, beta=0.04, epsilon_high=0.28)
        (loss, grad), (trl_loss, trl_grad) = _ours_and_trls_over_uneven_micro_batches(data, options)
        torch.testing.assert_close(loss, trl_loss, atol=1e-10, rtol=0)
        torch.testing.assert_close(grad, trl_grad, atol=1e-10, rtol=0)
        results[loss_type] = loss, grad
    (bnpo, bnpo_grad), (dapo, dapo_grad) = results["bnpo"], results["dapo"]
    assert abs(float(bnpo - dapo)) > 1e-3
    assert (bnpo_grad - dapo_grad).abs().max() > 1e-3
