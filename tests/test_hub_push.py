"""`cli.py export --push-to-hub REPO` against a local stand-in of the Hub's API (never the network): the
requests huggingface_hub's `create_repo` and `upload_folder` send, answered as the Hub does."""

import base64
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import huggingface_hub.constants
import pytest

from grpo_lightning.cli import main
from grpo_lightning.io import hub_push
from grpo_lightning.io.hub_push import push_folder
from tests.helpers import cli_error, files_of, one_error_line


class StandInHub(BaseHTTPRequestHandler):
    """The endpoints a push uses: create a repo, ask each file's upload mode ("regular": its bytes go
    base64 in the commit), and the commit, whose NDJSON lines it keeps. `refuse` answers 401 to all."""

    received: dict  # path in the repo -> bytes
    requests: list  # (method, path, Authorization header)
    created: list  # the bodies of the create requests
    refuse = False
    silent = False  # accept each request and never answer it (until `release` is set)
    release: threading.Event

    def log_message(self, *args) -> None:  # quiet
        pass

    def answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.silent:  # the connection stays open, unanswered, until the test ends (60 s at most)
            self.release.wait(60)
            return
        # huggingface_hub's user-agent lookup of known agent tools, at most daily: not the push.
        if self.path != "/api/agent-harnesses":
            self.requests.append(("GET", self.path, self.headers.get("Authorization")))
        self.answer(401 if self.refuse else 404, {"error": "Invalid credentials in Authorization header"})

    def do_POST(self) -> None:
        if self.silent:  # the connection stays open, unanswered, until the test ends (60 s at most)
            self.release.wait(60)
            return
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.requests.append(("POST", self.path, self.headers.get("Authorization")))
        endpoint = f"http://{self.headers['Host']}"
        if self.refuse:
            return self.answer(401, {"error": "Invalid credentials in Authorization header"})
        if self.path == "/api/repos/create":
            request = json.loads(body)
            self.created.append(request)
            return self.answer(200, {"url": f"{endpoint}/{request['organization']}/{request['name']}"})
        if "/preupload/" in self.path:
            files = json.loads(body)["files"]
            modes = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]
            return self.answer(200, {"files": modes, "commitOid": "0" * 40})
        if "/commit/" in self.path:
            for line in body.decode().splitlines():
                item = json.loads(line)
                if item["key"] == "file":
                    assert item["value"]["encoding"] == "base64"
                    self.received[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
            repo = self.path.split("/api/models/")[1].split("/commit/")[0]
            url = f"{endpoint}/{repo}/commit/{'1' * 40}"
            return self.answer(200, {"commitUrl": url, "commitOid": "1" * 40, "pullRequestUrl": None})
        self.answer(404, {"error": f"no such endpoint {self.path}"})


@pytest.fixture
def hub(monkeypatch):
    """The stand-in, serving in a thread; huggingface_hub's endpoint and token point at it."""
    release = threading.Event()
    handler = type("Hub", (StandInHub,), {"received": {}, "requests": [], "created": [], "release": release})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    # huggingface_hub reads HF_ENDPOINT once, at import, into constants.ENDPOINT; HfApi() reads that.
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", "hf_standin")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    yield handler
    release.set()
    server.shutdown()
    server.server_close()


def export_args(tiny_model_dir, tmp_path, good_checkpoint, *extra: str) -> list[str]:
    ckpt = tmp_path / "run.ckpt"
    ckpt.write_bytes(good_checkpoint)
    config = tmp_path / "config.yaml"
    config.write_text(f"model:\n  policy: {tiny_model_dir}\ntrainer:\n  logger: false\n")
    return [
        "export",
        "--config",
        str(config),
        "--ckpt_path",
        str(ckpt),
        "--out",
        str(tmp_path / "out"),
        *extra,
    ]


def test_export_pushes_every_exported_file_with_its_bytes(
    hub, tiny_model_dir, tmp_path, good_checkpoint, capsys
):
    main(
        export_args(
            tiny_model_dir, tmp_path, good_checkpoint, "--push-to-hub", "me/tiny-grpo", "--private", "true"
        )
    )
    exported = files_of(tmp_path / "out")
    assert "model.safetensors" in exported and "tokenizer.json" in exported
    assert hub.received == exported  # every file, the same bytes
    assert hub.created == [{"name": "tiny-grpo", "organization": "me", "visibility": "private"}]
    assert all(
        auth == "Bearer hf_standin" for _, _, auth in hub.requests
    )  # HF_TOKEN, read by huggingface_hub
    assert [path for method, path, _ in hub.requests] == [
        "/api/repos/create",
        "/api/models/me/tiny-grpo/preupload/main",
        "/api/models/me/tiny-grpo/commit/main",
    ]
    assert f"pushed {tmp_path / 'out'} to me/tiny-grpo: " in capsys.readouterr().out


def test_a_refused_push_is_one_error_line_and_the_export_stays(
    hub, tiny_model_dir, tmp_path, good_checkpoint, capsys
):
    hub.refuse = True
    err = cli_error(
        export_args(tiny_model_dir, tmp_path, good_checkpoint, "--push-to-hub", "me/tiny-grpo"), capsys
    )
    line = one_error_line(err)
    out = str(tmp_path / "out")
    assert line.startswith(
        f"error: cannot push {out!r} to the Hub repo 'me/tiny-grpo' at {huggingface_hub.constants.ENDPOINT}: "
    )
    assert "401" in line and f"the export stays in {out!r}" in line
    assert "model.safetensors" in os.listdir(out)
    assert hub.received == {}


def test_a_name_that_is_no_repo_id_is_refused_before_the_export(
    hub, tiny_model_dir, tmp_path, good_checkpoint, capsys
):
    err = cli_error(
        export_args(tiny_model_dir, tmp_path, good_checkpoint, "--push-to-hub", "me/tiny grpo!"), capsys
    )
    assert one_error_line(err).startswith(
        "error: --push-to-hub 'me/tiny grpo!' is not a Hub repo id (name or org/name): "
    )
    assert not os.path.exists(tmp_path / "out") and hub.requests == []


def test_push_folder_uploads_nested_files_with_the_hubs_default_visibility(hub, tmp_path):
    folder = tmp_path / "adapter"
    (folder / "sub").mkdir(parents=True)
    (folder / "adapter_config.json").write_text('{"r": 4}')
    (folder / "sub" / "weights.bin").write_bytes(bytes(range(256)) * 3)
    url = push_folder(str(folder), "me/adapter")
    assert url == f"{huggingface_hub.constants.ENDPOINT}/me/adapter/commit/{'1' * 40}"
    assert hub.received == {"adapter_config.json": b'{"r": 4}', "sub/weights.bin": bytes(range(256)) * 3}
    assert hub.created == [{"name": "adapter", "organization": "me"}]  # no --private: the Hub's default


def test_a_hub_that_never_answers_ends_the_push_in_one_line_and_the_export_stays(
    hub, tiny_model_dir, tmp_path, good_checkpoint, capsys, monkeypatch
):
    """A server that accepts the connection and never answers: past `TIMEOUT_SECONDS` the push is one error
    line, the export kept; huggingface_hub's client is put back as it was."""
    hub.silent = True
    monkeypatch.setattr(hub_push, "TIMEOUT_SECONDS", 1.0)
    start = time.perf_counter()
    err = cli_error(
        export_args(tiny_model_dir, tmp_path, good_checkpoint, "--push-to-hub", "me/tiny-grpo"), capsys
    )
    assert time.perf_counter() - start < 60
    line = one_error_line(err)
    out = str(tmp_path / "out")
    assert line.startswith(f"error: cannot push {out!r} to the Hub repo 'me/tiny-grpo'") and "Timeout" in line
    assert f"the export stays in {out!r}" in line and "model.safetensors" in os.listdir(out)
    assert (
        huggingface_hub.utils._http._GLOBAL_CLIENT_FACTORY
        is huggingface_hub.utils._http.default_client_factory
    )
