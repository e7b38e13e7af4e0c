"""A stop request (SIGTERM) during a rollout of the server engine, against a local stand-in of a vLLM server
that takes half a minute per completion: the trainer leaves at once, and every request in flight is hung
up (its connection shut, which a vLLM server answers by aborting the request), none left running for the
process's exit to wait on."""

import os
import signal
import threading
import time
from concurrent.futures import wait

import pytest
import torch
from transformers import LlamaForCausalLM

from grpo_lightning.core import stop_requests
from grpo_lightning.core.generation.vllm_server import VLLMServerEngine
from grpo_lightning.core.generation.vllm_server_options import VLLMServerOptions
from tests.test_vllm_server_requests import SETTINGS, StandIn, tiny_config


class Stop(Exception):
    pass


def test_a_stop_hangs_up_the_requests_in_flight(tmp_path):
    slow = StandIn(delay=30)
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config())
    options = VLLMServerOptions(base_url=slow.url, timeout=5, request_timeout=60, max_in_flight=2)
    engine = VLLMServerEngine(SETTINGS, options, max_len=64)
    prompts = torch.tensor([[0, 5, 6], [7, 8, 9], [3, 4, 5]])  # 3 requests: 2 running, 1 queued
    received: list[float] = []

    def on_sigterm(signum, frame) -> None:
        received.append(time.monotonic())
        stop_requests.request_stop(Stop)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    stop_requests.clear()
    try:
        engine.refresh(model, torch.device("cpu"))  # the push, before the clock runs
        stop_requests.enter_rollout()  # one process: a step's rollout, interruptible
        timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM))
        timer.start()
        with pytest.raises(Stop):
            engine.generate(model, prompts, (prompts != 0).long(), num_generations=2)
        assert time.monotonic() - received[0] < 2
        _, running = wait(engine.in_flight, timeout=2)
        assert not running, f"{len(running)} of {len(engine.in_flight)} requests still waiting for the server"
        assert time.monotonic() - received[0] < 4

        slow.delay = 0  # requests made after the stop run as before
        rollout = engine.generate(model, prompts[:1], (prompts[:1] != 0).long(), num_generations=2)
        assert rollout.completion_ids.shape == (2, 4)
    finally:
        stop_requests.clear()
        signal.signal(signal.SIGTERM, previous)
        engine.close()
        slow.close()
