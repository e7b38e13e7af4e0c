"""The random number generators that sampling draws from, captured and restored: an exact resume continues
the training stream, and evaluations that sample leave it where it was.

Stored as tensors and plain Python values, so that `torch.load(weights_only=True)` reads them.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

__all__ = ["capture_rng_states", "preserved_rng", "restore_rng_states"]


def capture_rng_states() -> dict:
    """Torch (CPU and each CUDA device), Python and NumPy generator states, in weights_only-loadable types."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    states = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),  # (version, tuple of ints, None | float)
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states: dict) -> None:
    """Put back what `capture_rng_states` returned."""
    torch.set_rng_state(states["torch"])
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))  # a checkpoint may hand the tuple back as a list
    kind, keys, pos, has_gauss, gauss = states["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


@contextmanager
def preserved_rng() -> Iterator[None]:
    """Run a block without moving any generator: what it draws is invisible to the training stream."""
    states = capture_rng_states()
    try:
        yield
    finally:
        restore_rng_states(states)
