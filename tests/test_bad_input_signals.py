"""Signals answered in seconds: a SIGTERM during a step's rollout (here a reward function that would take
ten minutes) ends `cli.py fit` at once with status 143 and the checkpoint of the last completed step,
from which the run resumes exactly as if never stopped (the abandoned step redone with the same draws); on
2 gloo processes a SIGTERM to one rank ends both so, with one checkpoint; a SIGTERM during `predict` stops
it, non-zero, with the answers written so far whole."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from grpo_lightning.cli import EXIT_SIGTERM, build_cli
from grpo_lightning.core import stop_requests
from grpo_lightning.io.shared_stops import SharedStops
from tests.helpers import digit_reward
from tests.test_distributed import DISTRIBUTED_ENV
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


def slow_on_every_rank(completions: list, trainer_state=None, **kwargs) -> list[float]:
    """`digit_reward`, which takes ten minutes at the step `GRPO_TEST_SLOW_AT_STEP` names on every rank, each
    writing its process id to `<GRPO_TEST_SLEEP_MARKER>.rank<r>` first."""
    if os.environ.get(SLOW_STEP) == str(trainer_state.global_step):
        rank = torch.distributed.get_rank()
        Path(f"{os.environ[SLEEPING]}.rank{rank}").write_text(str(os.getpid()))
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


DDP = ("--trainer.strategy=ddp",)
FSDP2 = (  # written whole by rank 0, so that the test reads it as DDP's
    "--trainer.strategy=ModelParallelStrategy",
    "--trainer.strategy.data_parallel_size=2",
    "--trainer.strategy.tensor_parallel_size=1",
    "--trainer.strategy.process_group_backend=gloo",
    "--trainer.strategy.save_distributed_checkpoint=false",
)


def start_two_ranks(
    args: list[str],
    env: dict,
    logs: Path,
    strategy: tuple[str, ...] = DDP,
    cli: tuple[str, ...] = ("cli.py",),
) -> list[subprocess.Popen]:
    """`cli.py` (or `cli`) with `args` on 2 ranks of one gloo process group under `strategy`, each process
    started here as torchrun or SLURM starts them (`LOCAL_RANK` and the rendezvous in its environment), its
    output in `<logs>.rank<r>`."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_ENV}
    common.update(env, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2")
    ranks = []
    for rank in range(2):
        with open(f"{logs}.rank{rank}", "w") as out:
            ranks.append(
                subprocess.Popen(
                    [sys.executable, *cli, *args, *strategy, "--trainer.devices=2"],
                    cwd=REPO,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env={**common, "LOCAL_RANK": str(rank), "NODE_RANK": "0"},
                    start_new_session=True,
                )
            )
    return ranks


def wait_for_ranks(ranks: list[subprocess.Popen], logs: Path, timeout: float) -> list[int]:
    """Every rank's exit status; both killed, and the test failed, if one runs past `timeout` seconds."""
    deadline = time.monotonic() + timeout
    try:
        for rank in ranks:
            rank.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pytest.fail(f"a rank ran past {timeout:.0f} s:\n" + rank_outputs(logs))
    finally:
        for rank in ranks:
            if rank.poll() is None:
                os.killpg(rank.pid, signal.SIGKILL)
                rank.wait()
    return [rank.returncode for rank in ranks]


def rank_outputs(logs: Path) -> str:
    return "\n".join(f"--- rank {r}\n{Path(f'{logs}.rank{r}').read_text()[-3000:]}" for r in range(2))


def stop_rank_one_once_both_sleep(
    ranks: list[subprocess.Popen], marker: Path, logs: Path, root: Path, step: int = 1
) -> Path:
    """Once both ranks sleep in `slow_on_every_rank` at `step`, SIGTERM rank 1's process alone; assert that
    both exit 143 within a minute, with one checkpoint of `step` written as both name it, and no traceback;
    that checkpoint."""
    try:
        asleep = [Path(f"{marker}.rank{r}") for r in range(2)]
        deadline = time.monotonic() + 300
        while not all(path.exists() and path.read_text() for path in asleep):
            assert all(rank.poll() is None for rank in ranks), rank_outputs(logs)
            assert time.monotonic() < deadline, "the reward never became slow on both ranks"
            time.sleep(0.2)
        sent = time.monotonic()
        os.kill(int(asleep[1].read_text()), signal.SIGTERM)  # rank 1's process alone
    finally:
        statuses = wait_for_ranks(ranks, logs, 120)  # the sleeps are 600 s
    took = time.monotonic() - sent
    output = rank_outputs(logs)
    assert statuses == [EXIT_SIGTERM, EXIT_SIGTERM], output
    assert took < 60, f"{took:.0f} s to answer SIGTERM"
    ckpt = root / "lightning_logs" / "version_0" / "checkpoints" / "interrupted.ckpt"
    assert f"SIGTERM: wrote the checkpoint of step {step} to {ckpt}" in output
    assert not re.search("^Traceback", output, re.M), output  # (vLLM logs one of its own, prefixed)
    assert list(ckpt.parent.glob("interrupted*")) == [ckpt], "one checkpoint, named alike on both ranks"
    saved = torch.load(ckpt, weights_only=True)
    assert saved["global_step"] == step and len(saved["grpo_state"]["per_rank"]) == 2
    return ckpt


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
def test_sigterm_to_one_of_two_ranks_mid_rollout_stops_both_in_seconds_and_the_run_resumes_exactly(
    tiny_model_dir, tmp_path
):
    """Both ranks asleep in a reward function at step 1, only rank 1 signalled: rank 0 learns of it from rank
    1 (not through a collective, which would wait for its sleep), both abandon step 1 and write one
    checkpoint of step 1, exit 143 within seconds, and the resumed run ends with the straight run's
    weights (both ranks' rollouts redone as they were: the update averages their gradients)."""
    args = ["--model.reward_funcs=[tests.test_bad_input_signals.slow_on_every_rank]"]
    straight, logs = tmp_path / "straight", tmp_path / "straight.log"
    ranks = start_two_ranks(fit_args(tiny_model_dir, str(straight), 3, *args), {}, logs)
    assert wait_for_ranks(ranks, logs, 300) == [0, 0], rank_outputs(logs)
    (final,) = straight.glob("lightning_logs/version_0/checkpoints/epoch=0-step=3.ckpt")

    root, marker, logs = tmp_path / "stopped", tmp_path / "asleep", tmp_path / "stopped.log"
    env = {SLOW_STEP: "1", SLEEPING: str(marker)}
    ranks = start_two_ranks(fit_args(tiny_model_dir, str(root), 3, *args), env, logs)
    ckpt = stop_rank_one_once_both_sleep(ranks, marker, logs, root)

    logs = tmp_path / "resumed.log"
    ranks = start_two_ranks(fit_args(tiny_model_dir, str(root), 3, *args, f"--ckpt_path={ckpt}"), {}, logs)
    assert wait_for_ranks(ranks, logs, 300) == [0, 0], rank_outputs(logs)
    (resumed,) = root.glob("lightning_logs/version_1/checkpoints/epoch=0-step=3.ckpt")
    theirs, ours = weights(final), weights(resumed)
    assert theirs.keys() == ours.keys()
    for key in theirs:  # the abandoned step redone with the draws of the uninterrupted run, on both ranks
        torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=0, msg=key)


