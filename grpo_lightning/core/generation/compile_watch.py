"""What `torch.compile` did while the static engine decoded, and one warning per cause when it degrades.

The compiled decoding step is fast only while it keeps holding: one dynamo graph and one CUDA graph per
cache shape, recorded once and replayed. Four things can undo it without an error, each of which only
shows in torch's own counters or logs:

- dynamo compiles again on a shape it has compiled before (a guard failed: `recompiles`);
- a graph break splits the step into pieces that run partly in Python (`graph_breaks`);
- inductor skips CUDA graphs for a graph (`cudagraph_skips`, `torch._inductor`'s counter; the step then
  runs compiled but launch by launch), or re-records one on a warm shape (`cudagraph_rerecords`: a static
  input moved, e.g. a weight that was replaced instead of overwritten in place);
- decoding falls back to eager (`eager_fallbacks`): dynamo's recompile limit was hit (after which torch
  runs the frame uncompiled for good, with one log line), or transformers chose not to compile.

`CompileWatch` reads the counters around every call (`torch._dynamo.utils.counters`; CUDA-graph
recordings through dynamo's compile callbacks, `torch._dynamo.callback`, where torch exposes their trigger),
counts what happened on shapes that were already warm, and warns once per cause. No Lightning here.
"""

from __future__ import annotations

import warnings
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch
from torch._dynamo.utils import counters

_CALLBACKS = getattr(torch._dynamo, "callback", None)
_TRIGGER = getattr(getattr(_CALLBACKS, "CallbackTrigger", None), "CUDAGRAPH_RECORDING", None)
_recordings = 0  # CUDA graphs recorded in this process, once `_count_recordings` is registered
_registered = False


def _count_recording(args) -> None:
    global _recordings
    if getattr(args, "callback_trigger", None) == _TRIGGER:
        _recordings += 1


def cudagraph_recordings_exposed() -> bool:
    """Whether this torch reports CUDA-graph recordings to dynamo's compile callbacks."""
    return _TRIGGER is not None


def _watch_recordings() -> None:
    global _registered
    if not _registered and cudagraph_recordings_exposed():
        _CALLBACKS.on_compile_start(_count_recording)
        _registered = True


@dataclass(frozen=True)
class CompileCounts:
    """torch's process-wide counters at one moment."""

    graphs: int  # dynamo graphs compiled
    graph_breaks: int
    cudagraph_recordings: int
    cudagraph_skips: int

    @staticmethod
    def now() -> CompileCounts:
        return CompileCounts(
            graphs=counters["stats"]["unique_graphs"],
            graph_breaks=sum(counters["graph_break"].values()),
            cudagraph_recordings=_recordings,
            cudagraph_skips=counters["inductor"]["cudagraph_skips"],
        )

    def __sub__(self, other: CompileCounts) -> CompileCounts:
        return CompileCounts(**{k: v - getattr(other, k) for k, v in asdict(self).items()})


@dataclass
class FastPathReport:
    """What compiling did over an engine's life (each a count; 0 is the target of all but the first two)."""

    graphs_compiled: int = 0  # dynamo graphs, warm-ups included
    cudagraph_recordings: int = 0  # CUDA graphs recorded, warm-ups included
    recompiles: int = 0  # dynamo graphs compiled on a shape that was already warm
    cudagraph_rerecords: int = 0  # CUDA graphs recorded again on a warm shape
    cudagraph_skips: int = 0  # graphs that inductor ran without CUDA graphs
    graph_breaks: int = 0  # breaks in the compiled decoding step
    eager_fallbacks: int = 0  # calls decoded uncompiled although compiling was asked

    DEGRADED = ("recompiles", "cudagraph_rerecords", "cudagraph_skips", "graph_breaks", "eager_fallbacks")

    def degraded(self) -> dict[str, int]:
        """The counts that are not 0 but should be."""
        return {name: getattr(self, name) for name in self.DEGRADED if getattr(self, name)}


# Why each degradation matters and where to look, for the one warning per cause.
CAUSES = {
    "recompiles": "dynamo compiled the decoding step again on a cache shape it had compiled before (a guard "
    "failed; TORCH_LOGS=recompiles prints which)",
    "cudagraph_rerecords": "a CUDA graph was recorded again on a warm cache shape (a static input moved: a "
    "weight or cache tensor was replaced instead of written in place)",
    "cudagraph_skips": "inductor ran the decoding step without CUDA graphs (its log line says why), one "
    "kernel launch at a time",
    "graph_breaks": "the compiled decoding step has graph breaks (TORCH_LOGS=graph_breaks prints them): "
    "parts of it run in Python",
    "eager_fallbacks": "decoding ran uncompiled",
}


class CompileWatch:
    """Counts what compiling did in each call (`call`), keyed by the cache shape it decoded on, and warns
    once per cause when the fast path degrades after its warm-up."""

    def __init__(self) -> None:
        _watch_recordings()
        self.report = FastPathReport()
        self.warm: set[Hashable] = set()  # shapes that have run once
        self.warned: set[str] = set()

    @contextmanager
    def call(self, shape: Hashable) -> Iterator[None]:
        """Around one decoding call on `shape`: its compiles and recordings count as warm-up on the first
        call of the shape, as degradation on later ones; skips and graph breaks always."""
        before = CompileCounts.now()
        yield
        delta = CompileCounts.now() - before
        report = self.report
        report.graphs_compiled += delta.graphs
        report.cudagraph_recordings += delta.cudagraph_recordings
        report.cudagraph_skips += delta.cudagraph_skips
        report.graph_breaks += delta.graph_breaks
        if shape in self.warm:
            report.recompiles += delta.graphs
            report.cudagraph_rerecords += delta.cudagraph_recordings
        self.warm.add(shape)
        self._warn_new()

    def fell_back(self, cause: str) -> None:
        """A call decoded uncompiled although compiling was asked; `cause` says why (in the warning)."""
        self.report.eager_fallbacks += 1
        self._warn_new(cause)

    def _warn_new(self, detail: str | None = None) -> None:
        for name, count in self.report.degraded().items():
            if name not in self.warned:
                self.warned.add(name)
                why = f"{CAUSES[name]}: {detail}" if detail and name == "eager_fallbacks" else CAUSES[name]
                warnings.warn(
                    f"static rollouts lost their compiled fast path ({name}={count}): {why}; rollouts stay "
                    "correct but slower. `rollout/...` metrics count it every step",
                    stacklevel=4,
                )
