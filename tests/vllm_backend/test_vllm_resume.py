"""What vLLM's sampling reproducibility allows, and that it holds. The engine has one seed, drawn from the
trainer's seeded stream when it starts (per-request seeds crash vLLM's chunked prefill on CPU, so a
request's draws cannot be pinned): two runs from the same seed sample the same completions; a resumed run
starts a new engine, whose stream is not the interrupted one's, so its completions differ, but it samples
the checkpoint's weights (the sampler/scorer gap of its first step is float32 rounding) on the prompts the
straight run saw."""

from __future__ import annotations

import lightning as L
import pytest

from grpo_lightning.io.distributed import close_process_group
from tests.test_resume import fit

VLLM = dict(generation_backend="vllm", vllm_kv_cache_gb=0.05, vllm_enforce_eager=True)
N, M = 2, 2  # steps before the checkpoint, steps after it


class Gaps(L.Callback):
    """Each step's largest sampler/scorer log-prob gap, as the module logs it."""

    def __init__(self) -> None:
        self.gaps: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.gaps.append(float(trainer.callback_metrics["rollout/logp_gap_max"]))


def vllm_fit(model_dir: str, steps: int, seed: int, **options):
    gaps = Gaps()
    try:
        module, recorder = fit(
            model_dir, steps, None, seed, limit_val_batches=0, callbacks=(gaps,), **options
        )
    finally:
        close_process_group()  # the engine closes with it
    return module, recorder.steps, gaps.gaps


def test_same_seed_same_rollouts_and_a_resume_keeps_weights_and_data(vllm_model_dir, tmp_path):
    _, saved, _ = vllm_fit(vllm_model_dir, N, seed=0, save_dir=str(tmp_path), **VLLM)
    straight, steps, _ = vllm_fit(vllm_model_dir, N + M, seed=0, **VLLM)
    for want, have in zip(saved, steps[:N], strict=True):
        assert have["questions"] == want["questions"] and have["completions"] == want["completions"]
        assert have["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-8)
    resumed, resumed_steps, gaps = vllm_fit(
        vllm_model_dir, N + M, seed=1234, ckpt_path=str(tmp_path / f"epoch=0-step={N}.ckpt"), **VLLM
    )
    assert [s["questions"] for s in resumed_steps] == [s["questions"] for s in steps[N:]]
    assert len(gaps) == M and max(gaps) < 1e-5, (
        "the first push after the resume wrote the checkpoint's weights"
    )
    assert resumed.rollouts.engine.refreshes == M
