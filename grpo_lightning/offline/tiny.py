"""Random-weight models with a real tokenizer, built offline, for tests, benchmarks and GPU checks.

The tokenizer is a byte-level BPE trained with `tokenizers` on local text and wrapped in a
`PreTrainedTokenizerFast` with a ChatML chat template; both are written with `save_pretrained`, so they
load through the same `from_pretrained` path as a hub model.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tokenizer(texts: Iterable[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on `texts`, with ChatML special tokens and chat template."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>", padding_side="left"
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def build_qwen2(
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    max_positions: int,
    tie_word_embeddings: bool = False,
    seed: int = 0,
) -> Qwen2ForCausalLM:
    """A random Qwen2 (the GPU configs' architecture: q/k/v biases) whose biases are random too: they start
    at 0 in transformers, where a bias that a weight copy misses would not show."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie_word_embeddings,
    )
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_proj.bias"):
                p.normal_(0, 0.5)
    return model


def build_model(
    vocab_size: int,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    seed: int = 0,
    tie_word_embeddings: bool = False,
    **config,
) -> LlamaForCausalLM:
    """A random Llama-architecture causal LM (the architecture of SmolLM2, Llama and, nearly, Qwen2);
    `tie_word_embeddings`: the LM head is the embedding, as SmolLM2's."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=1024,
        tie_word_embeddings=tie_word_embeddings,
        **config,
    )
    return LlamaForCausalLM(cfg)


def save_tiny(
    path: str,
    texts: Iterable[str],
    tokenizer_vocab: int = 512,
    model_vocab: int | None = None,
    **model_kwargs,
) -> str:
    """Build a tokenizer and a random model and `save_pretrained` both into `path`; returns `path`.

    `model_vocab` larger than the tokenizer's vocabulary gives a realistic LM-head size (e.g. 151936, as
    Qwen2.5) while the tokenizer stays small.
    """
    tokenizer = build_tokenizer(texts, tokenizer_vocab)
    model = build_model(model_vocab or len(tokenizer), **model_kwargs)
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.config.bos_token_id = None
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    tokenizer.save_pretrained(path)
    model.save_pretrained(path)
    return path
