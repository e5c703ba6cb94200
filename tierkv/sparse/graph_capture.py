"""Capturing one CUDA graph beside the compute stream.

Primitives: `no_gc`, `capture_graph`.

Graphs captured here draw on one memory pool (the caller's) and replay on the compute stream in
order, one at a time. A graph's scratch may lie where another graph, captured later into the same
pool, keeps scratch of its own (a recapture breaks the capture order), so what must outlive a
replay, the inputs and outputs, is allocated outside the pool: inputs copied in before a replay,
outputs written inside the graph. A pool whose graphs were all freed cannot take another capture;
the next capture opens a new one.
"""
from __future__ import annotations

import contextlib
import gc
from typing import Callable

import torch


@contextlib.contextmanager
def no_gc():
    """Python's cyclic garbage collector off for a CUDA graph capture: collected objects that free CUDA
    memory or events (a pinned buffer, a stream) on the capturing thread would invalidate the capture."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def capture_graph(body: Callable[[], torch.Tensor], pool, side_stream: torch.cuda.Stream,
                  ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Run `body` once on `side_stream` (kernels built, workspaces set), then capture it into `pool`
    (a `torch.cuda.graph_pool_handle()`): (graph, its static output, allocated outside the pool on
    the compute stream, shaped as what `body` returns). Raises what the run or the capture raised;
    the current stream waits for the side stream either way."""
    current = torch.cuda.current_stream()
    side_stream.wait_stream(current)
    try:
        with torch.cuda.stream(side_stream):
            first = body()  # first run outside the capture: kernels built, workspaces set
        output = torch.empty_like(first)  # outside the pool, on the compute stream
        with torch.cuda.stream(side_stream):
            # capture_begin/end rather than torch.cuda.graph, which synchronizes and empties the
            # allocator's cache on entry: captures recur as the batch changes
            graph = torch.cuda.CUDAGraph()
            with no_gc():
                graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                try:
                    output.copy_(body())
                finally:
                    graph.capture_end()
    finally:
        current.wait_stream(side_stream)
    return graph, output
