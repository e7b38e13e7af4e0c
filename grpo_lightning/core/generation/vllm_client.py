"""The trainer's side of stock `vllm serve` processes, over HTTP: one server (`VLLMServer`: every call under a
timeout, any failure one `ServerError` naming the server and the call), what it serves (`ServedModel`, read
before any weights move), and several behind one client (`ServerRouter`: each request to the least-loaded
server, a multi-turn sample's later turns to the server that holds its earlier ones, a bounded number of
requests in flight, each a future, so that a caller can keep requests running while it does other work).

Token ids in, token ids out: a prompt goes to `/v1/completions` as ids (`completion_body`), and the answer
comes back as each completion's ids and each drawn id's log-prob under the distribution it was drawn from
(`completion_rows`; the servers run with `--logprobs-mode processed_logprobs`).

No Lightning and no vLLM here: the standard library's HTTP client and torch only.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from grpo_lightning.core.generation.sampling import SamplingSettings

STICKY_SEQUENCES = 65536  # sequences whose server the router remembers (the oldest forgotten first)


class ServerError(RuntimeError):
    """A vLLM server that did not answer, or answered with an error; the message names the server and
    the call."""


class VLLMServer:
    """One `vllm serve` process at `url` (`http://host:port`); every call times out after `timeout` seconds
    without a byte from the server."""

    def __init__(self, url: str, timeout: float, served_name: str = "") -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.served_name = served_name  # what a request's `model` names on this server (`ServedModel.name`)
        self.in_flight = 0  # requests sent and not answered (the router's load)
        self._lock = threading.Lock()
        self._open: dict[
            http.client.HTTPConnection, threading.Event
        ] = {}  # calls' connections, each's `cancel`

    def call(
        self,
        method: str,
        route: str,
        body: dict | None = None,
        timeout: float | None = None,
        cancel: threading.Event | None = None,
    ) -> dict:
        """The JSON answer of `method route` with `body`; raises `ServerError` on a refused connection, a
        timeout or an HTTP error, naming the server and the call. `cancel`: set with `hang_up`, the call
        ends at once (or never starts), its connection closed."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + route, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        wait = self.timeout if timeout is None else timeout
        opened: list[http.client.HTTPConnection] = []
        opener = urllib.request.build_opener(_Tracked(self, cancel or threading.Event(), opened))
        try:
            with opener.open(request, timeout=wait) as response:
                text = response.read()
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:300]
            raise ServerError(
                f"vLLM server {self.url}: {method} {route} answered {err.code}: {detail}"
            ) from None
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as err:
            reason = getattr(err, "reason", err)
            if isinstance(reason, TimeoutError) or isinstance(err, TimeoutError):
                reason = f"no answer within {wait:g} s"
            raise ServerError(f"vLLM server {self.url}: {method} {route} failed: {reason}") from None
        finally:
            with self._lock:
                for connection in opened:
                    self._open.pop(connection, None)
        try:
            return json.loads(text) if text else {}
        except json.JSONDecodeError:  # a route that answers in plain text (`/v1/load_lora_adapter`)
            return {"text": text.decode(errors="replace")}

    def get(self, route: str, timeout: float | None = None) -> dict:
        return self.call("GET", route, timeout=timeout)

    def connected(self, connection: http.client.HTTPConnection, cancel: threading.Event) -> None:
        """`connection` is a call's, ended by `hang_up(cancel)`; refused where that came first."""
        with self._lock:
            if cancel.is_set():
                raise ConnectionAbortedError("the request was cancelled")
            self._open[connection] = cancel

    def hang_up(self, cancel: threading.Event) -> None:
        """End every call made with `cancel` (which is set here): their connections are shut, so that each
        call fails at once and the server, seeing its client gone, aborts the request (vLLM's routes stop
        generating for a client that hung up); a call not yet connected never connects."""
        with self._lock:
            cancel.set()
            hung = [connection for connection, its in self._open.items() if its is cancel]
        for connection in hung:
            if connection.sock is not None:
                with contextlib.suppress(OSError):  # closed meanwhile
                    connection.sock.shutdown(socket.SHUT_RDWR)

    def post(
        self,
        route: str,
        body: dict | None = None,
        timeout: float | None = None,
        cancel: threading.Event | None = None,
    ) -> dict:
        return self.call("POST", route, {} if body is None else body, timeout, cancel)


