"""What a model can do, read from its config and its code before it runs: whether every layer attends to
every earlier token (`not_full_attention`: sharing a prompt's cache, a static cache, packed rows and dropping
rows between `generate` calls need it), and the keyword its decoder takes a KV cache by (`cache_argument`).

No Lightning here.
"""

from __future__ import annotations

import inspect

from torch import nn
from transformers import PretrainedConfig


def not_full_attention(config: PretrainedConfig) -> str | None:
    """Why a model of `config` does not attend to every earlier token in every layer, or None.

    Read from what its decoder computes, whatever the attention implementation (eager, sdpa and flash
    attention all apply a window): a config that declares `layer_types` (Qwen2, Gemma2 and 3, ...) has
    each layer compute its type, a window only in "sliding_attention" layers; one that does not (Mistral,
    Mixtral, Phi-3, Starcoder2) applies `sliding_window` in every layer when it is set, unless
    `use_sliding_window` is false (Qwen2's switch, which keeps the window's value). Such a model's cache
    is not one key and value per token and row, nor is its mask one causal mask that a 4-D mask may
    replace: sharing a prompt's cache, a static cache, packed rows and dropping rows between `generate`
    calls are for full attention only.
    """
    config = config.get_text_config(decoder=True)
    layer_types = list(getattr(config, "layer_types", None) or [])
    window = getattr(config, "sliding_window", None)
    windowed = bool(window) and getattr(config, "use_sliding_window", True) is not False
    follows_layer_types = "layer_types" in inspect.signature(type(config).__init__).parameters
    if windowed and not (follows_layer_types and layer_types):
        return (
            f"its attention layers are not all full attention ({type(config).__name__}.sliding_window="
            f"{window}: every layer attends to its last {window} tokens only)"
        )
    if set(layer_types) - {"full_attention"}:
        return f"its attention layers are not all full attention (layer_types {sorted(set(layer_types))})"
    return None


def cache_argument(model: nn.Module) -> str | None:
    """The keyword under which the decoder (and `generate`) take a KV cache: `cache` in recent transformers,
    `past_key_values` before; None if its forward takes neither."""
    parameters = inspect.signature(model.get_decoder().forward).parameters
    return next((name for name in ("cache", "past_key_values") if name in parameters), None)
