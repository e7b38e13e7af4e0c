"""Input and output: loading models and tokenizers, checkpoint files, FSDP2 sharding, exporting the
policy, tiny test models."""