class _Tracked(urllib.request.HTTPHandler):
    """urllib's HTTP handler whose connections `server` knows while the call runs (`VLLMServer.hang_up`)."""

    def __init__(self, server: VLLMServer, cancel: threading.Event, opened: list) -> None:
        super().__init__()
        self.server, self.cancel, self.opened = server, cancel, opened

    def http_open(self, request: urllib.request.Request):
        def connection(host: str, **kwargs) -> http.client.HTTPConnection:
            made = _Connection(host, self.cancel, **kwargs)
            self.server.connected(made, self.cancel)
            self.opened.append(made)
            return made

        return self.do_open(connection, request)


class _Connection(http.client.HTTPConnection):
    """An HTTP connection that `hang_up` may cut: connected after the cut, it closes at once."""

    def __init__(self, host: str, cancel: threading.Event, **kwargs) -> None:
        super().__init__(host, **kwargs)
        self.cancel = cancel

    def connect(self) -> None:
        super().connect()
        if self.cancel.is_set():  # `hang_up` found no socket to shut: it came between
            self.sock.close()
            raise ConnectionAbortedError("the request was cancelled")


def wait_until_up(servers: Sequence[VLLMServer], timeout: float, poll: float = 1.0) -> None:
    """Wait until every server answers `/v1/models`, at most `timeout` seconds in all; then raise one
    `ServerError` naming those that did not."""
    deadline = time.monotonic() + timeout
    waiting = list(servers)
    while waiting:
        last = {}
        for server in list(waiting):
            try:
                server.get("/v1/models", timeout=min(poll * 5, max(deadline - time.monotonic(), 0.1)))
                waiting.remove(server)
            except ServerError as err:
                last[server.url] = str(err)
        if waiting and time.monotonic() >= deadline:
            names = ", ".join(s.url for s in waiting)
            raise ServerError(
                f"vLLM server(s) {names} not reachable within vllm_server_timeout={timeout:g} s "
                f"(last: {last[waiting[0].url]}); start them with `python cli.py vllm-serve --model ...`"
            )
        if waiting:
            time.sleep(poll)


@dataclass(frozen=True)
class ServedModel:
    """What a server serves, as the pre-flight compares it with the policy: the served name (a request's
    `model`), its architecture and vocabulary (from its worker's module tree), the longest prompt +
    completion it takes, the largest LoRA rank it serves (None: LoRA off), its device type, its workers'
    extension class (`--worker-extension-cls`) and the format it loaded its weights in (`--load-format`)."""

    name: str
    architecture: str
    vocab_size: int
    max_model_len: int
    max_lora_rank: int | None
    device: str = "cuda"
    worker_extension: str = ""
    load_format: str = "auto"


def served_model(server: VLLMServer) -> ServedModel:
    """Ask `server` what it serves (`/server_info` and the worker's `get_model_inspection`, dev mode)."""
    config = server.get("/server_info?config_format=json")["vllm_config"]
    inspection = server.post("/collective_rpc", {"method": "get_model_inspection"})["results"][0]
    vocab = re.search(r"org_vocab_size=(\d+)", inspection) or re.search(r"num_embeddings=(\d+)", inspection)
    lora = config.get("lora_config")
    return ServedModel(
        name=config["model_config"]["served_model_name"],
        architecture=inspection.split("(", 1)[0].strip(),
        vocab_size=int(vocab.group(1)) if vocab else -1,
        max_model_len=int(config["model_config"]["max_model_len"]),
        max_lora_rank=int(lora["max_lora_rank"]) if lora else None,
        device=str(config.get("device_config", {}).get("device", "cuda")),
        worker_extension=str(config.get("parallel_config", {}).get("worker_extension_cls", "")),
        load_format=str(config.get("load_config", {}).get("load_format", "auto")),
    )


def completion_body(
    model: str, prompt: list[int], settings: SamplingSettings, n: int, do_sample: bool
) -> dict:
    """The `/v1/completions` body of one prompt's `n` completions: its ids, `settings` one to one, each drawn
    id's log-prob (`logprobs: 0`: the drawn one alone) and the ids back (`return_token_ids`); greedy draws
    once at temperature 0 with the penalties and min-p neutral (as the eager path's greedy decoding). The
    penalties `settings` has none of are sent neutral too, so that no default of the server's (a
    checkpoint's generation config) changes the distribution. No seed: per-request seeds break vLLM's CPU
    prefill; the server's seed holds."""
    s = settings
    sampled = s.vllm_knobs()
    return {
        "model": model,
        "prompt": prompt,
        "n": n if do_sample else 1,
        "max_tokens": s.max_new_tokens,
        "min_tokens": s.min_new_tokens,
        "stop_token_ids": list(s.eos_token_ids),
        "ignore_eos": False,
        "skip_special_tokens": False,
        "logprobs": 0,
        "return_token_ids": True,
        # Neutral, not the server's defaults: a checkpoint's generation config would otherwise set them.
        "repetition_penalty": 1.0,
        "min_p": 0.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        **(sampled if do_sample else {"temperature": 0.0}),
    }


