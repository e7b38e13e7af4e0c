"""A stop request (SIGTERM) ends a long rollout of the vLLM engines within seconds: the colocated engine
answers it between two decoding steps and aborts its requests, so that the engine is left empty and samples
again as before; the server engine hangs up its requests, and a real server aborts them; `cli.py fit` on
two ranks of the colocated engine leaves the rollout on both, writes its checkpoint and exits 143, as on
the eager engine."""

import os
import signal
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo_lightning.core import stop_requests
from tests.test_bad_input_signals import SLEEPING, start_two_ranks, stop_rank_one_once_both_sleep
from tests.test_interrupt import fit_args
from tests.vllm_backend.helpers import MASK, PROMPTS, engine_for, running_servers, server_engine

pytestmark = pytest.mark.vllm

LONG = 1000  # new tokens a completion must reach (EOS suppressed): far longer than the test waits


class Stop(Exception):
    pass


def sigterm_after(seconds: float, received: list[float]) -> threading.Timer:
    """SIGTERM to this process after `seconds`, its handler noting when (in `received`) and asking
    `core.stop_requests` to stop, as the trainer's does (`InterruptCheckpoint`)."""

    def on_sigterm(signum, frame) -> None:
        received.append(time.monotonic())
        stop_requests.request_stop(Stop)

    signal.signal(signal.SIGTERM, on_sigterm)
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    return timer


def test_a_stop_ends_a_long_colocated_rollout_between_steps_and_leaves_the_engine_empty(vllm_model_dir):
    model = AutoModelForCausalLM.from_pretrained(vllm_model_dir)
    engine = engine_for(model, engine={"max_model_len": 1024}, max_new_tokens=LONG, min_new_tokens=LONG)
    try:
        engine.refresh(model, PROMPTS.device)  # started and pushed before the clock runs
        previous = signal.getsignal(signal.SIGTERM)
        stop_requests.clear()
        stop_requests.enter_rollout()  # one process: a training step's rollout, interruptible
        received: list[float] = []
        timer = sigterm_after(1.0, received)
        try:
            with pytest.raises(Stop):
                engine.generate(model, PROMPTS, MASK, num_generations=2)
            took = time.monotonic() - received[0]
        finally:
            timer.cancel()
            stop_requests.clear()
            signal.signal(signal.SIGTERM, previous)
        assert took < 5, f"{took:.1f} s after the signal"
        assert not engine.llm.llm_engine.has_unfinished_requests(), "requests left running in vLLM"

        short = engine_for(model).settings  # the engine samples again, from an empty queue
        rollout = engine.generate(model, PROMPTS, MASK, num_generations=2, settings=short)
        assert rollout.completion_ids.shape[0] == 4 and rollout.completion_ids.shape[1] <= 8
    finally:
        engine.close()


def fit_with_a_slow_colocated_engine() -> None:
    """`cli.py` whose colocated engine decodes its second rollout (step 1's) at one step per 0.1 s (a
    stand-in for a rollout of minutes), each rank writing its process id to
    `<GRPO_TEST_SLEEP_MARKER>.rank<r>` as that rollout starts."""
    from grpo_lightning.cli import main
    from grpo_lightning.core.generation.vllm_engine import VLLMEngine

    generate, calls = VLLMEngine.generate, []

    def slow(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            engine = self.llm.llm_engine
            step = engine.step

            def slow_step():
                time.sleep(0.1)
                return step()

            engine.step = slow_step
            rank = torch.distributed.get_rank()
            Path(f"{os.environ[SLEEPING]}.rank{rank}").write_text(str(os.getpid()))
        return generate(self, *args, **kwargs)

    VLLMEngine.generate = slow
    main()


def test_sigterm_to_one_of_two_ranks_mid_rollout_of_the_colocated_engine_stops_both_in_seconds(
    vllm_model_dir, tmp_path
):
    """Both ranks decoding step 1's rollout (90 s at 0.1 s a step), only rank 1 signalled: both leave it
    within seconds, write one checkpoint of step 1 and exit 143, as on the eager engine."""
    args = [
        "--model.grpo.generation_backend=vllm",
        "--model.grpo.vllm_kv_cache_gb=0.05",
        "--model.grpo.vllm_enforce_eager=true",
        "--model.grpo.max_completion_length=900",
        "--model.grpo.min_completion_length=900",
    ]
    root, marker, logs = tmp_path / "run", tmp_path / "decoding", tmp_path / "fit.log"
    fit = ("-c", "import tests.vllm_backend.test_vllm_stops as t; t.fit_with_a_slow_colocated_engine()")
    env = {SLEEPING: str(marker)}
    ranks = start_two_ranks(fit_args(vllm_model_dir, str(root), 3, *args), env, logs, cli=fit)
    stop_rank_one_once_both_sleep(ranks, marker, logs, root)


def running_requests(url: str) -> float:
    """The requests a vLLM server is decoding now (its Prometheus gauge)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(
        float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:num_requests_running")
    )


def test_a_stop_hangs_up_a_servers_long_requests_and_the_server_aborts_them(vllm_tied_dir):
    model = AutoModelForCausalLM.from_pretrained(vllm_tied_dir)
    long = engine_for(model, max_new_tokens=LONG, min_new_tokens=LONG).settings
    with running_servers(vllm_tied_dir, max_model_len=1024) as (server,):
        engine = server_engine([server.url], request_timeout=300)
        previous = signal.getsignal(signal.SIGTERM)
        stop_requests.clear()
        try:
            engine.refresh(model, PROMPTS.device)
            stop_requests.enter_rollout()
            received: list[float] = []
            timer = sigterm_after(2.0, received)
            prompts = torch.randint(3, 390, (32, 6), generator=torch.Generator().manual_seed(0))  # [32, 6]
            with pytest.raises(Stop):  # 256 completions of 1000 tokens: half a minute of decoding here
                engine.generate(model, prompts, torch.ones_like(prompts), num_generations=8, settings=long)
            timer.cancel()
            assert time.monotonic() - received[0] < 2
            deadline = time.monotonic() + 15
            while running_requests(server.url) > 0:  # the server stops decoding for clients gone
                assert time.monotonic() < deadline, "the server kept decoding the abandoned requests"
                time.sleep(0.2)
        finally:
            stop_requests.clear()
            signal.signal(signal.SIGTERM, previous)
            engine.close()
