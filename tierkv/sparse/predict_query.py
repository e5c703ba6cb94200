"""Sparse prefetch with the `query` predictor: the next layers' selection, predicted from the hidden state.

Primitives: `QueryLookahead` (`begin_step`, `observe`, `predict`, `chunks_for_layer`, `flush`),
`QueryProjector`.

As InfiniGen and OmniKV do, layer L's input hidden state predicts the queries of layers
L+1..L+d (d = `scheduler.lookahead_layers`): the hidden state goes through layer L+j's input
norm, q projection and rotary embedding at the decode position (a `QueryProjector` the model
adapter supplies), and is scored against layer L+j's block summaries with the same upper bound
the selection uses. The predicted blocks (with `predict_with_previous`, also the layer's previous
selection) that are not in the far-block cache are copied into it on the copy stream while
layer L computes:

    layer L starts   -> predict L+1..L+d -> admit into the cache -> copy (copy stream)
    layer L+j attends -> exact top-k -> hits: cache slots | misses: fetched now, counted as stalls

Attention reads exactly the selected blocks, so the output never depends on the prediction.
Everything stays on the device (`tierkv.sparse.block_cache`): counts accumulate in a device tensor,
copied to the host once per step without waiting (`flush`), read when that copy has landed.
Per layer and step the counters are

    predicted  blocks predicted for the layer    used    predicted and selected
    needed     blocks selected                   hits    selected, already in the cache
    copied     blocks copied ahead               misses  selected, fetched at attention time (stalls)
"""
from __future__ import annotations

import time
from typing import Protocol

import torch

from tierkv.transfer.lookahead import StagedChunk
from tierkv.transfer.device import to_device_no_sync
from tierkv.sparse.summaries import select_far_blocks_on_device
from tierkv.sparse.block_cache import FarBlockCache, gather_pairs

COUNTERS = ("predicted", "used", "needed", "hits", "misses", "copied")


class QueryProjector(Protocol):
    def __call__(self, layer: int, hidden: torch.Tensor, position: object) -> torch.Tensor:
        """hidden [hidden_size] (layer input, one token) -> q [num_heads, head_dim] of `layer` at `position`."""


