"""Sparse prefetch with the `previous` predictor: each layer's last selection, copied ahead.

Primitives: `SparsePrefetcher` (`begin_step`, `chunks_for_layer`).

Consecutive decode steps select mostly the same far blocks, so at the start of a step every
layer's previous selection is gathered into its own staging slots on the copy stream, while
the first layers compute. At attention time the layer's new selection splits into

    hits    selected and already prefetched -> read from the layer's staging slots
    misses  selected, not prefetched        -> gathered at once into a miss area, stalls

The result is exact over the selection whatever was prefetched. Staging layout:

    [ layer 0: k slots | layer 1: k slots | ... | layer L-1: k slots | miss area: k slots ]

Precision (prefetched blocks used / prefetched) and recall (used / needed) go to the
prefetch recorder.
"""
from __future__ import annotations

import time

import torch

from tierkv.transfer.lookahead import StagedChunk
from tierkv.transfer.device import to_device_no_sync


class SparsePrefetcher:
    def __init__(self, rt, blocks_per_layer: int):
        self.rt = rt
        self.k = blocks_per_layer
        self.num_layers = rt.num_layers
        self.enabled = (self.num_layers + 1) * self.k <= rt.pool.staging.shape[0] and self.k > 0
        self._previous: list[list[int]] = [[] for _ in range(self.num_layers)]
        self._handles: list = [None] * self.num_layers
        self.num_hits = 0
        self.num_misses = 0

    def begin_step(self, seq, after) -> None:
        """Enqueue the gather of every layer's previous selection (host work + copies only)."""
        if not self.enabled:
            return
        rt = self.rt
        src, dst = [], []
        for layer, blocks in enumerate(self._previous):
            src += [seq.cpu_slots[layer][b] for b in blocks]
            dst += [layer * self.k + i for i in range(len(blocks))]
        self._handles = [None] * self.num_layers
        if not src:
            return
        waits = [e for e in (after, rt.engine.record_compute_event()) if e is not None]
        handle = rt.io.gather(torch.tensor(src, dtype=torch.int64), rt.pool.staging,
                              torch.tensor(dst, dtype=torch.int64), after=waits)
        rt.streamer.bytes_streamed += handle.num_bytes
        self._handles = [handle if blocks else None for blocks in self._previous]

    def chunks_for_layer(self, seq, layer: int, selected: list[int]):
        """Staged chunks covering `selected` (block ids) for `layer`; records hits, misses, precision."""
        rt = self.rt
        T = rt.layout.block_tokens
        device = rt.pool.staging.device
        previous = {b: i for i, b in enumerate(self._previous[layer])} if self.enabled else {}
        hits = [b for b in selected if b in previous]
        misses = [b for b in selected if b not in previous]
        self.num_hits += len(hits)
        self.num_misses += len(misses)
        rt.streamer.num_stalls += len(misses)
        if rt.streamer.recorder is not None:
            rt.streamer.recorder.record_selection(num_prefetched=len(previous), num_used=len(hits),
                                                  num_needed=len(selected))
        if self.enabled:
            self._previous[layer] = list(selected)
        if hits:
            self._handles[layer].wait_on_current_stream()
            slots = [layer * self.k + previous[b] for b in hits]
            yield StagedChunk(to_device_no_sync(slots, device), to_device_no_sync([b * T for b in hits], device),
                              to_device_no_sync([T] * len(hits), device))
        if misses:
            miss_area = self.num_layers * self.k if self.enabled else 0
            dst = list(range(miss_area, miss_area + len(misses)))
            start_s = time.perf_counter()
            handle = rt.io.gather(
                torch.tensor([seq.cpu_slots[layer][b] for b in misses], dtype=torch.int64),
                rt.pool.staging, torch.tensor(dst, dtype=torch.int64),
                after=[e for e in (seq._last_d2h, rt.engine.record_compute_event()) if e is not None])
            rt.streamer.bytes_streamed += handle.num_bytes
            self._wait_for_misses(layer, handle, len(misses), start_s)
            yield StagedChunk(to_device_no_sync(dst, device), to_device_no_sync([b * T for b in misses], device),
                              to_device_no_sync([T] * len(misses), device))

    def _wait_for_misses(self, layer: int, handle, num_misses: int, start_s: float) -> None:
        """Wait for the late blocks' copy; each is a late chunk, the wait timed once for the batch."""
        streamer = self.rt.streamer
        streamer.wait_for_chunk(handle, layer, is_late=True, host_wait_s=time.perf_counter() - start_s)
        if streamer.recorder is not None:
            for _ in range(num_misses - 1):
                streamer.recorder.record_chunk(layer, is_late=True, wait_s=0.0)
