"""Signals answered in seconds: a SIGTERM during a step's rollout (here a reward function that would take
ten minutes) ends `cli.py fit` at once with status 143 and the checkpoint of the last completed step,
from which the run resumes exactly as if never stopped (the abandoned step redone with the same draws); a
SIGTERM during `predict` stops it, non-zero, with the answers written so far whole."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from grpo_lightning.cli import EXIT_SIGTERM, build_cli
from grpo_lightning.core import stop_requests
from tests.helpers import digit_reward
from tests.test_interrupt import REPO, fit_args

SLEEPING = "GRPO_TEST_SLEEP_MARKER"  # the file a slow reward creates before it sleeps
SLOW_STEP = "GRPO_TEST_SLOW_AT_STEP"  # the optimizer step whose rewards are slow


def slow_at_a_step(completions: list, trainer_state=None, **kwargs) -> list[float]:
    """`digit_reward`, which takes ten minutes at the step `GRPO_TEST_SLOW_AT_STEP` names (saying so in the
    file `GRPO_TEST_SLEEP_MARKER`): a stand-in for a slow rollout."""
    if os.environ.get(SLOW_STEP) == str(trainer_state.global_step):
        Path(os.environ[SLEEPING]).write_text("asleep")
        time.sleep(600)
    return digit_reward(completions)


def predict_slow_from_the_second_batch() -> None:
    """`cli.py` whose `predict` takes ten minutes from its second batch on (saying so in the marker file):
    a stand-in for a slow generation."""
    from grpo_lightning.cli import main
    from grpo_lightning.training.module import GRPOModule

    answer = GRPOModule.predict_step

    def slow(self, batch, batch_idx, dataloader_idx=0):
        if batch_idx == 1:
            Path(os.environ[SLEEPING]).write_text("asleep")
            time.sleep(600)
        return answer(self, batch, batch_idx, dataloader_idx)

    GRPOModule.predict_step = slow
    main()


def run_until_asleep(
    args: list[str], marker: Path, env: dict, log: Path, cli: tuple[str, ...] = ("cli.py",)
) -> tuple[int, float, str]:
    """Run `cli.py` (or `cli`) with `args`; once it sleeps, SIGTERM; its exit status, the seconds it took
    to exit after the signal, and its output."""
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, *cli, *args],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env, SLEEPING: str(marker)},
        )
        try:
            deadline = time.monotonic() + 300
            while not marker.exists():
                assert process.poll() is None, log.read_text()
                assert time.monotonic() < deadline, "the reward never became slow"
                time.sleep(0.2)
            sent = time.monotonic()
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=120)  # the sleep is 600 s: an answer within the step, or a failure
            took = time.monotonic() - sent
        finally:
            if process.poll() is None:
                process.kill()
    return process.returncode, took, log.read_text()


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    state = torch.load(ckpt, weights_only=True)["state_dict"]
    return {k: v for k, v in state.items() if k.startswith("policy.")}


@pytest.mark.long
def test_sigterm_during_a_slow_rollout_stops_in_seconds_and_the_run_resumes_exactly(tiny_model_dir, tmp_path):
    args = ["--model.reward_funcs=[tests.test_bad_input_signals.slow_at_a_step]"]
    straight = tmp_path / "straight"
    build_cli(fit_args(tiny_model_dir, str(straight), 3, *args))
    final = straight / "lightning_logs" / "version_0" / "checkpoints" / "epoch=0-step=3.ckpt"

    root = tmp_path / "stopped"
    marker = tmp_path / "asleep"
    status, took, output = run_until_asleep(
        fit_args(tiny_model_dir, str(root), 3, *args), marker, {SLOW_STEP: "1"}, tmp_path / "fit.log"
    )
    assert status == EXIT_SIGTERM, output
    assert took < 60, f"{took:.0f} s to answer SIGTERM"  # 600 s if it waited for the step to end
    ckpt = root / "lightning_logs" / "version_0" / "checkpoints" / "interrupted.ckpt"
    assert f"SIGTERM: wrote the checkpoint of step 1 to {ckpt}" in output and "Traceback" not in output
    saved = torch.load(ckpt, weights_only=True)
    assert saved["global_step"] == 1 and saved["GSM8KDataModule"] == {"epoch": 0, "batches_done": 1}

    cli = build_cli(fit_args(tiny_model_dir, str(root), 3, *args, f"--ckpt_path={ckpt}"))
    assert cli.trainer.global_step == 3
    (resumed,) = root.glob("lightning_logs/*/checkpoints/epoch=0-step=3.ckpt")  # the resumed run's
    theirs, ours = weights(final), weights(resumed)
    assert theirs.keys() == ours.keys()
    for key in theirs:  # the abandoned step redone with the draws of the uninterrupted run
        torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=0, msg=key)


@pytest.mark.long
def test_sigterm_during_predict_stops_it_with_the_answers_so_far_written_whole(tiny_model_dir, tmp_path):
    results = tmp_path / "answers.jsonl"
    args = [
        "predict",
        f"--model.policy={tiny_model_dir}",
        "--model.reward_funcs=[tests.helpers.digit_reward]",
        "--model.grpo.max_completion_length=6",
        "--model.grpo.preflight=false",
        "--data.source=arithmetic",
        "--data.system_prompt=null",
        "--data.val_size=4",
        "--data.val_batch_size=2",
        "--trainer.accelerator=cpu",
        "--trainer.enable_progress_bar=false",
        "--trainer.logger=false",
        f"--trainer.default_root_dir={tmp_path}",
        f"--results.path={results}",
    ]
    slow = ("-c", "import tests.test_bad_input_signals as t; t.predict_slow_from_the_second_batch()")
    status, took, output = run_until_asleep(args, tmp_path / "asleep", {}, tmp_path / "predict.log", slow)
    assert status == EXIT_SIGTERM, output
    assert took < 60, f"{took:.0f} s to answer SIGTERM"
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert len(rows) == 2 and "Traceback" not in output  # the first batch's, whole


def test_a_stop_requested_inside_interruptible_code_raises_there_and_waits_outside_it():
    """`core.stop_requests`: requested while interruptible code runs, the stop raises at once (from the
    signal handler); requested outside, at the next interruptible entry or check (between decoding steps)."""

    class Stop(Exception):
        pass

    stop_requests.clear()
    try:
        stop_requests.enter_interruptible()
        with pytest.raises(Stop):
            stop_requests.request_stop(Stop)
        stop_requests.clear()
        stop_requests.request_stop(Stop)  # outside: nothing raised yet
        with pytest.raises(Stop):
            stop_requests.StopCheck()(torch.zeros(2, 3, dtype=torch.long), None)
        with pytest.raises(Stop):
            stop_requests.enter_interruptible()
    finally:
        stop_requests.clear()
    assert not stop_requests.StopCheck()(torch.zeros(2, 3, dtype=torch.long), None).any()
