"""A stop request (SIGTERM) ends a long rollout of the vLLM engines within seconds: the colocated engine
answers it between two decoding steps and aborts its requests, so that the engine is left empty and samples
again as before."""

import os
import signal
import threading
import time

import pytest
from transformers import AutoModelForCausalLM

from grpo_lightning.core import stop_requests
from tests.vllm_backend.helpers import MASK, PROMPTS, engine_for

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
