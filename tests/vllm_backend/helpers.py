"""What the vLLM test files share: an engine on a model, the gap between its sampled log-probs and the
scorer's on the same tokens, `vllm serve` processes for the server engine, and the check of asynchronous
rollouts' version stamps."""

from __future__ import annotations

import copy
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import lightning as L
import torch
from torch import Tensor
from transformers import PreTrainedModel

from grpo_lightning.core.generation.logprobs import completion_logprobs
from grpo_lightning.core.generation.sampling import SamplingSettings
from grpo_lightning.core.generation.vllm_engine import VLLMEngine, VLLMOptions
from grpo_lightning.core.generation.vllm_server import VLLMServerEngine
from grpo_lightning.core.generation.vllm_server_options import VLLMServerOptions
from grpo_lightning.core.types import Rollout
from grpo_lightning.io.vllm_serve import serve_command, stop, wait_ready

PROMPTS = torch.tensor([[0, 0, 11, 12, 13, 14], [21, 22, 23, 24, 25, 26]])  # [2, 6] left-padded
MASK = (PROMPTS != 0).long()  # [2, 6]


def engine_for(
    model: PreTrainedModel, dtype: torch.dtype | None = None, engine: dict | None = None, **settings
) -> VLLMEngine:
    """A vLLM engine for `model` (started on its first rollout): 8 new tokens, stop at id 2, pad 0;
    `engine`: `VLLMOptions` fields and `VLLMEngine` keywords (`max_model_len`, `block_size`) over the tests'
    own."""
    options = dict(max_new_tokens=8, eos_token_ids=(2,), pad_token_id=0)
    sampling = SamplingSettings(**{**options, **settings})
    vllm = {"max_model_len": 64, "kv_cache_gb": 0.05, "enforce_eager": True, **(engine or {})}
    keywords = {name: vllm.pop(name) for name in ("max_model_len", "block_size") if name in vllm}
    return VLLMEngine(sampling, VLLMOptions(**vllm), dtype=dtype, **keywords)


def scored(model: PreTrainedModel, rollout: Rollout, temperature: float = 1.0) -> Tensor:
    """The scorer's float32 log-probs `[B, T]` of `rollout`'s completions under `model`, 0 after the end."""
    with torch.no_grad():
        logprobs, _ = completion_logprobs(
            model,
            rollout.input_ids,
            rollout.attention_mask,
            rollout.completion_ids.size(1),
            temperature=temperature,
        )
    return logprobs * rollout.completion_mask


def sampled_gap(
    engine: VLLMEngine | VLLMServerEngine,
    model: PreTrainedModel,
    G: int = 4,
    temperature: float = 1.0,
    prompts: tuple[Tensor, Tensor] = (PROMPTS, MASK),
) -> float:
    """The largest |sampler - scorer| log-prob over a fresh rollout's tokens of `prompts` (ids, mask)."""
    rollout = engine.generate(model, *prompts, num_generations=G)
    mask = rollout.completion_mask.bool()
    return float((rollout.sampler_logprobs - scored(model, rollout, temperature))[mask].abs().max())


