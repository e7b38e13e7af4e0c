"""Start a stock vLLM OpenAI server that the `vllm_server` rollout engine can drive (`python cli.py
vllm-serve --model PATH_OR_ID [--port 8000] [--tensor-parallel-size N] [--lora-rank R] [any vllm serve
flag]`).

It runs vLLM's own server module (`vllm.entrypoints.openai.api_server`: the `vllm` console script of the CPU
build fails on its distribution's name) with what the engine's pushes and log-probs need: the NCCL weight
transfer configured, the log-probs of the distribution each token was drawn from (`processed_logprobs`), any
number of log-probs, vLLM's own sampling defaults rather than the checkpoint's generation config (the
engine sends every setting), the development routes (`VLLM_SERVER_DEV_MODE=1`: `/collective_rpc`,
`/reset_prefix_cache`), the workers' extension that repacks a tied LM head after a push on CPU
(`io.vllm_worker`) and, with `--lora-rank`, LoRA adapters loaded at run time. On a machine without CUDA it
also preloads Intel OpenMP where the environment has it and sizes the KV pool (`--kv-cache-gb`). Any other
flag goes to vLLM unchanged. It prints where it listens once the server answers, then waits for it; Ctrl-C or
SIGTERM stops it.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.request

# vLLM's LoRA slots come in these ranks; an adapter of rank r takes the smallest one >= r.
from grpo_lightning.core.generation.vllm_engine import LORA_RANKS

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
WORKER_EXTENSION = "grpo_lightning.io.vllm_worker.PushExtension"  # the tied head's repack after a CPU push


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="cli.py vllm-serve",
        description="Start a vLLM server for the vllm_server rollout engine; other flags go to vLLM.",
    )
    parser.add_argument("--model", required=True, help="a local folder or a Hugging Face model id")
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="the port (default 8000)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs per server (default 1)")
    parser.add_argument(
        "--lora-rank", type=int, default=None, help="serve LoRA adapters up to this rank (a LoRA policy's r)"
    )
    parser.add_argument(
        "--kv-cache-gb", type=float, default=1.0, help="the KV pool in GB without CUDA (default 1)"
    )
    parser.add_argument(
        "--ready-timeout", type=float, default=600.0, help="seconds to wait for the server to answer"
    )
    return parser.parse_known_args(argv)


def serve_command(
    model: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    tensor_parallel_size: int = 1,
    lora_rank: int | None = None,
    kv_cache_gb: float = 1.0,
    extra: list[str] = (),
) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of a server for `model` on `host:port` with the flags the engine
    needs (see the module docstring), `extra` vLLM flags after them."""
    command = [
        sys.executable, "-m", SERVER_MODULE, "--model", model, "--host", host, "--port", str(port),
        "--tensor-parallel-size", str(tensor_parallel_size),
        "--weight-transfer-config", '{"backend": "nccl"}',
        "--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1",
        "--worker-extension-cls", WORKER_EXTENSION,
        "--generation-config", "vllm",
    ]  # fmt: skip
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    # The workers import the extension from this package's folder, installed or not.
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    if lora_rank is not None:
        slot = next((r for r in LORA_RANKS if r >= lora_rank), lora_rank)
        command += ["--enable-lora", "--max-lora-rank", str(slot), "--max-loras", "1"]
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    if not _has_cuda():
        env.setdefault("VLLM_TARGET_DEVICE", "cpu")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{kv_cache_gb:g}")
        openmp = os.path.join(sys.prefix, "lib", "libiomp5.so")
        if os.path.exists(openmp) and openmp not in env.get("LD_PRELOAD", ""):
            env["LD_PRELOAD"] = ":".join(filter(None, [openmp, env.get("LD_PRELOAD")]))
    return command + list(extra), env


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def wait_ready(url: str, process: subprocess.Popen, timeout: float) -> None:
    """Wait until the server at `url` answers `/v1/models`; raise if it exits or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the vLLM server for {url} exited with code {process.returncode}")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5):
                return
        except OSError:
            time.sleep(1.0)
    raise TimeoutError(f"the vLLM server for {url} did not answer within {timeout:g} s")


def stop(process: subprocess.Popen, grace: float = 30.0) -> None:
    """Stop the server and the workers it started (its process group): SIGTERM, then SIGKILL after `grace`."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    """`cli.py vllm-serve`: start the server, print where it listens, wait for it; its exit code."""
    args, extra = parse_args(argv)
    command, env = serve_command(
        args.model,
        host=args.host,
        port=args.port,
        tensor_parallel_size=args.tensor_parallel_size,
        lora_rank=args.lora_rank,
        kv_cache_gb=args.kv_cache_gb,
        extra=extra,
    )
    process = subprocess.Popen(command, env=env, start_new_session=True)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # out of `wait`, into `finally`: the server stops
    url = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{args.port}"
    try:
        wait_ready(url, process, args.ready_timeout)
        lora = f", LoRA up to rank {args.lora_rank}" if args.lora_rank else ""
        print(
            f"vLLM server for {args.model} listening on http://{args.host}:{args.port}{lora} "
            f"(pid {process.pid}); train with `model.grpo.vllm_server_base_url: {url}`",
            flush=True,
        )
        return process.wait()
    except KeyboardInterrupt:
        return 130
    finally:
        stop(process)


if __name__ == "__main__":
    raise SystemExit(main())