@pytest.mark.long
def test_sigterm_to_one_of_two_ranks_mid_validation_stops_both_in_seconds_and_the_run_resumes(
    tiny_model_dir, tmp_path
):
    """Both ranks asleep in the validation reward after step 1, only rank 1 signalled: both leave
    validation at once, write one checkpoint of step 1 as a stop in training does, and the run resumes from
    it to its end."""
    args = [*SLOW_VALIDATION, "--trainer.num_sanity_val_steps=0"]
    stopped, resumed = stop_both_asleep_in_validation_and_resume(tiny_model_dir, tmp_path, args, step=1)
    assert stopped["global_step"] == 1 and resumed["global_step"] == 2


@pytest.mark.long
def test_sigterm_to_one_of_two_ranks_mid_sanity_check_stops_both_in_seconds_and_the_run_resumes(
    tiny_model_dir, tmp_path
):
    """Both ranks asleep in the validation reward of the sanity check Lightning runs before training, only
    rank 1 signalled: both leave it at once (not after the batch, nor waiting for each other in a broadcast
    from Lightning's own handler), write one checkpoint of step 0 as one process does, and the run resumes
    from it to its end."""
    args = [*SLOW_VALIDATION, "--trainer.num_sanity_val_steps=2"]
    stopped, resumed = stop_both_asleep_in_validation_and_resume(tiny_model_dir, tmp_path, args, step=0)
    assert stopped["global_step"] == 0 and resumed["global_step"] == 2


SLOW_VALIDATION = (  # validation after every step, its reward slow at the step `GRPO_TEST_SLOW_AT_STEP` names
    "--model.val_reward=tests.test_bad_input_signals.slow_on_every_rank",
    "--data.val_size=4",
    "--data.val_batch_size=1",  # 2 batches a rank
    "--trainer.limit_val_batches=1.0",
    "--trainer.val_check_interval=1",
)


def stop_both_asleep_in_validation_and_resume(
    tiny_model_dir: str, tmp_path: Path, args: list, step: int
) -> tuple[dict, dict]:
    """2 ranks fit 2 steps with `args`, their validation reward asleep at `step`: SIGTERM to rank 1 alone
    stops both within seconds with one checkpoint of `step` (`stop_rank_one_once_both_sleep`), from which the
    run resumes to its end. The stop's checkpoint and the resumed run's last one, loaded."""
    root, marker, logs = tmp_path / "stopped", tmp_path / "asleep", tmp_path / "stopped.log"
    ranks = start_two_ranks(
        fit_args(tiny_model_dir, str(root), 2, *args), {SLOW_STEP: str(step), SLEEPING: str(marker)}, logs
    )
    ckpt = stop_rank_one_once_both_sleep(ranks, marker, logs, root, step)

    logs = tmp_path / "resumed.log"
    ranks = start_two_ranks(fit_args(tiny_model_dir, str(root), 2, *args, f"--ckpt_path={ckpt}"), {}, logs)
    assert wait_for_ranks(ranks, logs, 300) == [0, 0], rank_outputs(logs)
    (last,) = root.glob("lightning_logs/version_1/checkpoints/epoch=0-step=2.ckpt")
    return torch.load(ckpt, weights_only=True), torch.load(last, weights_only=True)


