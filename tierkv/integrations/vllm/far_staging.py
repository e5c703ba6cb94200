"""How the hot window's far path divides `scheduler.staging_bytes` between its device buffers.

Primitives: `FarStaging`, `split_staging`, `main_ring`. No vLLM import.

    staging_bytes = main ring (streamed chunks, copied layers ahead; at least lookahead + 1 regions)
                  + eager sparse regions: 2 x min(k, staging blocks / 4) blocks          (sparse only)
                  + the graphed rows' far-block caches (`RowCaches`)                     (sparse + graphs)
                  + a quantized CPU tier's codes and scales for those rows' selections   (quantized tier)

k = sparse_token_budget / block_tokens. Eager sparse fetches get staging of their own, so they
never overwrite the streamed chunks of prefill rows in the same step. The graphed rows' requests
each hold a far-block cache set (one selection per layer, or one for all layers when the staging
is short: `row_caches.cache_rows` decides, and says why in `warning`), as many rows as fit in
three quarters of the staging with the eager regions.
"""
from __future__ import annotations

from dataclasses import dataclass

from tierkv.config import ConfigError
from tierkv.sparse.far_source import FarSource
from tierkv.sparse.row_caches import RowCaches, cache_rows
from tierkv.storage.gpu import GpuBlockPool, ResidencyPlan


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


def main_ring(store, staging_bytes: int) -> GpuBlockPool:
    """The ring the lookahead streamer copies chunks through: `staging_bytes` in at least lookahead + 1
    regions (all of the exact policy's staging; a run-time resize re-makes it, `FarKV.use_staging`)."""
    return GpuBlockPool(store.layout, store.num_layers, ResidencyPlan(0, 0), staging_bytes, max(2, store.lookahead + 1),
                        store.device)


def split_staging(store, max_rows: int, staging_bytes: int | None = None) -> FarStaging:
    """The buffers of a FarKV over `store` (a `VllmKVStore`: its config, layout, CPU tier, device).

    max_rows: the engine's decoding rows per step at most (vLLM's max_num_seqs); the graphs serve
    at most this many and at most scheduler.sparse_graph_rows. staging_bytes: what to carve them from
    (default scheduler.staging_bytes; a run-time resize passes its share of the new budget,
    `resize_plan.staging_for_budget`).
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
    sparse_bytes = graph_rows = 0
    per_layer, warning = True, None
    if sparse_blocks is not None:
        k = sparse_blocks
        region = min(k, max(1, staging_bytes // layout.num_bytes // 4))
        sparse_bytes = 2 * region * layout.num_bytes
        if is_graphed:
            codes = k * store.cpu.slot_bytes if store.cpu.quant_format is not None else 0
            graph_rows, per_layer, warning = cache_rows(
                max(1, min(max_rows, scheduler.sparse_graph_rows)), scheduler.sparse_cache_selections,
                staging_bytes, sparse_bytes, store.num_layers, k, layout.num_bytes, codes)  # fmt: skip
    row_caches = (RowCaches(graph_rows, store.num_layers, sparse_blocks, layout.shape, layout.dtype, store.device,
                            per_layer, max(1, scheduler.sparse_cache_selections))
                  if graph_rows else None)  # fmt: skip
    packed_bytes = 0
    if row_caches is not None and store.cpu.quant_format is not None:
        packed_bytes = graph_rows * sparse_blocks * store.cpu.slot_bytes
    cache_bytes = row_caches.num_bytes if row_caches is not None else 0
    pool = main_ring(store, staging_bytes - sparse_bytes - packed_bytes - cache_bytes)
    sparse_pool = (GpuBlockPool(layout, store.num_layers, ResidencyPlan(0, 0), sparse_bytes, 2, store.device)
                   if sparse_bytes else None)  # fmt: skip
    return FarStaging(sparse_blocks, source, is_graphed, row_caches, pool, sparse_pool, warning)
