"""CUDA graphs of the hot window's sparse decode rows: per layer, the selection, fetch and far
attention of every decoding row of the step, captured once and replayed each step until the rows
or their inputs move.

Primitives: `SparseStepGraphs` (`servable`, `key`, `near_buffer`, `attend`, `near_inputs_for`,
`attend_whole`, `forget`, `stats`).

Under vLLM's eager forward the sparse far path of a decoding row costs about 1.4 ms of host time
per layer (some 30 launches and their Python, results/profile-vllm-sparse-h200-04f0bf7.txt)
against about 0.25 ms of GPU work. One graph per layer for all the step's decoding rows turns that
into copies of their queries and near parts (FlashAttention writes the near outputs straight into
the graph's input when the graph serves every row of the step), one replay, and a copy of the
merged rows into vLLM's output (`FarKV.attend_into`), however many rows the step holds:

    captured, all rows: bound = [kmax | kmin] . [max(q,0) | min(q,0)] over each row's summary table,
                          blocks at or past its far count masked, into one score matrix (one
                          kernel, tierkv.sparse.kernels.block_bounds_rows)
                        ids = sorted top-k of each row of the scores (one top-k, one sort)
                        slots, miss = the requests' far-block cache sets (row_caches.RowCaches.
                          place_rows, one kernel): where each id is held, or the slot it takes,
                          and whether it must be copied
                        the missing blocks' CPU-tier slots, each row's from its own slot list (one
                          kernel, tierkv.cache_kernels.copy_sources)
                        copy kernel: CPU tier[pinned slots[ids]] -> cache[slots] for the misses only,
                          on the compute stream, one launch (a quantized tier: codes and scales, then
                          one dequantization)
                        (out, lse) = each row's query over its cache slots (one launch,
                          tierkv.attention.paged_rows_attention)
                        merged = LSE merge of (near_out, near_lse) and (out, lse)
                          (one launch, tierkv.attention.merge_two_into: on the host it cost 22-60 us)

The far counts are inputs of the graph (the bound runs over the whole summary table, blocks past
the count masked), so growing far parts replay the same graph; a layer captures again for a new
set of rows (a request joins or leaves; it keeps the graphs of its last GRAPHS_PER_LAYER sets) or
when a summary table or pinned-slot buffer is reallocated (both double, unless the engine's
max_model_len sized them once). A graph knows its rows by those buffers, not by request: with
max_model_len known a finished request's buffers pass to the next one (`FarKV.reuses_buffers`),
which replays its graphs; otherwise `forget` drops them. Rows it cannot serve
go the eager way (`FarKV.attend_parts`): far blocks without a summary, rows past `max_rows` (each
row's request needs a cache set of its own), engines without the copy kernel, CPU. A capture
that fails turns the graphs off for the engine's life (logged, counted); the eager path gives the
same result. All graphs draw on one memory pool and replay on the compute stream in order, one at
a time (`tierkv.sparse.graph_capture` says why their inputs and outputs lie outside it); what a
graph bakes in and holds is `tierkv.sparse.row_graph`.
"""
from __future__ import annotations

import logging
from collections import OrderedDict

import torch

from tierkv.attention import merge_two_into
from tierkv.transfer.device import to_device_no_sync
from tierkv.sparse.far_source import FarSource
from tierkv.sparse.graph_capture import capture_graph
from tierkv.sparse.row_caches import RowCaches
from tierkv.sparse.row_graph import NearInputs, RowGraph, row_key, static_inputs
from tierkv.sparse.step import packed_buffers, sparse_rows_body

logger = logging.getLogger(__name__)

GRAPHS_PER_LAYER = 4  # sets of rows whose graphs a layer keeps


