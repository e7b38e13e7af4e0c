"""The static engine's inference copy of the policy: a plain Hugging Face model of the policy's class that
holds each weight as the loss's scorer computes with it (`CopyPrecision`: linear weights in the compute
dtype, LoRA adapters kept unmerged as PEFT layers, embeddings and norms as the policy holds them), its
tensors overwritten in place when the policy's weights change (`InferenceCopy.refresh`), so that a
compiled decoding step keeps reading the same storage. Used by `static_engine.StaticEngine`. No Lightning
here.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from transformers import PreTrainedModel

# The policy's weights, named as in its Hugging Face model (PEFT's adapter weights under their PEFT names),
# in full: an unsharded policy's own tensors (`own_weights`), or under FSDP2 one unit gathered at a time
# (`io.distributed.full_weights_by_unit`). Every rank iterates it to the end.
WeightSource = Callable[[PreTrainedModel], Iterable[tuple[str, Tensor]]]


def hf_model(model: PreTrainedModel) -> PreTrainedModel:
    """The Hugging Face model inside a PEFT wrapper, or `model` itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def own_weights(model: PreTrainedModel) -> Iterator[tuple[str, Tensor]]:
    """An unsharded policy's weights as it holds them (the default `WeightSource`)."""
    yield from hf_model(model).named_parameters()


def plain_class(model: PreTrainedModel) -> type[PreTrainedModel]:
    """The policy's transformers class, without FSDP2's wrapper class (`FSDPLlamaForCausalLM`)."""
    return next(
        c
        for c in type(hf_model(model)).__mro__
        if issubclass(c, PreTrainedModel) and not issubclass(c, FSDPModule)
    )


@dataclass(frozen=True)
class CopyPrecision:
    """How the scorer computes, which the inference copy repeats.

    Args:
        linear_dtype: the dtype of linear layers' weights (LoRA's A and B too) as the scorer's matmuls read
            them: autocast casts them to it, a 16-bit `-true` precision stores them in it. None: as the
            policy holds them.
        autocast_dtype: the scorer runs under autocast in this dtype (Lightning's `-mixed` precisions), and
            so does the copy: norms, softmax and the residual stream then keep the policy's own dtype
            (float32 master weights: float32). None: no autocast.
    """

    linear_dtype: torch.dtype | None = None
    autocast_dtype: torch.dtype | None = None


def copy_precision(precision: str | None) -> CopyPrecision:
    """The `CopyPrecision` of Lightning's `precision` flag (None: no trainer, the policy as it is)."""
    dtype = {"bf16": torch.bfloat16, "16": torch.float16}.get(str(precision).split("-")[0])
    mixed = str(precision).endswith("-mixed")
    return CopyPrecision(linear_dtype=dtype, autocast_dtype=dtype if mixed else None)


def active_lora(model: PreTrainedModel) -> tuple[str, object] | None:
    """`(adapter name, LoraConfig)` of the policy's active adapter; None without PEFT."""
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        return None
    name = model.active_adapter
    return name, model.peft_config[name]


def plain_copy(model: PreTrainedModel, device: torch.device, dtype: torch.dtype | None) -> PreTrainedModel:
    """A plain HF model of the policy's class and config on `device`, with its active LoRA adapter injected
    by PEFT (unmerged: its forward is PEFT's, base(x) + scaling * B(A(x)), as the policy's)."""
    from peft import inject_adapter_in_model

    inner = hf_model(model)
    # The fresh weights' random initialisation (the model's, LoRA's) draws from a generator of its own: every
    # weight is overwritten by `refresh`, and the trainer's stream must not move for it. Where the copy is
    # built depends on the run (the first rollout, or the first after a resume): drawing from the trainer's
    # stream there would make a resumed run sample otherwise than the run it continues.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        with torch.device(device):
            plain = plain_class(model)._from_config(
                copy.deepcopy(inner.config),
                dtype=dtype or next(inner.parameters()).dtype,
                attn_implementation=inner.config._attn_implementation,
            )
        adapter = active_lora(model)
        if adapter is not None:
            name, config = adapter
            inject_adapter_in_model(copy.deepcopy(config), plain, adapter_name=name)
    return plain.eval().requires_grad_(False)


