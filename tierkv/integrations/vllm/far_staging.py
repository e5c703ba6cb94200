"""How the hot window's far path divides `scheduler.staging_bytes` between its device buffers.

Primitives: `FarStaging`, `ChunkGrid`, `split_staging`, `carve_staging`, `main_ring`. No vLLM import.

    staging_bytes = main ring (streamed chunks, copied layers ahead; at least lookahead + 1 regions)
                  + eager sparse regions: 2 x min(k, staging blocks / 4) blocks          (sparse only)
                  + the graphed rows' far-block caches (`RowCaches`)                     (sparse + graphs)
                  + a quantized CPU tier's codes and scales for those rows' selections   (quantized tier)

k = sparse_token_budget / block_tokens. Eager sparse fetches get staging of their own, so they
never overwrite the streamed chunks of prefill rows in the same step. The graphed rows' requests
each hold a far-block cache set (one selection per layer, or one for all layers when the staging
is short: `row_caches.cache_rows` decides, and says why in `warning`), as many rows as fit in
three quarters of the staging with the eager regions.

The regions' sizes are fixed at start-up (`ChunkGrid`): a run-time resize re-makes the staging with fewer
regions of those sizes, never smaller ones, so the far KV is attended in the same chunks and their partial
results merged in the same order whatever the staging. A smaller ring copies less ahead; it changes no
result (a ring cut into smaller chunks would round differently, and flip a near tie of the greedy choice).
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

from tierkv.config import ConfigError
from tierkv.units import format_bytes
from tierkv.sparse.far_source import FarSource
from tierkv.sparse.row_caches import RowCaches, cache_rows, least_set_bytes
from tierkv.storage.gpu import GpuBlockPool, ResidencyPlan, own_segments


@dataclass(frozen=True)
class FarStaging:
    """The far path's device buffers, carved from scheduler.staging_bytes."""

    sparse_blocks: int | None         # k, the far blocks a sparse decoding row attends; None: exact policy
    source: FarSource | None          # what the sparse step reads of the far blocks (sparse only)
    is_graphed: bool                  # the sparse step's CUDA graphs serve decoding rows
    row_caches: RowCaches | None      # the graphed rows' far-block caches
    pool: GpuBlockPool                # the main ring the lookahead streamer copies chunks through
    sparse_pool: GpuBlockPool | None  # the eager sparse fetches' two regions
    warning: str | None               # why the caches keep less than one selection per layer, if they do
    grid: "ChunkGrid"                 # the start-up staging's shape, which every run-time resize keeps
    segments: Any = None              # the allocator pool the buffers alone live in (`own_segments`): kept with them


@dataclass(frozen=True)
class ChunkGrid:
    """What a run-time resize keeps of the start-up staging (`FarStaging.grid`): the regions' sizes in blocks,
    and the rows the step graphs serve (each with a cache set, at least one that keeps nothing). A row moved
    between the graphs and the eager path would be attended by another kernel."""

    ring_region_blocks: int   # the main ring's: a streamed chunk
    eager_region_blocks: int  # the eager sparse regions': a fetch of selected blocks (0: exact policy)
    graph_rows: int = 0       # decoding rows the step graphs serve with far-block caches
    row_set_bytes: int = 0    # one such row's least cache set (one selection for all layers) and codes

    def least_staging_bytes(self, block_bytes: int) -> int:
        """The least staging a run-time resize can re-make (blocks of `block_bytes`): one ring region beside
        the two eager regions and the graphed rows' least cache sets."""
        return (self.ring_region_blocks + 2 * self.eager_region_blocks) * block_bytes + self.graph_rows * self.row_set_bytes