@pytest.mark.long
def test_sigterm_to_one_of_two_fsdp2_ranks_mid_rollout_stops_both_in_seconds(tiny_model_dir, tmp_path):
    """FSDP2: both ranks asleep in a reward function at step 1, after the rollout's gathers (collectives
    that every rank finished), only rank 1 signalled: both leave the rollout at once, not at the step's
    end, with one checkpoint of step 1, and the run resumes from it to its end."""
    args = ["--model.reward_funcs=[tests.test_bad_input_signals.slow_on_every_rank]"]
    root, marker, logs = tmp_path / "stopped", tmp_path / "asleep", tmp_path / "stopped.log"
    env = {SLOW_STEP: "1", SLEEPING: str(marker)}
    ranks = start_two_ranks(fit_args(tiny_model_dir, str(root), 2, *args), env, logs, FSDP2)
    ckpt = stop_rank_one_once_both_sleep(ranks, marker, logs, root)

    logs = tmp_path / "resumed.log"
    ranks = start_two_ranks(
        fit_args(tiny_model_dir, str(root), 2, *args, f"--ckpt_path={ckpt}"), {}, logs, FSDP2
    )
    assert wait_for_ranks(ranks, logs, 300) == [0, 0], rank_outputs(logs)
    (last,) = root.glob("lightning_logs/version_1/checkpoints/epoch=0-step=2.ckpt")
    stopped, resumed = torch.load(ckpt, weights_only=True), torch.load(last, weights_only=True)
    assert stopped["global_step"] == 1 and resumed["global_step"] == 2


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


def test_a_stop_is_shared_between_ranks_through_the_store_and_agreed_on():
    """`io.shared_stops` on a one-rank gloo group: this rank's stop request is published in the store,
    another's (set there as its thread would) arrives as SIGTERM on the main thread, and `any_rank` says
    whether any rank asks to stop."""
    key = "grpo_lightning/stop/test"
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    received: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    shared = SharedStops(key, torch.device("cpu"))
    try:
        store = torch.distributed.distributed_c10d._get_default_store()
        assert shared.any_rank(True) and not shared.any_rank(False)
        store.set(key, "stop")  # another rank's request
        deadline = time.monotonic() + 5
        while not received and time.monotonic() < deadline:
            time.sleep(0.05)
        assert received == [signal.SIGTERM]

        shared.close()
        store.delete_key(key)
        stop_requests.clear()
        stop_requests.request_stop(RuntimeError)  # this rank's own, outside interruptible code
        shared = SharedStops(key, torch.device("cpu"))
        deadline = time.monotonic() + 5
        while not store.check([key]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert store.check([key]), "this rank's stop was never published"
    finally:
        shared.close()
        stop_requests.clear()
        signal.signal(signal.SIGTERM, previous)
        torch.distributed.destroy_process_group()


def test_a_rollout_reopened_after_the_ranks_agreed_is_interruptible_again_until_it_ends():
    """`core.stop_requests` on several ranks (a stand-in for their agreement): after the first collective
    of a rollout (`settle`) a stop waits; once the rollout `reopen`s (FSDP2's gathers done) it leaves at
    once, and tells the others; after `end_rollout` nothing reopens it. A rank stopped by another's request
    counts as stopped itself (so that `core.ranks.failures_agreed` takes it for a stop)."""

    class Stop(Exception):
        pass

    asked: list[bool] = []
    stop_requests.clear()
    stop_requests.share_between_ranks(lambda stop: asked.append(stop) or stop, Stop)
    try:
        stop_requests.enter_rollout()
        stop_requests.settle()  # nobody asked: go on
        stop_requests.request_stop(Stop)  # waits: no rank may leave alone between collectives
        stop_requests.check()
        with pytest.raises(Stop):
            stop_requests.reopen()  # the stop asked meanwhile leaves now
        stop_requests.abandon()  # as `InterruptCheckpoint.on_exception` does: the others are told
        assert asked == [False, True]

        stop_requests.clear()
        stop_requests.enter_rollout()
        stop_requests.end_rollout()  # the rollout is in
        stop_requests.request_stop(Stop)
        stop_requests.reopen()  # nothing to reopen: the stop waits for the next rollout
        stop_requests.check()
        assert asked == [False, True, False]

        stop_requests.clear()
        stop_requests.share_between_ranks(lambda stop: True, Stop)  # another rank asks
        stop_requests.enter_rollout()
        with pytest.raises(Stop):
            stop_requests.settle()
        assert stop_requests.stop_requested()
    finally:
        stop_requests.share_between_ranks(None)
        stop_requests.clear()