class InferenceCopy:
    """The policy for generation only: a plain HF model of its class and config with its LoRA adapter kept
    unmerged (`plain_copy`), each weight held as the scorer computes with it (`precision`):

    - linear layers' weights (the base's and LoRA's A and B) in `precision.linear_dtype`, the dtype
      autocast casts them to for the scorer's matmuls; so a small adapter update survives as it does in
      the scorer (a LoRA merged into bf16 weights, bf16(W + s * B @ A), rounds it away where s * B @ A is
      below half a bf16 step of W: most of it while B is small, early in training);
    - every other weight (embeddings, norms) in the dtype the policy gives it: float32 master weights keep
      float32 embeddings, so the residual stream and the norms compute in float32 under autocast, as the
      scorer's do. A tied LM head then gets a weight of its own in the linear dtype: casting a float32
      embedding at every decoding step would cost more than the head's matmul.

    The price of matching instead of a copy all in bf16: the float32 embedding (2 more bytes per
    embedding weight; +0.27 GB for Qwen2.5-0.5B's, plus its 0.27 GB bf16 head when tied) and the norms;
    the matmuls, and so the decoding speed, are those of a bf16 copy. `refresh` writes the policy's
    current weights into the same tensors, cast, in place.
    """

    def __init__(self, model: PreTrainedModel, precision: CopyPrecision, device: torch.device) -> None:
        self.precision = precision
        self.model = plain_copy(model, device, precision.linear_dtype)
        named = list(self.model.named_parameters(remove_duplicate=False))
        self.tensors: dict[str, nn.Parameter] = dict(named)
        tied: dict[int, list[str]] = defaultdict(list)
        for name, tensor in named:
            tied[id(tensor)].append(name)
        self.names_of = {name: tied[id(tensor)] for name, tensor in named}  # a policy name -> its copies
        self.linear = {  # the weights autocast casts: those of linear layers, LoRA's included
            f"{module_name}.{name}" if module_name else name
            for module_name, module in self.model.named_modules()
            if isinstance(module, nn.Linear)
            for name, _ in module.named_parameters(recurse=False)
        }
        self.filled = False
        self.refreshes = 0  # times the policy's weights were written in
        self._take_buffers(model, device)

    def _take_buffers(self, model: PreTrainedModel, device: torch.device) -> None:
        """The policy's buffers as it holds them (the rotary embedding's frequencies: a base cast with
        `.to(torch.bfloat16)` has them in bf16, a fresh model in float32)."""
        for name, buffer in hf_model(model).named_buffers():
            module_name, _, attr = name.rpartition(".")
            owner = self.model.get_submodule(module_name)
            if attr in owner._buffers:
                setattr(owner, attr, buffer.detach().to(device, copy=True))

    def take_dtypes(self, dtypes: Iterable[tuple[str, torch.dtype]]) -> None:
        """Give each tensor its dtype for the policy's weights arriving in `dtypes` (what the first fill
        does, without the values: on the meta device, for `inference_copy_nbytes`)."""
        for name, dtype in dtypes:
            self._take_dtype(name, dtype)

    @torch.no_grad()
    def refresh(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Write the policy's `weights` in, cast, in place: the storage, and graphs captured over it, stay.
        The first fill gives each tensor its dtype (`InferenceCopy`)."""
        for name, value in weights:
            if not self.filled:
                self._take_dtype(name, value.dtype)
            for target in dict.fromkeys(self.tensors[n] for n in self.names_of[name]):  # each tensor once
                target.copy_(value)
        self.filled = True
        self.refreshes += 1

    def _take_dtype(self, name: str, incoming: torch.dtype) -> None:
        linear_dtype = self.precision.linear_dtype
        wanted = {
            n: linear_dtype if linear_dtype and n in self.linear else incoming for n in self.names_of[name]
        }
        if len(set(wanted.values())) > 1:  # a tied embedding and LM head that compute in different dtypes
            for copy_name, dtype in wanted.items():
                self._replace(copy_name, dtype)
            return
        for copy_name, dtype in wanted.items():
            if self.tensors[copy_name].dtype != dtype:
                self.tensors[copy_name].data = torch.empty_like(self.tensors[copy_name], dtype=dtype)

    def _replace(self, name: str, dtype: torch.dtype) -> None:
        """A tensor of its own for `name` (untied from the others that shared it)."""
        module_name, _, attr = name.rpartition(".")
        module = self.model.get_submodule(module_name)
        tensor = nn.Parameter(torch.empty_like(self.tensors[name], dtype=dtype), requires_grad=False)
        setattr(module, attr, tensor)
        self.tensors[name] = tensor

    def nbytes(self) -> int:
        """Bytes of the copy's weights (each tensor once)."""
        return sum(t.numel() * t.element_size() for t in {id(t): t for t in self.tensors.values()}.values())


def inference_copy_nbytes(
    model: PreTrainedModel, precision: CopyPrecision, gathered_dtype: torch.dtype | None = None
) -> int:
    """Bytes the static engine's copy of `model` holds (`InferenceCopy`'s dtypes, planned on the meta
    device). `gathered_dtype`: the dtype the weights arrive in when FSDP2 gathers them in another than
    they are stored in (its mixed precision's `param_dtype`)."""
    plan = InferenceCopy(model, precision, torch.device("meta"))
    plan.take_dtypes((name, gathered_dtype or w.dtype) for name, w in hf_model(model).named_parameters())
    return plan.nbytes()


# dynamo's switch that makes the recompile limit an error, and the error (named "cache limit" before 2.7).
