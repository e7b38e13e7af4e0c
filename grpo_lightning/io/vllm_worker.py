"""What the trainer asks of a vLLM server's workers beyond vLLM's own methods, loaded into each worker by
`--worker-extension-cls grpo_lightning.io.vllm_worker.PushExtension` (`cli.py vllm-serve` adds it) and called
through `/collective_rpc`. Runs inside vLLM's worker process; imports nothing."""

from __future__ import annotations


class PushExtension:
    """Methods mixed into vLLM's worker class."""

    def repack_tied_head(self) -> None:
        """Re-run the LM head's post-load step after a push. vLLM's CPU build packs each linear weight into a
        GEMM handle at load; a head tied to the embedding takes the embedding's new values through the shared
        tensor, but its packed copy keeps the old ones until this repacks it (on GPU nothing is packed)."""
        head = self.model_runner.model.lm_head
        head.quant_method.process_weights_after_loading(head)
