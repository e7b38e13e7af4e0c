"""Loading the policy and its tokenizer through transformers' own `from_pretrained`.

Everything a user can point at works the same way: a hub id, a local `save_pretrained` folder, or a
GGUF file (dequantised by transformers). Nothing here knows about Lightning.
"""

import copy
import glob
import importlib.util
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Annotated, Literal

import torch
from jinja2 import TemplateError, TemplateSyntaxError
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.utils.chat_template_utils import _compile_jinja_template

from grpo_lightning.core.options import Range, check_fields, option_error

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
        revision: the branch, tag or commit of a hub policy to load (TRL's `model_revision`), for the
            policy (and so its reference copy), its config and its own tokenizer; a tokenizer named apart
            (`tokenizer`) loads its default branch. Default None (the repo's default branch). Refused for a
            local folder, which has no revisions and from which transformers would load whatever it holds.
        init_kwargs: any other keyword of the policy's `from_pretrained` (TRL's `model_init_kwargs`), e.g.
            `{"low_cpu_mem_usage": true}`, or a config value such as `{"use_cache": false}`. A keyword that
            an option here sets (`torch_dtype`: `dtype`, `attn_implementation`, ...) is refused, naming the
            option. Default None.
        chat_template: the chat template to train with, in place of the tokenizer's own (TRL's
            `chat_template_path`): a Jinja template (a value holding `{{` or `{%`), or the path of a file
            holding one (`.jinja`). Set on the tokenizer when it loads, so prompts, tool turns and an export's
            tokenizer all use it. A missing file or a template that does not compile is refused before any
            weights load. Default None (the tokenizer's template).
    """

    gguf_file: str | None = None
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    attn_implementation: str | None = None
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False
    load_in_4bit: bool = False
    revision: str | None = None
    init_kwargs: dict | None = None
    chat_template: str | None = None

    def __post_init__(self) -> None:
        check_fields(self)
        for key in self.init_kwargs or {}:
            option = _OPTION_OF_KEYWORD.get(key, key if key in _field_names(self) else None)
            if option is not None:
                raise option_error(
                    self,
                    "init_kwargs",
                    self.init_kwargs,
                    f"must not hold {key!r}, an option here: set ModelOptions.{option}",
                )


# The `from_pretrained` keywords that a ModelOptions option of another name sets.
_OPTION_OF_KEYWORD = {"torch_dtype": "dtype", "quantization_config": "load_in_4bit"}


def _field_names(options: object) -> set[str]:
    return {f.name for f in fields(options)}


def check_revision(source: str | None, options: ModelOptions) -> None:
    """Refuse a revision for a policy that is a local folder: transformers loads the folder as it is,
    whatever the revision says, so the option would be silently ignored."""
    if options.revision is not None and source is not None and os.path.isdir(os.path.expanduser(source)):
        raise option_error(
            options,
            "revision",
            options.revision,
            f"the policy {source!r} is a local folder, which has no revisions: drop the revision (or "
            "download that revision into a folder: huggingface-cli download MODEL --revision REV --local-dir "
            "DIR)",
        )


def chat_template_of(options: ModelOptions) -> str | None:
    """The template `options.chat_template` gives: the value itself, or the text of the file it names (a
    value without `{{` or `{%`); None when unset. Raises ValueError (one line) for a missing file or a
    template that does not compile, as `apply_chat_template` compiles it."""
    value = options.chat_template
    if value is None:
        return None
    if "{{" in value or "{%" in value:
        template, what = value, f"ModelOptions.chat_template (a template of {len(value)} characters)"
    else:
        path = os.path.expanduser(value)
        if not os.path.isfile(path):
            where = "" if os.path.isabs(path) else f" (relative to {os.getcwd()})"
            raise option_error(
                options,
                "chat_template",
                value,
                f"no such file{where}: give a Jinja template, or the path of a file holding one (.jinja)",
            )
        with open(path, encoding="utf-8") as f:
            template = f.read()
        what = f"ModelOptions.chat_template={value!r}"
    try:
        _compile_jinja_template(template)
    except TemplateError as err:
        line = f" at line {err.lineno}" if isinstance(err, TemplateSyntaxError) else ""
        raise ValueError(f"{what} does not compile{line}: {err.message}; fix the template") from None
    return template


# A hub id: "name" or "org/name" of letters, digits, "-", "_" and ".".
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def _looks_like_path(name_or_path: str) -> bool:
    """Not a possible hub id, or a relative path whose first folder exists here ("models/typo")."""
    first = name_or_path.split("/", 1)[0]
    return (
        name_or_path.startswith((".", "/", "~"))
        or not _HUB_ID.fullmatch(name_or_path)
        or ("/" in name_or_path and os.path.isdir(first))
    )


def _check_exists(name_or_path: str) -> None:
    # Without this a mistyped folder fails inside transformers as a failed connection to the hub.
    if _looks_like_path(name_or_path) and not os.path.exists(os.path.expanduser(name_or_path)):
        where = "" if os.path.isabs(os.path.expanduser(name_or_path)) else f" (relative to {os.getcwd()})"
        raise FileNotFoundError(f"model path {name_or_path!r} does not exist: no such folder{where}")


def _unreadable_safetensors(folder: str) -> str | None:
    """The first `.safetensors` file in `folder` whose header does not cover the file (truncated, corrupt)."""
    from safetensors import safe_open

    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        try:
            with safe_open(path, "pt"):
                pass
        except Exception:  # safetensors raises its own SafetensorError, not an OSError
            return path
    return None


@contextmanager
def _loading(what: str, name_or_path: str) -> Iterator[None]:
    """Turn what `from_pretrained` raises into one message naming the folder (or hub id) and the file."""
    try:
        yield
    except OSError as err:
        if os.path.exists(os.path.expanduser(name_or_path)):
            raise OSError(f"cannot load the {what} from {name_or_path!r}: {err}") from err
        raise OSError(
            f"cannot load the {what} {name_or_path!r}: there is no such folder (relative to {os.getcwd()}), "
            f"and as a Hugging Face Hub id it failed: {str(err).splitlines()[0]}"
        ) from err
    except Exception as err:  # transformers and safetensors raise many types; name the source, keep the text
        broken = os.path.isdir(name_or_path) and _unreadable_safetensors(name_or_path)
        if broken:
            raise ValueError(
                f"cannot load the {what} from {name_or_path!r}: {broken} is truncated or corrupt "
                f"({type(err).__name__}: {err}); copy or export it again"
            ) from err
        text = " ".join(str(err).split())  # one line: transformers' messages list their options on lines
        raise ValueError(
            f"cannot load the {what} from {name_or_path!r}: {type(err).__name__}: {text}"
        ) from err


def load_tokenizer(
    name_or_path: str, gguf_file: str | None = None, revision: str | None = None
) -> PreTrainedTokenizerBase:
    """Load a tokenizer ready for batched generation: left padding and a pad token."""
    _check_exists(name_or_path)
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    if revision is not None:
        kwargs["revision"] = revision
    with _loading("tokenizer", name_or_path):
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, **kwargs)
    check_tokenizer(tokenizer, name_or_path)
    return prepare_tokenizer(tokenizer)


# Ordinary text that every real tokenizer splits into ordinary tokens.
_PROBE_TEXT = "The answer is 42."


def check_tokenizer(tokenizer: PreTrainedTokenizerBase, source: str) -> None:
    """Refuse a tokenizer without a vocabulary. From a folder holding `tokenizer_config.json` but not the
    vocabulary files, transformers builds one that knows only the special tokens the config names: it
    encodes any text to nothing, and the run would fail far from the cause."""
    ids = tokenizer(_PROBE_TEXT, add_special_tokens=False)["input_ids"]
    special = set(tokenizer.all_special_ids)
    if all(i in special for i in ids):
        raise ValueError(
            f"the tokenizer from {source!r} has no vocabulary: {len(tokenizer)} tokens, only special ones, "
            f"and it encodes {_PROBE_TEXT!r} to {ids}; the folder lacks its tokenizer files (tokenizer.json, "
            "or vocab.json + merges.txt, ...): copy them from the model it came from, or set model.tokenizer"
        )


def check_loaded_model(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, source: str | None
) -> None:
    """Before the first step: every token id of `tokenizer` has a row in the model's input embedding (a
    tokenizer of another model indexes past it), and every floating-point weight is finite (a broken
    checkpoint would only show steps later as a non-finite loss). Raises ValueError naming what is wrong."""
    source = source or type(model).__name__
    rows = model.get_input_embeddings().num_embeddings
    largest = max([*tokenizer.get_vocab().values(), *tokenizer.all_special_ids])
    if largest >= rows:
        raise ValueError(
            f"the tokenizer's token ids reach {largest}, but the input embedding of the model {source!r} has "
            f"{rows} rows (ids 0 to {rows - 1}): the tokenizer belongs to another model; set model.tokenizer "
            "to this model's own (or leave it unset to use the policy folder's)"
        )
    for name, tensor in model.state_dict().items():
        if not tensor.is_floating_point() or tensor.device.type == "meta":
            continue  # quantised (integer) blocks; weights not materialised yet
        # One pass without a mask: NaN and inf make the float32 sum non-finite (so may a sum past 3.4e38,
        # hence the count before refusing).
        if torch.isfinite(tensor.sum(dtype=torch.float32)):
            continue
        bad = int((~torch.isfinite(tensor)).sum())
        if bad:
            raise ValueError(
                f"the model {source!r} has non-finite weights: {name} holds {bad} NaN or inf values of "
                f"{tensor.numel()}; the checkpoint is broken (export or train it again from an earlier one)"
            )


def policy_parts(
    policy: str | PreTrainedModel, tokenizer: str | PreTrainedTokenizerBase | None, options: ModelOptions
) -> tuple[str | None, PreTrainedModel | None, PreTrainedTokenizerBase]:
    """A module's `policy` argument in its parts: where it loads from (None for a model object), the model
    object (None until loaded), and the tokenizer it trains with: `tokenizer` (an object, or where to load it
    from), else the policy's own, prepared (`prepare_tokenizer`)."""
    if policy is None:
        raise ValueError(
            "policy is None: give a hub id, a model folder or a PreTrainedModel (the checkpoint of a "
            "module built from a model object without a name_or_path cannot say where its policy came "
            "from: load_from_checkpoint(ckpt, policy=...))"
        )
    source = policy if isinstance(policy, str) else None
    if tokenizer is None and source is None:
        raise ValueError("pass a tokenizer along with an already-built policy model")
    check_revision(source, options)
    chat_template = chat_template_of(options)  # before the tokenizer loads
    if tokenizer is None or isinstance(tokenizer, str):
        own = tokenizer in (None, source)  # the policy's own tokenizer: from the same revision
        revision = options.revision if own else None
        tokenizer = load_tokenizer(tokenizer or source, options.gguf_file, revision)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return source, None if source is not None else policy, prepare_tokenizer(tokenizer)