def completion_rows(answer: dict) -> list[tuple[list[int], list[float]]]:
    """Each completion of a `/v1/completions` answer, in order: its ids and each one's log-prob."""
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    return [(list(c["token_ids"]), list(c["logprobs"]["token_logprobs"])) for c in choices]


class ServerRouter:
    """Requests to several servers: each to the least-loaded one (fewest in flight), except a prompt that
    continues a sequence one of them generated (a multi-turn sample's next turn), which goes back to that
    server, whose prefix cache holds it. At most `max_in_flight` requests run at once, the others queue.

    `submit` returns a future of the completion rows. Requests ask each server for the model it serves (its
    `served_name`), or for the LoRA adapter loaded last on all of them (`serve`)."""

    def __init__(self, servers: Sequence[VLLMServer], max_in_flight: int) -> None:
        self.servers = list(servers)
        self.model: str | None = None  # the adapter every server serves, once one is loaded
        self.pool = ThreadPoolExecutor(max_workers=max_in_flight, thread_name_prefix="vllm-request")
        self.lock = threading.Lock()
        self.sticky: OrderedDict[tuple[int, ...], VLLMServer] = OrderedDict()
        self.lengths: dict[int, int] = {}  # remembered sequences by length (which prefixes to look up)
        self.cancel = threading.Event()  # set by `hang_up`: the requests submitted until then

    def serve(self, model: str) -> None:
        """Requests from now on ask every server for `model` (a LoRA adapter loaded on all of them)."""
        self.model = model

    def forget(self) -> None:
        """Drop the remembered sequences (new weights: no server's cache holds them any more)."""
        with self.lock:
            self.sticky.clear()
            self.lengths.clear()

    def _pick(self, prompt: list[int]) -> VLLMServer:
        with self.lock:
            for length in sorted((n for n in self.lengths if n <= len(prompt)), reverse=True):
                server = self.sticky.get(tuple(prompt[:length]))
                if server is not None:
                    break
            else:
                server = min(self.servers, key=lambda s: s.in_flight)
            server.in_flight += 1
            return server

    def _remember(self, sequence: tuple[int, ...], server: VLLMServer) -> None:
        with self.lock:
            if sequence not in self.sticky:
                self.lengths[len(sequence)] = self.lengths.get(len(sequence), 0) + 1
            self.sticky[sequence] = server
            self.sticky.move_to_end(sequence)
            while len(self.sticky) > STICKY_SEQUENCES:
                old, _ = self.sticky.popitem(last=False)
                self.lengths[len(old)] -= 1
                if not self.lengths[len(old)]:
                    del self.lengths[len(old)]

    def _run(
        self, prompt: list[int], settings: SamplingSettings, n: int, do_sample: bool, cancel: threading.Event
    ):
        server = self._pick(prompt)
        try:
            body = completion_body(self.model or server.served_name, prompt, settings, n, do_sample)
            answer = server.post("/v1/completions", body, cancel=cancel)
        finally:
            with self.lock:
                server.in_flight -= 1
        rows = completion_rows(answer)
        if len(self.servers) > 1:
            for ids, _ in rows:
                self._remember(tuple(prompt + ids), server)
        return rows

    def submit(
        self, prompt: list[int], settings: SamplingSettings, n: int, do_sample: bool
    ) -> Future[list[tuple[list[int], list[float]]]]:
        """Send one prompt's request; the future holds its completion rows (`completion_rows`)."""
        return self.pool.submit(self._run, prompt, settings, n, do_sample, self.cancel)

    def hang_up(self) -> None:
        """End every request submitted so far, within a moment (a stop request: the rollout is abandoned):
        those queued fail without starting, those running fail as their connections are shut, and the
        servers abort them (`VLLMServer.hang_up`). Requests submitted later run as before."""
        cancel, self.cancel = self.cancel, threading.Event()
        for server in self.servers:
            server.hang_up(cancel)

    def each(self, route: str, body: dict | None = None, timeout: float | None = None) -> list[dict]:
        """POST `route` to every server, one after the other; their answers."""
        return [server.post(route, body, timeout) for server in self.servers]

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