def adamw_steps(model: PreTrainedModel, steps: int = 3, lr: float = 1e-2) -> None:
    """`steps` AdamW steps raising the log-probs of fixed tokens: every trainable weight moves."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr)
    ids = torch.arange(3, 19).view(2, 8)  # [2, 8]
    for _ in range(steps):
        logprobs, _ = completion_logprobs(model, ids, torch.ones_like(ids), 4)
        (-logprobs.mean()).backward()
        optimizer.step()
        optimizer.zero_grad()


# ---------------------------------------------------------------------------------------- vLLM servers
SERVER_START_SECONDS = 400  # a server's start-up on 2 shared cores, tiny model, eager


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_servers(
    model_dir: str, count: int = 1, lora_rank: int | None = None, max_model_len: int = 128
) -> Iterator[list[Server]]:
    """`count` `vllm serve` processes of `model_dir` on 127.0.0.1 (float32, eager, 1 GB of KV cache, blocks of
    32 tokens, the smallest vLLM's CPU attention takes: a short prompt fills whole blocks), started
    together by `cli.py vllm-serve`'s command; each stopped (its process group) on exit."""
    servers = []
    try:
        for _ in range(count):
            port = free_port()
            extra = ["--dtype", "float32", "--enforce-eager", "--max-model-len", str(max_model_len)]
            extra += ["--block-size", "32"]
            command, env = serve_command(
                model_dir, port=port, lora_rank=lora_rank, kv_cache_gb=1, extra=extra
            )
            log = tempfile.NamedTemporaryFile(prefix=f"vllm-server-{port}-", suffix=".log", delete=False)
            process = subprocess.Popen(command, env=env, start_new_session=True, stdout=log, stderr=log)
            servers.append(Server(f"http://127.0.0.1:{port}", process, log.name))
        for server in servers:
            try:
                wait_ready(server.url, server.process, SERVER_START_SECONDS)
            except (RuntimeError, TimeoutError) as err:
                with open(server.log) as f:
                    raise RuntimeError(f"{err}; its log ends:\n{f.read()[-3000:]}") from None
        yield servers
    finally:
        for server in servers:
            stop(server.process, grace=10)


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    log: str


def server_engine(urls: list[str], **options) -> VLLMServerEngine:
    """A server engine on `urls`: 8 new tokens, stop at id 2, pad 0; `options`: `VLLMServerOptions` fields."""
    sampling = SamplingSettings(max_new_tokens=8, eos_token_ids=(2,), pad_token_id=0)
    return VLLMServerEngine(
        sampling, VLLMServerOptions(base_url=urls, **{"timeout": 30, **options}), max_len=64
    )


# ------------------------------------------------------------------------------- asynchronous rollouts
@dataclass
class Update:
    """One update's groups: their staleness, the largest |sampler - scorer| log-prob gap on the model's own
    tokens under a copy of the weights they are stamped with (`then`) and under the policy now (`now`),
    whether their anchor was computed, their prompts, their rollout."""

    staleness: int
    then: float
    now: float
    anchored: bool
    prompts: list[str]
    rollout: Rollout


class VersionStamps(L.Callback):
    """Keeps `module`'s weights at every version a batch is submitted under (its group source's `next`
    wrapped), and checks each update's groups against the copy of their stamped version (`updates`)."""

    def __init__(self, module: L.LightningModule) -> None:
        self.weights: dict[int, dict] = {}  # the policy's weights at each version a batch was submitted under
        self.handed: list[str] = []  # the prompts the data loader handed the source
        self.updates: list[Update] = []
        source_next = module.group_source.next

        def next_groups(batch, state):
            self.weights.setdefault(state.global_step, copy.deepcopy(module.policy.state_dict()))
            self.handed.extend(map(str, batch["prompt"]))
            return source_next(batch, state)

        module.group_source.next = next_groups

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        scorer_copy = copy.deepcopy(pl_module.policy)
        build = pl_module.update.trajectory

        def trajectory(scored, policy, reference, stats, version):
            rollout, mask = scored.rollout, scored.rollout.model_mask.bool()
            scorer_copy.load_state_dict(self.weights[scored.policy_version])
            with torch.no_grad():
                then = pl_module.rollouts.scorer(scorer_copy, rollout, slice(None))[0]
                now = pl_module.rollouts.scorer(policy, rollout, slice(None))[0]
            sampler = rollout.sampler_logprobs
            built = build(scored, policy, reference, stats, version)
            update = Update(
                version - scored.policy_version,
                float((sampler - then)[mask].abs().max()),
                float((sampler - now)[mask].abs().max()),
                built.old_logprobs is not None,
                list(map(str, scored.prompts)),
                rollout,
            )
            self.updates.append(update)
            return built

        pl_module.update.trajectory = trajectory