def policy_config(
    model: PreTrainedModel | None, source: str | None, options: ModelOptions
) -> PretrainedConfig | None:
    """A policy's config: the loaded `model`'s, else the config file alone at `source` (no weights load; a
    hub id only from the local cache). None where it cannot be read here (a GGUF file, a hub id not
    downloaded yet)."""
    if model is not None:
        return model.config
    if source is None or options.gguf_file:
        return None
    try:
        return AutoConfig.from_pretrained(
            source,
            trust_remote_code=options.trust_remote_code,
            revision=options.revision,
            local_files_only=True,
        )
    except (OSError, ValueError):  # not a local folder, not in the cache: the model's loading says why
        return None


def model_positions(model: PreTrainedModel | None, source: str | None, options: ModelOptions) -> int | None:
    """The positions a policy has (`max_position_embeddings` of its text config, `policy_config`); None
    where the config names none or cannot be read before the weights load."""
    config = policy_config(model, source, options)
    if config is None:
        return None
    positions = getattr(config.get_text_config(), "max_position_embeddings", None)
    return positions if isinstance(positions, int) and positions > 0 else None


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
    check_revision(name_or_path, options)
    kwargs: dict = {**(options.init_kwargs or {}), "trust_remote_code": options.trust_remote_code}
    if options.revision is not None:
        kwargs["revision"] = options.revision
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
    with _loading("model", name_or_path):
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

    r: Annotated[int, Range(">= 1")] = 16
    alpha: Annotated[float, Range("> 0")] = 32
    dropout: Annotated[float, Range(">= 0, < 1")] = 0.0
    target_modules: list[str] | str = "all-linear"

    def __post_init__(self) -> None:
        check_fields(self)


