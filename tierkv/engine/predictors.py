"""The far part of a sparse decode step in the transformers engine: one policy object per predictor.

Primitives: `predictor_for(runtime, is_sparse)`, `NoPredictor`, `PreviousPredictor`, `QueryPredictor`,
`CachePredictor`.

A `SequenceKV` holds one, chosen once from `scheduler.predictor`; every one answers the same calls:

    begin_step(seq, streamed, after)    a sparse decode step over far blocks `streamed` begins
    invalidate()                        a streamed (non-sparse) step overwrote the staging memory
    after_append(seq, layer)            layer's new token is written (predictor 'query' looks ahead)
    chunks_for_layer(seq, layer, q, candidates, after)
                                        the selected far blocks of `layer`, in staging chunks
    attend_far(layer, q, near, scale)   the layer's output: its near part merged with the far part
                                        where the far part comes after it (predictor 'cache')
    observe(layer, hidden, position)    a layer's input hidden state (predictor 'query')
    read_counts()                       (resident, streamed) block reads it counted beside the sequence's
    finish()                            the sequence ends: wait for what it still has in flight
    graph_far()                         the far part a decode step's CUDA graph replays (None: eager)

    none       the top-k selected on the device and fetched at attention time (also the exact policy's,
               whose steps never ask it for chunks, and 'previous' when staging cannot hold its blocks)
    previous   each layer's previous selection prefetched (`sparse.predict_previous.SparsePrefetcher`)
    query      the next layers predicted from hidden states (`sparse.predict_query.QueryLookahead`)
    cache      per-layer far-block caches and the shared sparse step (`sparse.predict_cache.CachedSparse`)
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from tierkv.sparse.predict_cache import CachedSparse
from tierkv.sparse.predict_previous import SparsePrefetcher
from tierkv.sparse.predict_query import QueryLookahead
from tierkv.sparse.summaries import select_far_blocks, select_far_blocks_on_device


class NoPredictor:
    """Predictor 'none': the selection stays on the device, the blocks' CPU slots are looked up there
    and the copy kernel reads the slot list there, so nothing waits for the host."""

    def __init__(self, blocks_per_step: int):
        self.k = blocks_per_step

    def begin_step(self, seq, streamed: range, after) -> None:
        pass

    def invalidate(self) -> None:
        pass

    def after_append(self, seq, layer: int) -> None:
        pass

    def chunks_for_layer(self, seq, layer: int, q: torch.Tensor, candidates: range, after) -> Iterable:
        rt, T = seq.rt, seq.rt.layout.block_tokens
        selected = select_far_blocks_on_device(seq.summaries, layer, q[0], candidates, self.k)
        seq.num_streamed_reads += selected.numel()  # min(k, candidates): known without a sync
        if selected.numel() == 0:
            return iter(())
        slots = seq.device_cpu_slots(layer).index_select(0, selected)
        return rt.streamer.fetch_now(layer, slots, selected * T, T, after=after)

    def attend_far(self, layer: int, q: torch.Tensor, near: tuple[torch.Tensor, torch.Tensor],
                   scale: float) -> torch.Tensor:
        return near[0]  # the far blocks came as chunks, merged into `near` already

    def observe(self, layer: int, hidden: torch.Tensor, position: object) -> None:
        pass

    def read_counts(self) -> tuple[int, int]:
        return 0, 0

    def finish(self) -> None:
        pass

    def graph_far(self) -> CachedSparse | None:
        return None


class PreviousPredictor(NoPredictor):
    """Predictor 'previous': the selection goes to the host (the prefetcher keeps per-block state);
    prefetched hits count as GPU reads, misses as streamed."""

    def __init__(self, prefetcher: SparsePrefetcher, blocks_per_step: int):
        super().__init__(blocks_per_step)
        self.prefetcher = prefetcher

    def begin_step(self, seq, streamed: range, after) -> None:
        self.prefetcher.begin_step(seq, after)

    def chunks_for_layer(self, seq, layer: int, q: torch.Tensor, candidates: range, after) -> Iterable:
        return self._counted(seq, layer, select_far_blocks(seq.summaries, layer, q[0], candidates, self.k))

    def _counted(self, seq, layer: int, selected: list[int]) -> Iterable:
        prefetcher = self.prefetcher
        hits, misses = prefetcher.num_hits, prefetcher.num_misses
        yield from prefetcher.chunks_for_layer(seq, layer, selected)
        seq.num_resident_reads += prefetcher.num_hits - hits
        seq.num_streamed_reads += prefetcher.num_misses - misses


class QueryPredictor(NoPredictor):
    """Predictor 'query': hidden-state lookahead and its far-block cache; its hits and misses are
    counted on the device (`read_counts` waits for them)."""

    def __init__(self, query: QueryLookahead, blocks_per_step: int):
        super().__init__(blocks_per_step)
        self.query = query

    def begin_step(self, seq, streamed: range, after) -> None:
        self.query.begin_step(streamed)

    def invalidate(self) -> None:
        self.query.invalidate()  # the streamer's regions overwrite the far-block cache's slots

    def after_append(self, seq, layer: int) -> None:
        self.query.predict(seq, layer)  # the next layers' blocks, copied while this layer computes

    def chunks_for_layer(self, seq, layer: int, q: torch.Tensor, candidates: range, after) -> Iterable:
        return self.query.chunks_for_layer(seq, layer, q[0])

    def observe(self, layer: int, hidden: torch.Tensor, position: object) -> None:
        self.query.observe(layer, hidden, position)

    def read_counts(self) -> tuple[int, int]:
        self.query.flush(block=True)
        totals = self.query.totals()
        return totals["hits"], totals["misses"]

    def finish(self) -> None:
        self.query.flush(block=True)


class CachePredictor(NoPredictor):
    """Predictor 'cache': the far part comes after the near part, from the runtime's far-block caches
    (their hits read the GPU, their misses were copied in)."""

    def __init__(self, cached: CachedSparse, blocks_per_step: int):
        super().__init__(blocks_per_step)
        self.cached = cached

    def begin_step(self, seq, streamed: range, after) -> None:
        self.cached.begin_step(seq, streamed)

    def invalidate(self) -> None:
        self.cached.invalidate()  # the streamer's regions overwrite the caches' slots

    def chunks_for_layer(self, seq, layer: int, q: torch.Tensor, candidates: range, after) -> Iterable:
        return ()

    def attend_far(self, layer: int, q: torch.Tensor, near: tuple[torch.Tensor, torch.Tensor],
                   scale: float) -> torch.Tensor:
        return self.cached.attend(layer, q, near, scale)

    def read_counts(self) -> tuple[int, int]:
        caches = self.cached.caches.stats()
        return caches["cache_hits"], caches["cache_misses"]

    def graph_far(self) -> CachedSparse | None:
        return self.cached


def predictor_for(runtime, is_sparse: bool) -> NoPredictor:
    """The sparse policy's predictor for a new sequence on `runtime` (`scheduler.predictor`); the exact
    policy's steps stream every far block and never ask it for chunks."""
    scheduler, T = runtime.config.scheduler, runtime.layout.block_tokens
    k = scheduler.sparse_token_budget // T
    if not is_sparse:
        return NoPredictor(k)
    if scheduler.predictor == "previous":
        prefetcher = SparsePrefetcher(runtime, k)
        # staging must hold a selection per layer plus a miss area; otherwise blocks are fetched on demand
        return PreviousPredictor(prefetcher, k) if prefetcher.enabled else NoPredictor(k)
    if scheduler.predictor == "query":
        return QueryPredictor(QueryLookahead(runtime, k, scheduler.lookahead_layers, scheduler.predict_with_previous), k)
    if scheduler.predictor == "cache":
        return CachePredictor(CachedSparse.of(runtime, k), k)
    return NoPredictor(k)
