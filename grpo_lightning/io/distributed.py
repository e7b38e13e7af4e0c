"""Sharding a Hugging Face causal LM with FSDP2, generating under sharding, and exporting what it trained.

FSDP2 (`torch.distributed.fsdp.fully_shard`) keeps every parameter as a DTensor shard and all-gathers one
unit (a decoder layer, or the root: embeddings, final norm, LM head) around that unit's `forward`. Two
things in GRPO do not fit that pattern, and this file handles both (and `StrategyRanks`, the other
processes as the update asks for them):

- `generate` runs the model once per new token, and ranks stop at different lengths. Gathering layer by
  layer would be one all-gather per layer per token, and collectives that the other rank never joins.
  `gathered_for_generation` all-gathers every unit once, keeps them gathered through `generate` (which
  then needs no collective at all: `sampling.generate_completions` also turns off transformers' lockstep
  decoding, its default for an FSDP-managed model), and reshards afterwards. Training and
  `GSM8KAccuracyCallback` both generate this way.
- `completion_logprobs` calls the decoder and the LM head directly, so that the head only runs over the
  completion positions; the root's own forward, where FSDP2 gathers the embeddings and the head, never
  runs. `call_in_root_forward` runs the function as the root's forward, inside its FSDP hooks.

Nothing here imports Lightning: the module passes in the device mesh and the trainer's precision.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.utils._pytree import tree_map_only

from grpo_lightning.core.generation.vllm_engine import shutdown_engines
from grpo_lightning.core.ranks import OneProcess
from grpo_lightning.core.stop_requests import settle


def is_sharded(model: nn.Module) -> bool:
    """True once `shard_model` has been applied to `model` (FSDP2 changes its class)."""
    return isinstance(model, FSDPModule)


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy | None:
    """FSDP2's mixed precision for a Lightning precision flag.

    "bf16-mixed" keeps float32 master weights, gradients and optimizer states in the shards, all-gathers
    the weights in bfloat16 for compute and reduces gradients in float32. Every other flag keeps the
    weights' own dtype ("bf16-true": load the model with `ModelOptions(dtype="bfloat16")`).
    """
    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return None


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a (PEFT-wrapped) HF causal LM, `model.model.layers` in Llama or Qwen."""
    decoder = model.get_decoder()
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(f"{type(decoder).__name__} has no `layers` ModuleList: cannot pick FSDP units")
    return list(layers)


def shard_model(
    model: nn.Module, mesh: Any, mp_policy: MixedPrecisionPolicy | None = None, cpu_offload: bool = False
) -> nn.Module:
    """`fully_shard` each decoder layer, then the whole model (whose own unit keeps embeddings, final norm
    and LM head, so that tied embeddings stay one parameter). Returns `model`, sharded in place.

    `cpu_offload` keeps the shards and their gradients in CPU memory (FSDP2's `CPUOffloadPolicy`): each
    unit is copied to the device for its forward and backward, and the optimizer steps on the CPU. Pinned
    memory where CUDA is available (asynchronous copies); plain memory otherwise, as a CPU-only process
    cannot pin. Applying it twice is an error in FSDP2; callers check `is_sharded` first.
    """
    kwargs: dict[str, Any] = {"mesh": mesh}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def shard_models(
    policy: nn.Module, reference: nn.Module | None, mesh: Any, precision: str, cpu_offload: bool
) -> None:
    """Shard the policy and its reference (the reference too: it is never gathered whole) on `mesh`'s
    `data_parallel` dimension, unless the policy is sharded already (a second `configure_model`). FSDP2
    only: a `tensor_parallel` dimension larger than 1 is refused."""
    if is_sharded(policy):
        return
    if mesh["tensor_parallel"].size() != 1:
        raise ValueError("GRPOModule shards with FSDP2 only: set tensor_parallel_size=1")
    mp_policy = mixed_precision_policy(precision)
    for model in (policy, reference):
        if model is not None:
            shard_model(model, mesh["data_parallel"], mp_policy, cpu_offload)


def _fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextmanager
def gathered_for_generation(model: nn.Module) -> Iterator[None]:
    """All-gather the full weights once, keep them through `generate`, reshard on exit.

    Inside, every forward finds its unit already gathered and no unit reshards after its forward, so
    `generate` issues no collective: each rank may stop after a different number of tokens. It costs the
    full model in the all-gather dtype on every rank for as long as the rollout runs. A model that is not
    sharded passes through untouched.
    """
    if not is_sharded(model):
        yield
        return
    settle()  # the gathers are collectives: on several ranks, a step's rollout is no longer left alone
    units = _fsdp_modules(model)
    model.set_reshard_after_forward(False)  # recurses into every unit
    for unit in units:  # the same order on every rank, so the all-gathers pair up
        unit.unshard()
    try:
        yield
    finally:
        model.set_reshard_after_forward(True)
        # FSDP2's own default for the root: its weights are needed again at once by the next forward.
        model.set_reshard_after_forward(False, recurse=False)
        for unit in units:
            unit.reshard()