class QueryLookahead:
    def __init__(self, rt, blocks_per_step: int, depth: int, with_previous: bool):
        self.rt = rt
        self.k = blocks_per_step
        self.depth = depth
        self.with_previous = with_previous
        self.num_layers = rt.num_layers
        device = rt.pool.staging.device
        self.cache = FarBlockCache(rt.num_layers, rt.pool.staging.shape[0], blocks_per_step, rt.layout.num_bytes, device)
        self._block_tokens = to_device_no_sync([rt.layout.block_tokens] * blocks_per_step, device)  # int64 [k]
        self._skips_on_device = rt.io.engine.backend in ("cupy", "adaptive") and rt.cpu.quant_format is None  # the kernel (device slots)
        self._counts = torch.zeros((rt.num_layers, len(COUNTERS)), dtype=torch.int64, device=device)
        self._predicted = torch.zeros((rt.num_layers, 1), dtype=torch.bool, device=device)  # [L, cap + 1]
        self._previous: list[torch.Tensor | None] = [None] * rt.num_layers
        self._handles: list[list] = [[] for _ in range(rt.num_layers)]
        self._inputs: list[tuple[torch.Tensor, object] | None] = [None] * rt.num_layers
        self._candidates = range(0)
        self._step_tick = 0
        self._tick = 0
        self._in_flight: list[tuple[object, torch.Tensor]] = []  # (event, pinned [L, C]) per flushed step
        self.layer_totals = [dict.fromkeys(COUNTERS, 0) for _ in range(rt.num_layers)]
        self.step_totals: list[dict] = []  # one per decode step, in order, once flushed

    # -- per step -------------------------------------------------------------------------------
    def begin_step(self, candidates: range) -> None:
        """A sparse decode step over far blocks `candidates` starts (host only, plus tensor growth)."""
        self.flush(block=False)
        self._candidates = candidates
        self.cache.reserve(candidates.stop)
        if self._predicted.shape[1] < candidates.stop + 1:
            self._predicted = torch.zeros((self.num_layers, self.cache.slot_of_block.shape[1]), dtype=torch.bool,
                                          device=self._predicted.device)
        self._tick += 1
        self._step_tick = self._tick
        self._handles = [[] for _ in range(self.num_layers)]

    def invalidate(self) -> None:
        """A step that is not a sparse decode step overwrote the staging slots."""
        self.cache.invalidate()
        self._previous = [None] * self.num_layers
        self._inputs = [None] * self.num_layers

    def observe(self, layer: int, hidden: torch.Tensor, position: object) -> None:
        """Keep layer `layer`'s input hidden state ([hidden_size], this step's token) for `predict`."""
        self._inputs[layer] = (hidden, position)

    def predict(self, seq, layer: int) -> None:
        """From layer `layer`'s observed input, prefetch layers layer+1..layer+depth (enqueue only)."""
        observed, self._inputs[layer] = self._inputs[layer], None
        projector = getattr(self.rt, "query_projector", None)
        targets = range(layer + 1, min(layer + 1 + self.depth, self.num_layers))
        if layer == 0 and self.with_previous:
            self._prefetch(seq, 0, None)  # nothing precedes layer 0: its previous selection only
        for target in targets:
            q = projector(target, *observed) if observed is not None and projector is not None else None
            self._prefetch(seq, target, q)

    def _prefetch(self, seq, layer: int, q: torch.Tensor | None) -> None:
        ids = [] if q is None else [select_far_blocks_on_device(seq.summaries, layer, q, self._candidates, self.k)]
        if q is not None:
            self._predicted[layer].index_fill_(0, ids[0], True)
        if self.with_previous and self._previous[layer] is not None:
            ids.append(self._previous[layer])
            self._previous[layer] = None  # added once per step
        if not ids:
            return
        ids = torch.cat(ids) if len(ids) > 1 else ids[0]
        ids = torch.sort(ids).values
        distinct = torch.ones_like(ids, dtype=torch.bool)
        distinct[1:] = ids[1:] != ids[:-1]
        self._tick += 1
        local = self.cache.lookup(layer, ids)
        cached = local >= 0
        self.cache.touch(layer, torch.where(cached, local, -1), self._tick)  # not evicted before they are read
        admitted = self.cache.admit(layer, ids, distinct & ~cached, self._tick, self._step_tick)
        copy = admitted >= 0
        self._counts[layer, COUNTERS.index("copied")] += copy.sum()
        src = torch.where(copy, seq.device_cpu_slots(layer).index_select(0, ids), -1)
        handle = gather_pairs(self.rt.io, src, self.rt.pool.staging, self.cache.staging_slots(layer, admitted),
                              after=self._copy_after(seq), skip_on_device=self._skips_on_device)
        if handle is not None:
            self._handles[layer].append(handle)

    def _copy_after(self, seq) -> list:
        # what compute did so far (readers of the evicted slots, the directory update) and the last write-back
        return [e for e in (seq._last_d2h, self.rt.engine.record_compute_event()) if e is not None]

    # -- at attention time ----------------------------------------------------------------------
    def chunks_for_layer(self, seq, layer: int, q: torch.Tensor):
        """The exact top-k far blocks for q [num_heads, head_dim]: hits read from the cache, misses
        fetched now (into the cache where a slot is free, else the miss area) and waited for."""
        rt = self.rt
        T = rt.layout.block_tokens
        for handle in self._handles[layer]:  # this step's prefetches into the layer's slots
            handle.wait_on_current_stream()
        self._handles[layer] = []
        selected = select_far_blocks_on_device(seq.summaries, layer, q, self._candidates, self.k)  # [n]
        n = selected.numel()
        if n == 0:
            return
        self._tick += 1
        local = self.cache.lookup(layer, selected)
        hit = local >= 0
        self.cache.touch(layer, local, self._tick)
        admitted = self.cache.admit(layer, selected, ~hit, self._tick, self._step_tick)
        fetched = torch.where(admitted >= 0, self.cache.staging_slots(layer, admitted), self.cache.miss_slots(n))
        dst = torch.where(hit, -1, fetched)
        src = torch.where(hit, -1, seq.device_cpu_slots(layer).index_select(0, selected))
        self._count(layer, selected, hit)
        start_s = time.perf_counter()
        handle = gather_pairs(rt.io, src, rt.pool.staging, dst, after=self._copy_after(seq),
                              skip_on_device=self._skips_on_device)
        if handle is not None:  # one late chunk per layer: its wait is the stall (GPU-timed on CUDA)
            rt.streamer.wait_for_chunk(handle, layer, is_late=True, host_wait_s=time.perf_counter() - start_s)
        if self.with_previous:
            self._previous[layer] = selected
        yield StagedChunk(torch.where(hit, self.cache.staging_slots(layer, local), fetched), selected * T,
                          self._block_tokens[:n])

    def _count(self, layer: int, selected: torch.Tensor, hit: torch.Tensor) -> None:
        predicted = self._predicted[layer]
        used = predicted.index_select(0, selected).sum()
        num_hits = hit.sum()
        row = torch.stack([predicted.sum(), used, torch.full_like(used, selected.numel()), num_hits,
                           selected.numel() - num_hits, torch.zeros_like(used)])
        self._counts[layer] += row
        predicted.zero_()

    # -- counters -------------------------------------------------------------------------------
    def flush(self, *, block: bool) -> None:
        """Copy the counters gathered since the last flush to the host (no wait) and fold in every
        copy that has landed (all of them, waiting for them, with `block`)."""
        pinned = torch.empty(self._counts.shape, dtype=torch.int64, pin_memory=self._counts.is_cuda)
        pinned.copy_(self._counts, non_blocking=True)
        self._in_flight.append((self.rt.engine.record_compute_event(), pinned))
        self._counts.zero_()
        still = []
        for event, counts in self._in_flight:
            if event is not None and not event.query():
                if not block:
                    still.append((event, counts))
                    continue
                event.synchronize()
            self._fold(counts.tolist())
            self.rt.engine.release_event(event)
        self._in_flight = still

    def _fold(self, rows: list[list[int]]) -> None:
        """Add one flush's counters (a row per layer) to the totals, the recorder and the transfer counts."""
        if not any(any(row) for row in rows):
            return
        step = dict.fromkeys(COUNTERS, 0)
        for layer, row in enumerate(rows):
            for name, value in zip(COUNTERS, row):
                self.layer_totals[layer][name] += value
                step[name] += value
        self.step_totals.append(step)
        rt = self.rt
        if rt.streamer.recorder is not None:
            rt.streamer.recorder.record_selection(num_prefetched=step["predicted"], num_used=step["used"],
                                                  num_needed=step["needed"])
        rt.streamer.num_stalls += step["misses"]
        moved = (step["copied"] + step["misses"]) * rt.layout.num_bytes
        rt.streamer.bytes_streamed += moved
        if self._skips_on_device:  # gather_pairs took back the listed bytes; these crossed PCIe
            rt.io.engine.num_bytes_moved["h2d"] += moved

    def totals(self) -> dict:
        """Counters summed over layers and steps (flushed ones), with hit rate, precision and recall."""
        total = {name: sum(t[name] for t in self.layer_totals) for name in COUNTERS}
        total["gpu_hit_rate"] = total["hits"] / total["needed"] if total["needed"] else None
        total["precision"] = total["used"] / total["predicted"] if total["predicted"] else None
        total["recall"] = total["used"] / total["needed"] if total["needed"] else None
        return total