def check_lora_choice(lora: LoraOptions | None, options: ModelOptions, sync_ref_model: bool) -> None:
    """The options that need LoRA, or full fine-tuning, have it; before any weights load."""
    if sync_ref_model and lora is not None:
        raise ValueError(
            "grpo.reference_sync (sync_ref_model) with LoRA: the reference is the policy's own base "
            "weights (adapters "
            "off), which LoRA never changes; sync needs full fine-tuning (a separate reference)"
        )
    if options.load_in_4bit and lora is None:
        raise ValueError(
            "ModelOptions.load_in_4bit trains LoRA adapters over a frozen 4-bit base: set `lora`"
        )


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


def prepare_models(
    policy: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    source: str | None,
    options: ModelOptions,
    lora: LoraOptions | None,
    needs_reference: bool,
) -> tuple[PreTrainedModel, PreTrainedModel | None]:
    """The loaded `policy` made ready to train (checked, gradient checkpointing, LoRA adapters) and its
    frozen reference: a copy when `needs_reference` (beta > 0) without LoRA; None with LoRA, whose reference
    is the policy with its adapters off, or when no reference is needed."""
    check_loaded_model(policy, tokenizer, source)
    if options.gradient_checkpointing:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    reference = None
    if lora is not None:
        policy = apply_lora(policy, lora)
        if options.gradient_checkpointing:
            policy.enable_input_require_grads()  # else the frozen embeddings cut the LoRA gradient
    elif needs_reference:
        reference = copy.deepcopy(policy).requires_grad_(False).eval()
    policy.config.use_cache = True
    policy.train()  # from_pretrained returns eval mode; Lightning keeps the modes it finds
    return policy, reference
