"""Far KV under vLLM's hot-window pool: the blocks vLLM no longer holds, read back from the tiers.

Primitives: `FarKV` (`add_hashes`, `summarize`, `finish`, `begin_step`, `attend`, `attend_into`,
`attend_whole`, `near_out_buffer`, `attend_parts`, `end_step`, `stats`). No vLLM import: tested on
CPU with the PyTorch reference attention. The decoding rows the CUDA graphs serve go through
`tierkv.integrations.vllm.graphed_rows`, the others through `eager_rows` (streamed chunks and sparse
selections; their kernels and merges: `far_attention`); the counters are read by `far_stats`.

With the hot window vLLM keeps only the last `window_tokens` of each request in its pool and
frees the blocks before them. A query at position p then reads

    keys [0, F*T)          far: blocks the connector saved, streamed from the CPU tier   (here)
    keys [F*T, p]          near: vLLM's paged cache, causal                              (backend)

with F = `far_blocks(num_computed, window, T)` fixed per request and step. vLLM has freed at most
the blocks before (num_computed - window + 1) // T, so the near part is in its pool, and every
far block is full and was saved in an earlier step. Both parts return (out, lse); the backend
merges them with the LSE rule, so the result is exact attention over [0, p].

Per step the far blocks of all requests are streamed through the staging ring layers ahead, or,
under `scheduler.policy: sparse`, a decoding row's selected far blocks fetched once selected
(`eager_rows`). The staging's split: `far_staging`.

With max_model_len known, a finished sparse request's key summaries and device slot lists (sized for
it) pass to the next request, and the graphs captured for one replay for the other (`reuses_buffers`).

A request's hashes and CPU-tier pins (from its saves or the step its blocks become far): `far_requests`.
"""
from __future__ import annotations

import logging
import time
from typing import Collection, Mapping, Sequence

import torch

from tierkv.integrations.vllm.eager_rows import EagerRows
from tierkv.integrations.vllm.far_attention import assemble_rows, merge_with_near
from tierkv.integrations.vllm.far_requests import FarPins, FarRequest
from tierkv.integrations.vllm.far_staging import FarStaging, split_staging
from tierkv.integrations.vllm.far_stats import cache_stats, far_kv_stats
from tierkv.integrations.vllm.far_step import FarRow, HostTimes, lay_out_step, step_rows
from tierkv.integrations.vllm.graphed_rows import GraphedRows
from tierkv.metrics.prefetch import PrefetchRecorder
from tierkv.transfer.lookahead import LookaheadStreamer
from tierkv.sparse.request_summaries import KeySummaries, SelectionOverlap
from tierkv.sparse.step_graphs import SparseStepGraphs

logger = logging.getLogger(__name__)