def full_weights_by_unit(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """Every weight of `model` in full, named as in its Hugging Face model (inside a PEFT wrapper): under
    FSDP2 one unit gathered at a time (the root's own weights, then each decoder layer's), resharded before
    the next, so that a consumer copying them (the static engine's inference copy) never holds a second
    full model beside its own. A collective: every rank iterates it to the end, in the same order. Not
    sharded: the weights themselves."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not is_sharded(model):
        yield from inner.named_parameters()
        return
    settle()  # the gathers are collectives: on several ranks, a step's rollout is no longer left alone
    done: set[str] = set()
    for unit in _fsdp_modules(model):  # the same order on every rank, so the all-gathers pair up
        unit.unshard()
        try:
            gathered = [(n, p) for n, p in inner.named_parameters() if n not in done and not _is_dtensor(p)]
            for name, weight in gathered:
                done.add(name)
                yield name, weight
        finally:
            unit.reshard()


def _is_dtensor(tensor: Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def call_in_root_forward(model: nn.Module, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run `fn(*args, **kwargs)` as `model`'s forward, so that FSDP2's root hooks run around it.

    The root's pre-forward all-gathers its own weights (embeddings, final norm, LM head) and its
    post-forward hooks the outputs so that the gradients of those weights are reduce-scattered in
    backward; calling submodules directly would skip both. Without gradients nothing comes back through
    the root, so its weights are freed right away (this is how the frozen reference stays sharded).
    """
    if not is_sharded(model):
        return fn(*args, **kwargs)

    def forward(*args: Any, **kwargs: Any) -> Any:
        # Clones: FSDP2 hooks the outputs for backward, and a view's hook is lost if edited in place later.
        return tree_map_only(Tensor, torch.clone, fn(*args, **kwargs))

    model.forward = forward  # an instance attribute shadows the class's forward
    try:
        # The arguments go through the module call: torch 2.11's root pre-forward fails on an empty call.
        output = model(*args, **kwargs)
    finally:
        del model.forward
    if not torch.is_grad_enabled():
        model.reshard()
    return output


def gather_per_rank(state: Any) -> list:
    """Every rank's `state` (picklable), indexed by rank; a one-item list without a process group.

    A collective: every rank calls it. It carries Python objects of any size, e.g. a checkpoint's per-rank
    state to rank 0, which alone writes it, or rewards whose count differs between ranks.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [state]
    gathered: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, state)
    return gathered


def offloaded_to_cpu(*models: nn.Module | None) -> None:
    """Move the CPU-offloaded shards of FSDP2 `models` back to the CPU after the strategy moved every weight
    to the device (FSDP2 refuses offloaded shards anywhere else)."""
    for model in models:
        if model is not None:
            model.to("cpu")


def ranks_of(strategy: Any) -> StrategyRanks | OneProcess:
    """The update's `Ranks` under a Lightning strategy: `OneProcess` for one process (nothing to ask)."""
    return StrategyRanks(strategy) if strategy.world_size > 1 else OneProcess()


class StrategyRanks:
    """`core.ranks.Ranks` over the processes of a Lightning strategy (any object with its
    `reduce`, `all_gather`, `world_size`, `global_rank` and `root_device`). Each collective `settle`s first:
    the first of a step's rollout is where the ranks agree whether a stop request ends it."""

    def __init__(self, strategy: Any) -> None:
        self.strategy, self.world_size, self.rank = strategy, strategy.world_size, strategy.global_rank

    def sum(self, value: Tensor) -> Tensor:
        settle()
        return self.strategy.reduce(value, reduce_op="sum")

    def max(self, value: int) -> int:
        settle()
        return int(self.strategy.all_gather(torch.tensor(value, device=self.strategy.root_device)).max())

    def gather(self, values: list) -> list[list]:
        settle()
        return gather_per_rank(values)  # objects: the lists may differ in length between ranks


def close_process_group() -> None:
    """Wait for every rank, then free the default process group, if there is one.

    Lightning leaves the group alive after `fit`. A process that exits with it alive can abort in its C++
    destructors ("terminate called without an active exception", exit status -6) while a gloo or NCCL
    thread is still running, after the run itself succeeded.
    """
    shutdown_engines()  # vLLM's first: their shutdown fails if the group is gone (and keeps it alive)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


# ----------------------------------------------------------------------------------------- export
def consolidate_checkpoint(path: str, out_file: str | None = None) -> str:
    """A sharded (distributed) Lightning checkpoint folder as one `torch.save` file; returns its path.

    Every rank's shards are assembled into full tensors in this one process, on CPU, with no process
    group: the result has the `state_dict` (and optimizer states) that `export.export_policy` reads.
    Default `out_file`: `<path>.consolidated`, next to the folder.
    """
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    if not os.path.isdir(path):
        raise ValueError(f"{path!r} is not a sharded checkpoint folder")
    out_file = out_file or path.rstrip("/") + ".consolidated"
    dcp_to_torch_save(path, out_file)
    return out_file
