"""Loading the policy and its tokenizer through transformers' own `from_pretrained`.

Everything a user can point at works the same way: a hub id, a local `save_pretrained` folder, or a
GGUF file (dequantised by transformers). Nothing here knows about Lightning.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

try:  # transformers >= 5.2x keeps GGUF weights in GGUF blocks unless asked to dequantise them
    from transformers import GgufConfig
except ImportError:  # older releases always dequantise
    GgufConfig = None


@dataclass
class ModelOptions:
    """How the policy is loaded.

    Args:
        gguf_file: file name of a GGUF checkpoint inside the model folder (or hub repo); transformers
            dequantises it to `dtype`. Default None (a normal safetensors checkpoint).
        dtype: "float32", "bfloat16", "float16" or "auto" (the checkpoint's). Default "float32": on CPU and
            on GPUs keep it with `precision: bf16-mixed` (bf16 compute, float32 master weights); bf16 weights
            that train round small updates away (the pre-flight says how many).
        attn_implementation: "eager", "sdpa", "flash_attention_2", ... Default None (transformers picks).
        gradient_checkpointing: recompute activations in backward to save memory. Default False.
        trust_remote_code: passed to `from_pretrained`. Default False.
        load_in_4bit: QLoRA (Dettmers et al., arXiv:2305.14314): the frozen base in 4-bit NF4 with double
            quantisation and bf16 compute, through bitsandbytes; needs a CUDA GPU and `lora`. Default False.
    """

    gguf_file: str | None = None
    dtype: str = "float32"
    attn_implementation: str | None = None
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False
    load_in_4bit: bool = False


def _check_exists(name_or_path: str) -> None:
    # A hub id is "name" or "org/name"; anything else that does not exist would otherwise fail later with a
    # confusing hub lookup error.
    looks_local = name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1
    if looks_local and not os.path.exists(os.path.expanduser(name_or_path)):
        raise FileNotFoundError(f"model path {name_or_path!r} does not exist")


def load_tokenizer(name_or_path: str, gguf_file: str | None = None) -> PreTrainedTokenizerBase:
    """Load a tokenizer ready for batched generation: left padding and a pad token."""
    _check_exists(name_or_path)
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, **kwargs)
    return prepare_tokenizer(tokenizer)


def prepare_tokenizer(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Left padding keeps every prompt's last token at the same position, which batched `generate` needs."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(name_or_path: str, options: ModelOptions | None = None) -> PreTrainedModel:
    """Load a causal LM with `AutoModelForCausalLM.from_pretrained`."""
    options = options or ModelOptions()
    _check_exists(name_or_path)
    kwargs: dict = {"trust_remote_code": options.trust_remote_code}
    kwargs["dtype"] = options.dtype if options.dtype == "auto" else getattr(torch, options.dtype)
    if options.attn_implementation:
        kwargs["attn_implementation"] = options.attn_implementation
    if options.gguf_file:
        # Dense weights: GGUF blocks are for inference kernels, and neither train nor save_pretrained.
        kwargs["gguf_file"] = options.gguf_file
        if GgufConfig is not None:
            kwargs["quantization_config"] = GgufConfig(dequantize=True)
    if options.load_in_4bit:
        kwargs["quantization_config"] = _four_bit_config()
    model = AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
    if options.load_in_4bit:
        from peft import prepare_model_for_kbit_training

        # Norms in float32 and input gradients on, so that the LoRA adapters above the 4-bit base train.
        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=options.gradient_checkpointing
        )
    return model


def _four_bit_config():
    """bitsandbytes NF4 with double quantisation and bf16 compute, or a clear error where it cannot run."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            "ModelOptions.load_in_4bit needs a CUDA GPU (bitsandbytes 4-bit kernels); on this machine train "
            "with load_in_4bit: false (LoRA over a float32 or bfloat16 base)"
        )
    if importlib.util.find_spec("bitsandbytes") is None:
        raise RuntimeError("ModelOptions.load_in_4bit needs bitsandbytes: pip install bitsandbytes")
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )


@dataclass
class LoraOptions:
    """LoRA through PEFT (Hu et al., arXiv:2106.09685). With LoRA and `beta > 0` the reference model is the
    same weights with the adapter disabled: no second copy of the base model in memory.

    Args:
        r: rank. Default 16.
        alpha: scaling numerator, the update is scaled by alpha / r. Default 32.
        dropout: dropout on the LoRA branch. Default 0.0 (sampling and scoring see the same network).
        target_modules: module names to adapt, or "all-linear". Default "all-linear".
    """

    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: list[str] | str = "all-linear"


def apply_lora(model: PreTrainedModel, options: LoraOptions) -> PreTrainedModel:
    """Wrap `model` in a PEFT LoRA model; a target module that the model lacks raises naming it."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=options.r,
        lora_alpha=options.alpha,
        lora_dropout=options.dropout,
        target_modules=options.target_modules,
        task_type="CAUSAL_LM",
    )
    try:
        return get_peft_model(model, config)
    except ValueError as err:
        names = sorted(
            {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        )
        raise ValueError(
            f"LoraOptions.target_modules={options.target_modules!r} does not match this model "
            f"({type(model).__name__}); its linear layers are named {names}. ({err})"
        ) from None