class FarKV:
    _retired_cache_counts: tuple[int, int, int] = (0, 0, 0)  # the caches' counters a staging resize dropped

    def __init__(self, store, window_tokens: int, max_model_len: int | None = None, max_rows: int = 1,
                 own_pool: bool = True):
        """store: the engine's `VllmKVStore` (its CPU tier, transfer engine and block I/O). Every
        streamed chunk is reported to `self.recorder`: on CUDA, how long compute waited for it,
        timed by the GPU. max_model_len: the engine's longest request; under the sparse policy it
        bounds each request's key summaries (`summary_bytes_per_request`). max_rows: the engine's
        decoding rows per step at most (vLLM's max_num_seqs): the sparse policy's CUDA graphs give
        each a selection's worth of staging, within half of `scheduler.staging_bytes`."""
        if window_tokens < 1:
            raise ValueError(f"window_tokens: got {window_tokens}; the hot window needs at least one token")
        self.store = store
        store.hot_window = self  # its stats() reports ours
        store.saves.keep_pinned = True  # saved blocks stay pinned until they become far (no re-pinning)
        self.window_tokens = window_tokens
        self.block_tokens = store.layout.block_tokens
        self.max_blocks = -(-max_model_len // self.block_tokens) if max_model_len else None
        self.own_pool = own_pool  # the buffers in an allocator pool of their own (`far_staging.split_staging`)
        staging = split_staging(store, max_rows, own_pool=own_pool)  # carved from scheduler.staging_bytes
        # sparse: a decoding row attends its k far blocks with the largest key bound (tierkv.sparse)
        self.sparse_blocks = staging.sparse_blocks
        self.source = staging.source  # what the engine-agnostic sparse step reads of the far blocks (sparse.step)
        self.recorder = PrefetchRecorder(store.num_layers)
        self.max_rows = max_rows  # what a run-time resize's staging is split for (`make_staging`)
        self.grid = staging.grid  # the regions' sizes every run-time resize keeps (`far_staging.ChunkGrid`)
        self.requests: dict[str, FarRequest] = {}
        self.streamer = self.sparse_streamer = self.row_caches = self.graphs = None
        # the main ring (self.pool, self.streamer), the eager sparse regions, the far-block caches, the step graphs
        self.use_staging(staging, store.config.scheduler.staging_bytes)
        # sparse with max_model_len known: a finished request's summary tables and device slot lists,
        # allocated once at max_model_len's blocks, go to the next request at the same addresses, so the
        # CUDA graphs captured for the one serve the other (a graph bakes addresses, not requests)
        self.reuses_buffers = self.sparse_blocks is not None and self.max_blocks is not None
        self.pins = FarPins(store, device_slots=self.sparse_blocks is not None, max_blocks=self.max_blocks)
        self.key_summaries = KeySummaries(self)  # sparse: the requests' key summaries, and the eager selection
        self.graphed = GraphedRows(self)  # the decoding rows the graphs serve (none while graphs is None)
        self.eager = EagerRows(self)  # the others: streamed chunks, sparse rows' fetched selections
        self.full = None  # scheduler.sparse_full_graphs: the full decode graph's row inputs (full_graph_rows.FullDecodeRows)
        self.near_index: tuple | None = None  # HotWindowStep.near's column index and key shift, kept across steps
        self.rows: list[FarRow] = []
        self.prompt_steps: frozenset[str] = frozenset()  # this step's rows that are prefill (begin_step)
        self._pieces: list[list[tuple[int, int, int]]] = []   # per chunk: (row index, first, end) in the chunk
        self.sparse_rows: list[int] = []
        # sparse decode rows' block reads at attention time: resident (vLLM's pool) and selected far blocks
        # (a graphed row's request finds some in its far-block cache, `row_caches`; the rest are fetched
        # when selected)
        self.counts = {"steps": 0, "far_blocks_read": 0, "blocks_pinned": 0, "sparse_selections": 0,
                       "sparse_resident_reads": 0, "sparse_selected_reads": 0}
        self.overlap = SelectionOverlap(store.device)  # sparse: sampled reuse of a selection by the next step
        self.host = HostTimes()  # where the far path's host time goes, per step and per decode layer call

    # -- requests ---------------------------------------------------------------------------------
    def add_hashes(self, req_id: str, start: int, hashes: Sequence[str]) -> None:
        """Hashes of a request's full blocks start.. (sent by the scheduler side as blocks fill)."""
        self.requests.setdefault(req_id, FarRequest()).add_hashes(req_id, start, hashes)

    def summarize(self, layers: int | range, spans: Sequence, blocks: torch.Tensor) -> None:
        """Sparse policy: key min/max of blocks just saved (`blocks` [n, 2, H, T, D] on the device,
        the spans' blocks in order, of layer `layers`; of consecutive layers `layers` (a range),
        [len(layers), n, 2, H, T, D]), kept per request and block index for the selection."""
        if self.sparse_blocks is not None:
            self.key_summaries.summarize(layers, spans, blocks)

    def finish(self, req_id: str) -> None:
        """Unpin a finished request's far blocks, and the saved blocks of it that never became
        far, and forget it."""
        req = self.requests.pop(req_id, None)
        if req is None:
            return
        if self.reuses_buffers:  # its summary tables and device slot lists serve the next request,
            self.key_summaries.release(req)  # and so do the graphs captured for it
            self.pins.keep_slot_lists(req)
        elif self.graphs is not None:
            self.graphs.forget(req_id)
        if req.cache is not None and self.row_caches is not None:  # emptied for the next request (graphs bake the set)
            self.row_caches.give_back(req.cache)
        shared = set(req.hashes).intersection  # blocks another running request may still read as far
        self.pins.release(req, shared(h for other in self.requests.values() for h in other.hashes[other.num_pinned():]))

    # -- steps ------------------------------------------------------------------------------------
    def begin_step(self, rows: Sequence[tuple[str, int, int]], prompt_steps: Collection[str] = (),
                   far_floors: Mapping[str, int] | None = None) -> list[FarRow]:
        """rows: (req_id, tokens before the step, tokens in the step) in the step's token order;
        prompt_steps: the requests whose step lies within their prompt (exact even when one token long);
        far_floors: requests whose far part reaches further (`step_rows`).
        Pins what became far, lays out the streamed chunks (far_step) and starts the first layers' copies."""
        started = time.perf_counter()
        rows = step_rows(rows, self.window_tokens, self.block_tokens, far_floors)
        for row in (r for r in rows if r.num_far_blocks):
            req = self.requests.get(row.req_id)
            if req is None:
                raise RuntimeError(f"request {row.req_id}: {row.num_far_blocks} far blocks needed but no block hashes were sent")
            self.counts["blocks_pinned"] += self.pins.pin(row.req_id, req, row.num_far_blocks) * self.store.num_layers
        self.rows = rows
        self.graphed.reset()
        self.prompt_steps = frozenset(prompt_steps)
        is_sparse = [self.sparse_blocks is not None and r.q_end - r.q_start == 1 and r.req_id not in self.prompt_steps
                     and self.key_summaries.is_selectable(r) for r in rows]  # fmt: skip
        layout = lay_out_step(rows, is_sparse, self.pool.region_blocks)
        self.sparse_rows, self._offsets, self._pieces = layout.sparse_rows, layout.offsets, layout.pieces
        self.eager.plan(rows, layout)
        self.counts["steps"] += 1
        if layout.num_streamed:
            self.streamer.run(through_layer=self.streamer.lookahead_layers - 1)
        self.host.began(started)
        return rows

    def prefetch(self, layer: int) -> None:
        """Before layer `layer` computes: keep layers up to layer + lookahead copying."""
        if self._pieces:
            self.streamer.run(through_layer=layer + self.streamer.lookahead_layers)

    def attend(self, layer: int, q: torch.Tensor, scale: float, dense=None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Attention of the step's queries q [num_tokens, H, D] over their far blocks of `layer`:
        float32 (out [num_tokens, H, D], lse [num_tokens, H]), lse -inf for rows without far
        blocks; None when no row of this step has any. `dense`: as in `attend_parts`."""
        parts = self.attend_parts(layer, q, scale, dense)
        return None if parts is None else assemble_rows(self.rows, parts, q.shape, q.device)

    def near_out_buffer(self, layer: int, num_tokens: int, scale: float) -> torch.Tensor | None:
        """Where the near part of `layer` may be written ([num_tokens, H, D]): the static input of the
        layer's kept graph when the graphs serve every row of the step, so `attend_into` copies
        nothing in; None otherwise (the caller allocates)."""
        return self.graphed.near_out_buffer(layer, num_tokens, scale)

    def attend_whole(self, output: torch.Tensor, layer: int, q: torch.Tensor, scale: float, window,
                     near_tables, check=None) -> bool:
        """output [n, H, D] = the step's attention of q [n, H, D] at `layer`, window and far parts by one
        graph, when the graphs serve every row of the step and every row's window is at most
        window_tokens + block_tokens keys; False otherwise (the caller runs the window part and
        `attend_into`). window: the backend's FlashAttention over vLLM's pool (`SparseStepGraphs.
        attend_whole`); near_tables: the step's (block table, key counts, longest key count) past
        the far blocks (`HotWindowStep.near`), read once per step. check(): called only when this
        returns True, None or the window part computed the split way (out, lse), against which
        the graph's output is compared through the split graph too and the largest difference
        kept (`whole_check_max_abs`), to verify a run."""
        return self.graphed.attend_whole(output, layer, q, scale, window, near_tables, check)

    def attend_into(self, output: torch.Tensor, layer: int, q: torch.Tensor, near_out: torch.Tensor,
                    near_lse: torch.Tensor, scale: float, dense=None) -> None:
        """output [n, H, D] = the step's attention of q [n, H, D] at `layer`: the near part (near_out
        [n, H, D], near_lse [n, H]) merged with the far blocks. The step's sparse decode rows that
        the CUDA graphs serve replay the layer's one graph, which merges their far parts with their
        near parts too; the rest go through `attend_parts` and `far_attention.merge_with_near`."""
        started = time.perf_counter()
        captures = self.graphs.counts["graph_captures"] if self.graphs is not None else 0
        graphed = self.graphed.attend_rows(layer, q, near_out, near_lse, output.dtype, scale)
        served = graphed[0].indices if graphed is not None else []  # rows the step's graph served, in its order
        if len(served) < q.shape[0]:  # rows left (graphed rows are decoding rows: one query each)
            parts = self.attend_parts(layer, q, scale, dense, skip=set(served))
            if parts:
                merge_with_near(output, near_out, near_lse, self.rows, parts)
            else:
                output.copy_(near_out)
        if graphed is not None:  # after the rest: merge_with_near wrote every row
            plan, replayed = graphed
            self.graphed.write_rows(output, plan, replayed[0])
        self.host.note_layer(started, not self._pieces and (self.graphs is None
                                                            or self.graphs.counts["graph_captures"] == captures))

    def attend_parts(self, layer: int, q: torch.Tensor, scale: float, dense=None,
                     skip=()) -> dict[int, list[tuple[torch.Tensor, torch.Tensor]]] | None:
        """The unmerged form of `attend`: per row index (into `self.rows`) with far blocks, its
        partial results (out [rows, H, D], lse [rows, H]), one per staging chunk or fetch; None when
        no row of this step has any. A caller merging them with its own part saves a merge pass.

        dense: the kernel for rows of many queries (prefill chunks), as `far_attention.chunk_partial`
        takes it. skip: sparse rows served elsewhere (`attend_into`'s graphs)."""
        if not self._pieces and not self.sparse_rows:
            return None
        return self.eager.attend_parts(layer, q, scale, dense, skip, self._pieces, self._offsets)

    def count_selections(self, num_selected: int, num_resident: int, num_rows: int) -> None:
        """Sparse decode rows' selections of one layer (graphed or eager): their selected far blocks,
        their windows' blocks resident."""
        counts = self.counts
        counts["far_blocks_read"] += num_selected
        counts["sparse_selected_reads"] += num_selected
        counts["sparse_resident_reads"] += num_resident
        counts["sparse_selections"] += num_rows

    def cache_stats(self, prefetched: int = 0) -> dict:
        """The far-block caches' counters (far_stats.cache_stats: one device sync; zeros without caches)
        and the H2D bytes their copies moved (the store's `bytes_moved` adds them to the transfer
        engine's). prefetched: the blocks the next-step prefetch copied into the caches. Reads only."""
        return cache_stats(self.row_caches, self.store.cpu.slot_bytes, prefetched, list(self._retired_cache_counts))

    def end_step(self) -> None:
        if self.rows:
            self.host.end_step()
        self.rows, self._pieces, self.sparse_rows = [], [], []
        self.graphed.reset()

    def make_staging(self, staging_bytes: int) -> FarStaging | None:
        """A run-time resize's device buffers carved from `staging_bytes` (`far_staging.split_staging`: the
        main ring and, under the sparse policy, the eager regions and the graphed rows' far-block caches),
        allocated, not yet used; None when the staging already is that size. RuntimeError under the full
        decode graph (its rows' buffers and vLLM's captured graphs hold the caches); ConfigError when too small
        (the main ring less than one region of its start-up size: `far_staging.ChunkGrid`)."""
        if staging_bytes == self.staging_bytes:
            return None
        if self.full is not None:
            raise RuntimeError("the sparse step inside vLLM's full decode graph holds the far-block caches of its "
                               "staging: the staging keeps its start-up size (scheduler.sparse_full_graphs)")
        return split_staging(self.store, self.max_rows, staging_bytes, self.grid, self.own_pool)

    def use_staging(self, staging: FarStaging, staging_bytes: int) -> None:
        """Read the far blocks through `staging` (carved from `staging_bytes`: at start-up, or between steps
        from `make_staging`) from the next step on, the old buffers dropped. Chunks the old ring copied ahead
        are copied again; under the sparse policy every request's far-block cache set is emptied (its next
        selections copy what they read: the same blocks and results) and the step graphs, which baked the
        old buffers, are captured again. Counters carry on across the change."""
        if staging.warning:
            logger.warning("tierkv hot window: %s", staging.warning)
        old_graphs = self.graphs
        self.pool = staging.pool
        self.streamer = self._streamer_over(staging.pool, self.streamer)
        self.sparse_streamer = self._streamer_over(staging.sparse_pool, self.sparse_streamer)
        if self.row_caches is not None:  # its hits, misses and stalled rows go on counting in cache_stats
            self._retired_cache_counts = tuple(a + b for a, b in zip(self._retired_cache_counts,
                                                                     self.row_caches.counters.tolist()))
        for req in self.requests.values():
            req.cache = None
        self.row_caches = staging.row_caches
        self.graphs = SparseStepGraphs(self.source, self.row_caches) if staging.is_graphed else None
        if self.graphs is not None and old_graphs is not None:
            self.graphs.carry_on_from(old_graphs)
        self.staging_bytes = staging_bytes
        self.segments = staging.segments  # the old buffers' allocator pool goes last, after them

    def _streamer_over(self, pool, previous: LookaheadStreamer | None) -> LookaheadStreamer | None:
        """A lookahead streamer copying chunks through `pool` (None without one), counting on from `previous`."""
        if pool is None:
            return None
        streamer = LookaheadStreamer(self.store.io, pool, self.store.lookahead, recorder=self.recorder)
        if previous is not None:
            streamer.carry_counts(previous)
        return streamer

    def stats(self) -> dict:
        """Counters; `wait_s` is the time compute waited for far chunks (the part of the far
        copies that did not hide behind compute), per layer in `prefetch["layers"]["wait_s"]`."""
        return far_kv_stats(self)

    @torch.inference_mode()  # the device buffers, made under vLLM's inference mode, are reset in place
    def close(self) -> None:
        for req_id in list(self.requests):
            self.finish(req_id)
