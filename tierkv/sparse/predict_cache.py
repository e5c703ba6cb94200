"""Sparse decode with predictor `cache` in the transformers engine: the far-block caches and sparse
step both engines share (`sparse.row_caches`, `sparse.step`), for the one sequence of a `SequenceKV`,
which it hands them as one `far_source.SparseRow` over the runtime's `far_source.FarSource`.

Primitives: `CachedSparse` (`of`, `begin_step`, `invalidate`, `attend`, `attend_far`, `graph_key`,
`graph_row_inputs`, `stats`, `totals`), `check_staging`.

Each layer keeps its last `scheduler.sparse_cache_selections` selections (at least one) on the GPU,
in a far-block cache laid over the staging memory (`sparse.row_caches.RowCaches`), so a step
copies across PCIe only the selected blocks the cache lacks. Per layer the far part is
`sparse.step.sparse_rows_body`, then merged with the near part (resident blocks and this step's
tokens, which the sequence attends as always):

    bound = the far blocks' key summaries against q (one kernel on CUDA), top-k in block order
    slots, miss = placement in the layer's cache (one kernel on CUDA, least recently used replaced)
    copy kernel: CPU tier -> cache slots for the misses only (on the compute stream)
    (out, lse) over the selected blocks; merged with the near part's

On CUDA with a copy-kernel transfer backend and `scheduler.sparse_cuda_graphs`, that work is one CUDA
graph per layer (`sparse.step_graphs.SparseStepGraphs`), captured at the first decode step and
replayed: a few host calls per layer instead of some thirty launches. Elsewhere, and after a failed
capture, the same work runs eagerly. A selected block the cache lacks is fetched at selection and
counted as a miss (a layer with one is a stall), so the output never depends on what the cache holds;
it equals predictor `none`'s.

With `scheduler.sparse_prefetch_margin` m the step also predicts: the blocks ranked k..k+m-1 by the
same bounds (what the next step's selection mostly adds, as the query drifts) are placed in the
layer's cache and copied in on a side stream beside the layer's attention, joined at the layer's end
(inside its graph: a graph must join what it forks) - `sparse.prefetch_margin.MarginPrefetch`. Its
precision and recall are in `stats()["prefetch"]`.

The far blocks of the transformers engine follow its front blocks (sinks and the resident far
cache): far block i is block `first + i` of the sequence, its summary row `first + i` of each layer's
table (`BlockSummaries.from_block`), its CPU-tier slot in a device list per layer kept here. A
change of `first` (a new GPU budget) or a step that streamed through the staging memory empties
the caches. The runtime keeps one `CachedSparse` for its sequences, one at a time (`of`): the caches
and graphs stay allocated, emptied for each new sequence.
"""
from __future__ import annotations

import torch

from tierkv.attention import merge_partials
from tierkv.config import ConfigError
from tierkv.transfer.device import to_device_no_sync
from tierkv.units import format_bytes
from tierkv.transfer.device import append_at
from tierkv.sparse.far_source import FarSource, SimpleRow
from tierkv.sparse.row_caches import RowCaches
from tierkv.sparse.step_graphs import SparseStepGraphs
from tierkv.sparse.step import packed_buffers, sparse_rows_body
from tierkv.sparse.prefetch_margin import MarginPrefetch, precision_recall


def check_staging(num_layers: int, staging_blocks: int, blocks_per_step: int, selections: int,
                  block_bytes: int) -> None:
    """ConfigError naming scheduler.staging_bytes when it cannot hold the caches of predictor `cache`:
    layers x selections x blocks_per_step blocks."""
    slots = num_layers * selections * blocks_per_step
    if staging_blocks < slots:
        raise ConfigError(
            "scheduler.staging_bytes", staging_blocks * block_bytes,
            f"predictor 'cache' keeps {selections} selection(s) of {blocks_per_step} blocks per layer on the GPU: "
            f"{num_layers} x {selections} x {blocks_per_step} blocks of {format_bytes(block_bytes)}, "
            f"at least {format_bytes(slots * block_bytes)} (or lower scheduler.sparse_cache_selections)")


