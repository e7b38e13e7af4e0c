"""GRPO with verifiable rewards for Hugging Face causal LMs, the PyTorch Lightning way."""