def main_ring(store, staging_bytes: int, region_blocks: int | None = None) -> GpuBlockPool:
    """The ring the lookahead streamer copies chunks through: `staging_bytes` in lookahead + 1 regions, at
    least 2 (all of the exact policy's staging; a run-time resize re-makes it, `FarKV.use_staging`). With
    `region_blocks` (the start-up grid's) the regions keep that size and there are as many as fit, at most
    lookahead + 1 (one region: each chunk's copy waits for the last chunk's attention); ConfigError when
    not one fits."""
    num_regions = max(2, store.lookahead + 1)
    if region_blocks is not None:
        region_bytes = region_blocks * store.layout.num_bytes
        if staging_bytes < region_bytes:
            raise ConfigError("scheduler.staging_bytes", staging_bytes,
                              f"leaves the main staging ring less than one region of its start-up size ({region_blocks} "
                              f"blocks, {format_bytes(region_bytes)}): the far KV is read in chunks of that size "
                              "whatever the budget, so that a resize changes no result")
        num_regions = min(num_regions, staging_bytes // region_bytes)
        staging_bytes = num_regions * region_bytes
    return GpuBlockPool(store.layout, store.num_layers, ResidencyPlan(0, 0), staging_bytes, num_regions, store.device)


@dataclass(frozen=True)
class StagingShares:
    """The byte sizes `split_staging` carves scheduler.staging_bytes into (no device memory)."""

    eager_bytes: int        # the eager sparse fetches' two regions (0: exact policy)
    graph_rows: int         # decoding rows the graphs serve with far-block caches
    per_layer: bool         # whether those caches keep selections per layer
    warning: str | None     # why they keep less, if they do
    cache_bytes: int        # the caches' blocks
    packed_bytes: int       # a quantized CPU tier's codes and scales for the rows' selections
    ring_bytes: int         # the rest: the main ring the lookahead streamer copies chunks through


def carve_staging(staging_bytes: int, block_bytes: int, num_layers: int, sparse_blocks: int | None,
                  graphed_rows: int, selections: int, slot_bytes: int, grid: ChunkGrid | None = None) -> StagingShares:
    """The shares of `staging_bytes` for blocks of `block_bytes` (one layer's): sparse_blocks k (None: the
    exact policy, all of it the ring); graphed_rows the rows the step graphs serve at most (0: no graphs);
    slot_bytes a quantized CPU tier's block (0: the tier stores the KV dtype). The one arithmetic of the
    engine at start and of `tierkv plan --backend vllm`. grid: a run-time resize's (the start-up regions'
    sizes): the eager regions keep theirs, and the caches leave the main ring one region."""
    if sparse_blocks is None:
        return StagingShares(0, 0, True, None, 0, 0, staging_bytes)
    k = sparse_blocks
    eager_region = min(k, max(1, staging_bytes // block_bytes // 4)) if grid is None else grid.eager_region_blocks
    eager = 2 * eager_region * block_bytes
    rows, per_layer, warning = 0, True, None
    if grid is not None:  # the start-up graphed rows, no more (nor fewer: `least_staging_bytes`)
        graphed_rows = min(graphed_rows, grid.graph_rows)
    if graphed_rows:
        ring_bytes = 0 if grid is None else grid.ring_region_blocks * block_bytes
        rows, per_layer, warning = cache_rows(graphed_rows, selections, staging_bytes, eager, num_layers, k,
                                              block_bytes, k * slot_bytes, ring_bytes)
    cache_bytes = rows * RowCaches.bytes_per_set(num_layers, k, block_bytes, per_layer, max(1, selections))
    packed = rows * k * slot_bytes
    return StagingShares(eager, rows, per_layer, warning, cache_bytes, packed, staging_bytes - eager - packed - cache_bytes)


def split_staging(store, max_rows: int, staging_bytes: int | None = None, grid: ChunkGrid | None = None,
                  own_pool: bool = True) -> FarStaging:
    """The buffers of a FarKV over `store` (a `VllmKVStore`: its config, layout, CPU tier, device).

    max_rows: the engine's decoding rows per step at most (vLLM's max_num_seqs); the graphs serve
    at most this many and at most scheduler.sparse_graph_rows. staging_bytes: what to carve them from
    (default scheduler.staging_bytes; a run-time resize passes the new budget's staging,
    `resize_plan.staging_for_budget`, and the start-up staging's `grid`, whose region sizes it keeps).
    own_pool: allocate them in an allocator pool of their own (`own_segments`; False under vLLM's sleep mode,
    whose CuMem pool they then join).
    """
    scheduler, layout = store.config.scheduler, store.layout
    staging_bytes = scheduler.staging_bytes if staging_bytes is None else staging_bytes
    block_tokens = layout.block_tokens
    if scheduler.policy == "sparse" and scheduler.sparse_selection != "per_layer":
        raise ConfigError("scheduler.sparse_selection", scheduler.sparse_selection,
                          "under vLLM only 'per_layer' is built (per_kv_head needs far blocks read in place: the "
                          "transformers engine on a CPU device)")
    sparse_blocks = max(1, scheduler.sparse_token_budget // block_tokens) if scheduler.policy == "sparse" else None
    source = (FarSource(store.cpu, store.io.engine, store.device, store.num_layers, sparse_blocks, block_tokens,
                        scheduler.sparse_bound_weight)
              if sparse_blocks is not None else None)  # fmt: skip
    is_graphed = source is not None and scheduler.sparse_cuda_graphs and source.graphs_usable()
    slot_bytes = store.cpu.slot_bytes if store.cpu.quant_format is not None else 0
    shares = carve_staging(staging_bytes, layout.num_bytes, store.num_layers, sparse_blocks,
                           max(1, min(max_rows, scheduler.sparse_graph_rows)) if is_graphed else 0,
                           scheduler.sparse_cache_selections, slot_bytes, grid)
    with own_segments(store.device) if own_pool else nullcontext() as segments:  # a resize gives back every byte
        row_caches = (RowCaches(shares.graph_rows, store.num_layers, sparse_blocks, layout.shape, layout.dtype,
                                store.device, shares.per_layer, max(1, scheduler.sparse_cache_selections))
                      if shares.graph_rows else None)  # fmt: skip
        pool = main_ring(store, shares.ring_bytes, grid.ring_region_blocks if grid is not None else None)
        sparse_pool = (GpuBlockPool(layout, store.num_layers, ResidencyPlan(0, 0), shares.eager_bytes, 2, store.device)
                       if shares.eager_bytes else None)  # fmt: skip
    if grid is None:  # start-up: the shape every resize keeps
        row_set = (least_set_bytes(store.num_layers, sparse_blocks, layout.num_bytes, sparse_blocks * slot_bytes)
                   if sparse_blocks is not None else 0)  # fmt: skip
        grid = ChunkGrid(pool.region_blocks, sparse_pool.region_blocks if sparse_pool is not None else 0,
                         shares.graph_rows, row_set)
    return FarStaging(sparse_blocks, source, is_graphed, row_caches, pool, sparse_pool, shares.warning, grid, segments)