class SparseStepGraphs:
    def __init__(self, source: FarSource, caches: RowCaches | None):
        """source: the engine's far blocks (CUDA, a copy-kernel engine: `FarSource.graphs_usable`); caches: its far-block
        caches, one set per decoding row a layer's graph serves (each row's request holds one while
        it runs; None: the graphs stay off)."""
        self.source = source
        self.caches = caches
        self.max_rows = caches.num_sets if caches is not None else 0
        device = source.device
        # quantized CPU tier: the rows' codes and scales land here
        self.packed = packed_buffers(source, device, self.max_rows) if self.max_rows else None
        # per layer, the graphs of the last GRAPHS_PER_LAYER sets of rows, least recently used first: a
        # batch that alternates between a few sets (a request joining, vLLM reordering) recaptures once each
        self.graphs: dict[int, OrderedDict[tuple, RowGraph]] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.side_stream = torch.cuda.Stream(device)  # captures run here
        self.enabled = self.max_rows > 0
        self.whole_enabled = self.enabled  # graphs that run the window part too (off after a failed capture)
        self.near_inputs: dict[tuple, NearInputs] = {}  # per row count and table columns (written every step)
        # the next-step prefetch inside each layer's graph (`prefetch_margin.MarginPrefetch`, the transformers
        # engine's predictor 'cache' sets it): forked beside the layer's attention, joined at its end
        self.prefetch = None
        self.counts = {"graph_captures": 0, "graph_replays": 0, "graph_rows": 0, "graph_capture_errors": 0,
                       "whole_graph_replays": 0, "whole_capture_errors": 0}

    def servable(self, req, num_far: int) -> bool:
        """Whether a decoding row can be served by the graphs in every layer: all its far blocks
        summarized in each (host-known; fewer than a selection are all read), and a far-block cache
        set for its request (taken here at its first graphed step; none left: it goes the eager
        way)."""
        summaries = req.summaries
        if not (self.enabled and summaries is not None and 0 < num_far <= min(summaries.prefix)):
            return False
        if req.cache is None:
            req.cache = self.caches.take()
        return req.cache is not None

    @staticmethod
    def key(layer: int, rows: list[tuple[str, object, int]], scale: float) -> tuple:
        """What a layer's graph for decoding rows (req_id, request, far blocks) bakes in."""
        return tuple(row_key(req, layer) for _, req, _ in rows), scale

    def near_buffer(self, layer: int, key: tuple) -> torch.Tensor | None:
        """The static near output of the layer's graph for `key`, if one is kept: FlashAttention may
        write the rows' near part there (a copy saved); None otherwise."""
        entry = self.graphs.get(layer, {}).get(key) if self.enabled else None
        return entry.near_out if entry is not None else None

    def attend(self, layer: int, rows: list[tuple[str, object, int]], q: torch.Tensor, near_out: torch.Tensor,
               near_lse: torch.Tensor, out_dtype: torch.dtype, scale: float,
               key: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The attention of decoding rows (req_id, request, far blocks) by one graph: their far parts,
        merged with their near parts (near_out [m, H, D], near_lse [m, H]) inside it: (out [m, H, D]
        of out_dtype, ids [m, k]), static tensors, read them before the next replay. q: the rows'
        queries [m, H, D], in the same order; key: `key(layer, rows, scale)` when the caller has it.
        None when the eager path must serve them (the caller checked `servable`)."""
        if not self.enabled or not rows or len(rows) > self.max_rows:
            return None
        key = key if key is not None else self.key(layer, rows, scale)
        counts = [n for _, _, n in rows]
        entry = self._kept(layer, key, lambda: self._capture(layer, rows, q, out_dtype, counts, key, scale,
                                                             near_parts=(near_out, near_lse)))
        if entry is None:
            return None
        if near_out is not entry.near_out:  # FlashAttention wrote elsewhere (no graph was kept at its call)
            entry.near_out.copy_(near_out)
        entry.near_lse.copy_(near_lse)
        return self._replay(entry, q, counts)

    def _kept(self, layer: int, key: tuple, capture) -> RowGraph | None:
        """The layer's graph for `key`, made most recently used; else `capture()`'s, kept in place of
        the least recently used past GRAPHS_PER_LAYER (None when the capture failed)."""
        kept = self.graphs.setdefault(layer, OrderedDict())
        entry = kept.get(key)
        if entry is not None:
            kept.move_to_end(key)
            return entry
        if len(kept) >= GRAPHS_PER_LAYER:
            kept.popitem(last=False)
        entry = capture()
        if entry is not None:
            kept[key] = entry
        return entry

    def _replay(self, entry: RowGraph, q: torch.Tensor, counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        entry.q.copy_(q)
        if entry.far_counts != counts:  # change once per block of decoded tokens: a copy saved otherwise
            entry.num_far.copy_(to_device_no_sync(counts, entry.num_far.device))
            entry.far_counts = counts
        entry.graph.replay()
        self.counts["graph_replays"] += 1
        self.counts["graph_rows"] += len(counts)
        return entry.out, entry.ids

    def near_inputs_for(self, table: torch.Tensor, seqused_k: torch.Tensor) -> NearInputs:
        """The window inputs of the step's whole graphs, set to its table [m, C] and key counts [m]
        (two copies, once per step for all layers). Shared by every set of m rows: each step writes
        them before its first replay, after the last step's replays in stream order."""
        key = (table.shape, table.dtype, seqused_k.dtype)
        inputs = self.near_inputs.get(key)
        if inputs is None:
            m = table.shape[0]
            inputs = self.near_inputs[key] = NearInputs(
                torch.empty_like(table), torch.empty_like(seqused_k),
                torch.arange(m + 1, dtype=torch.int32, device=table.device))
        inputs.table.copy_(table)
        inputs.seqused_k.copy_(seqused_k)
        return inputs

    def attend_whole(self, layer: int, rows: list[tuple[str, object, int]], q: torch.Tensor, window,
                     inputs: NearInputs, max_seqlen_k: int, out_dtype: torch.dtype, scale: float,
                     key: tuple) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`attend` for a step whose rows are all graphed, the window part run inside the graph too:
        window(q, table, seqused_k, cu_seqlens_q, max_seqlen_k) -> (out [m, H, D], lse [m, H]) is the
        backend's FlashAttention over vLLM's pool (its cache and scales fixed for the engine's life,
        named by window.key), reading `inputs` (`near_inputs_for`), with max_seqlen_k an upper bound of
        every row's key count. key: `(key(layer, rows, scale), window.key)`. None when the caller must
        run the window part itself (a capture of it failed: the split graphs still serve)."""
        if not (self.enabled and self.whole_enabled) or not rows or len(rows) > self.max_rows:
            return None
        key = (*key, inputs.table.data_ptr(), inputs.table.shape)
        counts = [n for _, _, n in rows]
        entry = self._kept(layer, key, lambda: self._capture(layer, rows, q, out_dtype, counts, key, scale,
                                                             window=(window, inputs, max_seqlen_k)))
        if entry is None:
            return None
        self.counts["whole_graph_replays"] += 1
        return self._replay(entry, q, counts)

    def body(self, layer: int, reqs: list, q: torch.Tensor, far_counts: torch.Tensor, near, out: torch.Tensor,
             scale: float, row_inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]):
        """What a layer's graph runs for rows `reqs` (static inputs q [m, H, D], far_counts int64 [m];
        near: their near parts (out [m, H, D], lse [m, H]) as static inputs, or a callable computing
        them in the graph; static output out [m, H, D]): a callable that writes the rows' merged
        attention into `out` and gives their selections ids [m, k]."""
        def run():
            near_out, near_lse = near() if callable(near) else near
            far_out, far_lse, ids = sparse_rows_body(self.source, reqs, layer, q, far_counts, self.caches, scale,
                                                     self.packed, *row_inputs, prefetch=self.prefetch)
            merge_two_into(out, (near_out, near_lse), (far_out, far_lse))
            if self.prefetch is not None:
                self.prefetch.join()  # a graph ends with every stream it forked joined
            return ids

        return run

    def _capture(self, layer: int, rows: list[tuple[str, object, int]], q_rows: torch.Tensor, out_dtype: torch.dtype,
                 counts: list[int], key: tuple, scale: float, near_parts: tuple | None = None,
                 window: tuple | None = None) -> RowGraph | None:
        """A graph for decoding rows: near_parts (out, lse), the rows' near parts copied into static
        inputs before each replay; or window (the backend's FlashAttention, its NearInputs, the key
        count bound), the window part run inside the graph."""
        q, out, far_counts, row_inputs = static_inputs(layer, rows, q_rows, out_dtype, counts)
        near_out = near_lse = inputs = None
        if window is None:
            near_out, near_lse = (t.contiguous().clone() for t in near_parts)
            near = near_out, near_lse
        else:
            run_window, inputs, max_seqlen_k = window

            def near():
                return run_window(q, inputs.table, inputs.seqused_k, inputs.cu_seqlens_q, max_seqlen_k)

        # the run before the capture fills the rows' caches and counts: put both back, so that the replay
        # right after it copies and counts the step's misses as a step without a capture would
        saved = self.caches.snapshot()
        counted = self.prefetch.counters.clone() if self.prefetch is not None else None
        recorded = self._record(self.body(layer, [req for _, req, _ in rows], q, far_counts, near, out, scale,
                                          row_inputs), whole=window is not None)
        self.caches.restore(saved)
        if counted is not None:
            self.prefetch.counters.copy_(counted)
        if recorded is None:
            return None
        return RowGraph(key, recorded[0], q, far_counts, near_out, near_lse, out, recorded[1], counts,
                        tuple(r[0] for r in rows), row_inputs, inputs)

    def _record(self, body, whole: bool = False) -> tuple[torch.cuda.CUDAGraph, torch.Tensor] | None:
        """Run `body` once, then capture it: (graph, its static ids output); None if the capture failed
        (logged, counted): a failed split graph turns all graphs off, a failed whole graph only those
        (the split graphs, with the window part run by the backend, serve from then on)."""
        if not any(self.graphs.values()):  # every graph of the pool freed (requests finished): the pool is gone
            self.pool = torch.cuda.graph_pool_handle()
        try:
            graph, ids = capture_graph(body, self.pool, self.side_stream)
        except Exception:  # nothing was returned from here: the caller's fallback gives the same result
            self._capture_failed(whole)
            return None
        self.counts["graph_captures"] += 1
        return graph, ids

    def _capture_failed(self, whole: bool) -> None:
        """Log the capture error being handled and turn off what it concerns: the whole graphs (the
        split graphs, with the window part run by the backend, serve from then on) or all graphs."""
        if whole:
            logger.exception("tierkv hot window: capturing a sparse decode graph with the window part failed; "
                             "the backend runs the window part from now on")
            self.whole_enabled = False
            for kept in self.graphs.values():
                for key in [key for key, entry in kept.items() if entry.near_inputs is not None]:
                    del kept[key]
            self.counts["whole_capture_errors"] += 1
            return
        logger.exception("tierkv hot window: capturing a sparse decode graph failed; sparse rows run eagerly")
        self.enabled = False
        self.graphs.clear()
        self.counts["graph_capture_errors"] += 1

    def carry_on_from(self, previous: "SparseStepGraphs") -> None:
        """Take over the counters of the graphs this instance replaces (a run-time staging resize: the
        old graphs baked the old far-block caches), and stay off where a capture failed there."""
        self.counts = {name: self.counts[name] + previous.counts[name] for name in self.counts}
        self.enabled = self.enabled and previous.enabled
        self.whole_enabled = self.whole_enabled and previous.whole_enabled

    def forget(self, req_id: str) -> None:
        """Drop the graphs that serve a finished request (whose buffers no other request will hold)."""
        for kept in self.graphs.values():
            for key in [key for key, entry in kept.items() if req_id in entry.request_ids]:
                del kept[key]

    @property
    def packed_bytes(self) -> int:
        """GPU bytes of the quantized tier's code and scale buffers (0 for an unquantized tier)."""
        return sum(t.numel() * t.element_size() for t in self.packed[:2]) if self.packed is not None else 0

    def stats(self) -> dict:
        return {**self.counts, "graphs": sum(len(kept) for kept in self.graphs.values()), "graphs_enabled": self.enabled,
                "whole_graphs_enabled": self.enabled and self.whole_enabled, "max_rows": self.max_rows}