class CachedSparse:
    def __init__(self, rt, blocks_per_step: int):
        scheduler, layout = rt.config.scheduler, rt.layout
        self.k = blocks_per_step
        selections = max(1, scheduler.sparse_cache_selections)
        staging = rt.pool.staging
        check_staging(rt.num_layers, staging.shape[0], blocks_per_step, selections, layout.num_bytes)
        self.caches = RowCaches(1, rt.num_layers, blocks_per_step, layout.shape, layout.dtype, staging.device,
                                selections=selections, storage=staging)
        # the sequence as the step's one row: summaries from its first far block on (every full block it wrote
        # has one), set per step
        self.row = SimpleRow(self.caches.take())
        self.source = FarSource(rt.cpu, rt.io.engine, staging.device, rt.num_layers, blocks_per_step,
                                layout.block_tokens, scheduler.sparse_bound_weight)
        # scheduler.sparse_prefetch_margin: each layer also copies in the blocks ranked just below its selection
        margin = scheduler.sparse_prefetch_margin
        self.prefetch = MarginPrefetch(self.source, self.caches, margin, max_rows=1) if margin else None
        graphs = scheduler.sparse_cuda_graphs and self.source.graphs_usable()
        self.graphs = SparseStepGraphs(self.source, self.caches) if graphs else None
        if self.graphs is not None:
            self.graphs.prefetch = self.prefetch
        self.packed = (self.graphs.packed if self.graphs is not None
                       else packed_buffers(self.source, staging.device))
        self._slots = [torch.empty(0, dtype=torch.int64, device=staging.device) for _ in range(rt.num_layers)]
        self._filled = [0] * rt.num_layers    # entries of each layer's slot list written
        self._first = None                    # the first far block the caches and slot lists start at
        self._num_far = 0
        self._num_far_dev = torch.zeros(1, dtype=torch.int64, device=staging.device)
        self._past: dict[str, int] = {}  # the counts of the runtime's earlier sequences (`totals`)

    @classmethod
    def of(cls, rt, blocks_per_step: int) -> "CachedSparse":
        """The runtime's, emptied for a new sequence (made at the first one)."""
        cached = rt.cached_sparse
        if cached is None or cached.k != blocks_per_step:
            cached = rt.cached_sparse = cls(rt, blocks_per_step)
        cached.invalidate()
        cached._first, cached._filled, cached._num_far = None, [0] * rt.num_layers, 0
        cached._past = cached._totals_of(cached._counts())
        cached.caches.counters.zero_()  # the sequence's hits and misses (`SequenceKV.read_stats`)
        cached.caches.prefetch_used.zero_()
        if cached.prefetch is not None:
            cached.prefetch.counters.zero_()
        return cached

    # -- per step -------------------------------------------------------------------------------
    def begin_step(self, seq, candidates: range) -> None:
        """A sparse decode step over far blocks `candidates` (host work, and copies of new slot-list
        entries). The compute stream waits (on the device) for write-backs still in flight, so no
        copy reads a CPU-tier slot before its bytes have landed."""
        if candidates.start != self._first:  # the sequence's first step, or a new GPU budget moved the front blocks
            self.invalidate()
            self._first = candidates.start
            self._filled = [0] * len(self._filled)
        first, num_far = candidates.start, len(candidates)
        for layer, slots in enumerate(seq.cpu_slots):
            have = self._filled[layer]
            if have < num_far:
                new = to_device_no_sync(slots[first + have : first + num_far], self._slots[layer].device)
                self._slots[layer] = append_at(self._slots[layer], have, new)
                self._filled[layer] = num_far
        seq.summaries.reserve(first + self.k)  # the bounds' width: at least one selection past `first`
        self.row.far_summaries = seq.summaries.from_block(first)
        self.row.pinned_slots_dev = self._slots
        if num_far != self._num_far:
            self._num_far_dev.fill_(num_far)
            self._num_far = num_far
        for _, handle in seq._pending_d2h:
            handle.wait_on_current_stream()

    def invalidate(self) -> None:
        """The caches hold nothing any more (a step streamed through the staging memory they lie in)."""
        self.caches.give_back(self.row.cache)
        self.row.cache = self.caches.take()

    def attend(self, layer: int, q: torch.Tensor, near: tuple[torch.Tensor, torch.Tensor],
               scale: float) -> torch.Tensor:
        """q [1, num_heads, head_dim] of this step's token, near: its near part (out, lse) -> the
        attention over near and selected far blocks, float32 [1, num_heads, head_dim]."""
        near_out, near_lse = near
        if self._num_far == 0:
            return near_out
        if self.graphs is not None and self.graphs.enabled:
            rows = [("sequence", self.row, self._num_far)]
            replayed = self.graphs.attend(layer, rows, q, near_out, near_lse, torch.float32, scale)
            if replayed is not None:
                return replayed[0].clone()  # the graph's static output: the next replay rewrites it
        return self.attend_far(layer, q, near, scale)

    def attend_far(self, layer: int, q: torch.Tensor, near: tuple[torch.Tensor, torch.Tensor], scale: float,
                   row_inputs: tuple = ()) -> torch.Tensor:
        """`attend` by the sparse step's body itself: eagerly, or inside a decode step's CUDA graph (which
        cannot replay the per-layer graphs within its capture), there with static row inputs
        (`graph_row_inputs`)."""
        if self._num_far == 0:
            return near[0]
        out, lse, _ = sparse_rows_body(self.source, [self.row], layer, q, self._num_far_dev, self.caches, scale,
                                       self.packed, *row_inputs, prefetch=self.prefetch)
        if self.prefetch is not None:
            self.prefetch.join()  # as in the graphs: nothing forked outlives the layer
        return merge_partials([near, (out, lse)])[0]

    # -- inside a decode step's CUDA graph (tierkv.engine.decode_graph) ---------------------------------------
    def graph_key(self) -> tuple:
        """What a decode step's graph bakes in of the far part: the caches' set, whether there are far
        blocks, the summary tables (address, rows) and the slot lists (addresses, sizes)."""
        tables = self.row.far_summaries.tables if self.row.far_summaries is not None else []
        return (self.row.cache.index, self._num_far > 0, tuple((t.data_ptr(), t.shape[0]) for t in tables[:1]),
                tuple((slots.data_ptr(), slots.numel()) for slots in self._slots))

    def graph_row_inputs(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per layer, the sparse step's static inputs for this sequence's one row: its cache set, the
        address of its summary table and of its slot list (int64 [1] each, on the device)."""
        tables = self.row.far_summaries.tables
        values = torch.tensor([[self.row.cache.index] * len(tables), [t.data_ptr() for t in tables],
                               [slots.data_ptr() for slots in self._slots]], dtype=torch.int64)
        values = to_device_no_sync(values.view(-1), self._num_far_dev.device).view(3, -1)
        return [(values[0, i : i + 1], values[1, i : i + 1], values[2, i : i + 1]) for i in range(len(tables))]

    def _counts(self) -> dict[str, int]:
        """The current sequence's hits, misses, stalled layers and, with a margin, the blocks it
        copied and those a selection used (one device read)."""
        caches = self.caches
        if self.prefetch is None:
            return dict(zip(("cache_hits", "cache_misses", "cache_stalled_rows"), caches.counters.tolist()))
        values = torch.cat([caches.counters, self.prefetch.counters[1:2], caches.prefetch_used]).tolist()
        return dict(zip(("cache_hits", "cache_misses", "cache_stalled_rows", "prefetch_copied", "prefetch_used"),
                        values))

    def _totals_of(self, counts: dict[str, int]) -> dict[str, int]:
        return {key: self._past.get(key, 0) + value for key, value in counts.items()}

    def totals(self) -> dict:
        """Every sequence's counts on the runtime so far (the runtime's stats): hits, misses, stalled
        layers (a selection that missed waited for its copy), the bytes copied into the caches and,
        with a margin, the prefetch's copied and used blocks, precision (used / copied) and recall
        (used / (used + misses))."""
        totals = self._totals_of(self._counts())
        # what crossed PCIe into the caches: the misses and the margin's copies, each a block, or a quantized
        # tier's codes and scales (its slot_bytes); the copy kernels do not count them (a graph replays them)
        totals["cache_copied_bytes"] = ((totals["cache_misses"] + totals.get("prefetch_copied", 0))
                                        * self.source.cpu.slot_bytes)
        if self.prefetch is not None:
            totals["prefetch_precision"], totals["prefetch_recall"] = precision_recall(
                totals["prefetch_used"], totals["prefetch_copied"], totals["cache_misses"])
        return totals

    def stats(self) -> dict:
        """The caches' counters (one device read), the next-step prefetch's (its precision and recall;
        None without a margin) and the graphs' (None without them)."""
        return {**self.caches.stats(), "prefetch": self.prefetch.stats() if self.prefetch is not None else None,
                "cuda_graphs": self.graphs.stats() if self.graphs is not None else None}
