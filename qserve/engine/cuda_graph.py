"""The decode step as a CUDA graph (vLLM's CUDA graphs): captured once per padded batch size,
replayed with one launch for every later step of that size.

Capture runs the step eagerly first, under `HostReadGuard`: that compiles every Triton kernel
for the size's shapes, fills the launchers' caches, and refuses (NotCapturable, the caller runs
eager) a step that reads device values into Python or copies to the host, which stream capture
forbids. Then `torch.cuda.graph` records the same step on the static inputs, and one replay
computes the output (a capture launches nothing). The graphs of one model runner share a memory
pool, so an output is valid until the next replay of any size: the caller reads the logits
before the next step, as it does on CPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from qserve.engine.step_graph import HostReadGuard, NotCapturable


class CudaStepGraph:
    """One captured step: `replay()` runs it again on the static inputs it was captured on
    (refilled by the caller) and returns the same output tensor, rewritten."""

    def __init__(self, graph: Any, output: Any) -> None:
        self.graph = graph
        self.output = output
        self.capture_seconds = 0.0
        self.held_bytes = 0  # what the shared pool grew by during this capture

    def summary(self) -> str:
        return f"a CUDA graph, the pool {self.held_bytes / 1e6:+.1f} MB"

    @classmethod
    def capture(cls, step: Callable[[], Any], pool: Any) -> CudaStepGraph:
        """Run `step()` eagerly (checked), capture it into a CUDA graph in `pool`, replay it
        once. Raises NotCapturable if the step reads device values on the host or the capture
        fails."""
        start = time.perf_counter()
        with HostReadGuard():
            step()
        torch.cuda.synchronize()
        reserved = torch.cuda.memory_reserved()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=pool):
                output = step()
        except RuntimeError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise NotCapturable(f"CUDA graph capture failed: {first}") from exc
        graph.replay()
        torch.cuda.synchronize()
        captured = cls(graph, output)
        captured.held_bytes = torch.cuda.memory_reserved() - reserved
        captured.capture_seconds = time.perf_counter() - start
        return captured

    def replay(self) -> Any:
        self.graph.replay()
        return self.output
