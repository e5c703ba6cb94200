"""The sparse decode step of many rows at once, device work only: select, fetch, attend the far part.

Primitives: `sparse_rows_body`, `packed_buffers`, `copy_sources_of`.

Per layer, for every decoding row (one request each; captured in a CUDA graph by
`tierkv.sparse.step_graphs`, run eagerly by the transformers engine's predictor `cache` and inside
vLLM's full decode graph by `tierkv.integrations.vllm.full_graph_rows`):

    bound = [kmax | kmin] . [max(q,0) | min(q,0)] over each row's summary table, blocks at or past
      its far count masked, into one score matrix (one kernel, tierkv.sparse.kernels.block_bounds_rows)
    ids = sorted top-k of each row of the scores (one top-k, one sort)
    slots, miss = the requests' far-block cache sets (row_caches.RowCaches.place_rows, one kernel)
    the missing blocks' CPU-tier slots, each row's from its own slot list (one kernel,
      tierkv.cache_kernels.copy_sources)
    copy kernel: CPU tier[pinned slots[ids]] -> cache[slots] for the misses only (a quantized tier:
      codes and scales, then one dequantization)
    (out, lse) = each row's query over its cache slots (tierkv.attention.paged_rows_attention)
"""
from __future__ import annotations

import torch

from tierkv.attention import paged_rows_attention
from tierkv.block_io import dequantize_into
from tierkv.optional_kernel import OptionalKernel
from tierkv.sparse.far_source import FarSource, SparseRow
from tierkv.sparse.summaries import masked_bounds_rows, top_blocks
from tierkv.sparse.row_caches import RowCaches

_SOURCES = OptionalKernel("copy sources of several rows (tierkv.cache_kernels.copy_sources)")


def packed_buffers(source: FarSource, device, rows: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """With a quantized CPU tier: device buffers for `rows` selections' codes (uint8 [rows * k, 2, H,
    T, D]), scales (float32 [rows * k, 2, H]) and their order (int64 arange(rows * k)); None for an
    unquantized tier."""
    cpu, k = source.cpu, source.sparse_blocks * rows
    if cpu.quant_format is None:
        return None
    return (torch.empty((k, *cpu.slab.shape[1:]), dtype=cpu.slab.dtype, device=device),
            torch.empty((k, *cpu.scales.shape[1:]), dtype=cpu.scales.dtype, device=device),
            torch.arange(k, device=device))


def _rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """[m, ...] of m per-row tensors (no copy for one row)."""
    return tensors[0].unsqueeze(0) if len(tensors) == 1 else torch.stack(tensors)


def copy_sources_of(reqs: list[SparseRow], layer: int, ids: torch.Tensor, miss: torch.Tensor,
                  lists: torch.Tensor | None) -> torch.Tensor:
    """int64 [m, k]: the CPU-tier slot of each selected block the copy kernel fetches (row r's
    pinned slot list of `layer` at ids[r]) where miss, -1 where its cache holds it. One launch on
    CUDA (`tierkv.cache_kernels.copy_sources`, lists: the slot lists' addresses, made here when not
    given); row by row elsewhere."""
    if ids.is_cuda:
        def launch() -> torch.Tensor:
            from tierkv.cache_kernels import copy_sources

            at = lists if lists is not None else torch.tensor(
                [req.pinned_slots_dev[layer].data_ptr() for req in reqs], dtype=torch.int64, device=ids.device)
            return copy_sources(at, ids, miss)

        ok, src = _SOURCES.run(launch, on_cuda=True)
        if ok:
            return src
    ids = ids.clamp(min=0)  # a negative id (no block) is never a miss
    return torch.where(miss, _rows([req.pinned_slots_dev[layer].index_select(0, ids[r]) for r, req in enumerate(reqs)]),
                       -1)


def sparse_rows_body(source: FarSource, reqs: list[SparseRow], layer: int, q: torch.Tensor, num_far: torch.Tensor, caches: RowCaches,
                     scale: float, packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                     sets: torch.Tensor | None = None, tables: torch.Tensor | None = None,
                     lists: torch.Tensor | None = None, prefetch=None,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The far parts of `layer` for sparse decode rows, one per request of `reqs`, device work only
    (their far blocks in `source`):
    (out [m, H, D], lse [m, H], ids [m, k]), float32. q [m, H, D]; num_far: int64 [m], their far
    blocks (all summarized, at least one; a row with fewer than k reads all of them, its other ids
    -1); caches: the engine's far-block caches, each request holding
    a set of them (req.cache): only the selected blocks a set does not hold cross PCIe. packed: a
    quantized CPU tier's buffers for at least m selections (`packed_buffers`): the missing blocks'
    codes and scales are copied there and dequantized into the caches (half the PCIe bytes at fp8 or
    int8). sets: the requests' cache set indices, int64 [m] on the device; tables, lists: the
    addresses of their summary tables and pinned slot lists of `layer`, int64 [m] on the device
    (all three a graph's static inputs; made here when not given). prefetch: the full decode graph's
    `prefetch_margin.MarginPrefetch`, which places and copies the blocks ranked just below the selection
    once the attention is enqueued.

    For all rows at once: the key bounds into one score matrix (one kernel on CUDA,
    `tierkv.sparse.masked_bounds_rows`; row by row elsewhere), the top-k and its sort into block
    order, the placement in the cache sets, the copy of every missing block (one kernel; a quantized
    tier's dequantization, one more) and the attention (`paged_rows_attention`); the missing
    blocks' CPU-tier slots, each row's from its own slot list (one kernel on CUDA)."""
    k, m = source.sparse_blocks, len(reqs)
    layer_tables = [req.far_summaries.tables[layer] for req in reqs]
    widths = [t.shape[0] for t in layer_tables]
    # at least k columns: tables shorter than a selection (max_model_len below the sparse budget) still give
    # [m, k] ids, the columns past each table -inf, so -1 (no block) below
    scores = torch.empty((m, max([*widths, k])), dtype=torch.float32, device=q.device)
    if not masked_bounds_rows(layer_tables, q, num_far, scores, tables, source.bound_weight):
        if min(widths) < scores.shape[1]:  # tables of different sizes (no max_model_len): the rest never selected
            scores.fill_(float("-inf"))
        for r, req in enumerate(reqs):
            req.far_summaries.masked_bounds(layer, q[r], num_far[r], out=scores[r, : widths[r]])
    # a row with fewer far blocks than k selects them all, and -1 (no block) for the rest; with the
    # prefetch one ranking gives the selection and the blocks ranked below it
    ranked = prefetch.rank(scores) if prefetch is not None else None
    ids = top_blocks(scores, k) if ranked is None else torch.sort(ranked[:, :k], dim=1).values
    ids = torch.where(ids < num_far.unsqueeze(1), ids, -1)
    if sets is None:
        sets = torch.tensor([req.cache.index for req in reqs], dtype=torch.int64, device=q.device)
    slots, miss = caches.place_rows([req.cache for req in reqs], sets, layer, ids)
    src = copy_sources_of(reqs, layer, ids, miss, lists)  # -1: held, not copied
    cpu, engine = source.cpu, source.engine
    if cpu.quant_format is None:
        engine.gather_h2d_inline(cpu.slab, src.view(-1), caches.blocks, slots.view(-1))
    else:
        codes, scales, order = packed
        order = order[: m * k]
        engine.gather_h2d_inline(cpu.slab, src.view(-1), codes, order)
        engine.gather_h2d_inline(cpu.scales, src.view(-1), scales, order)
        # the held blocks' stale codes are skipped (slot -1)
        dequantize_into(codes[: m * k], scales[: m * k], cpu.quant_format, caches.blocks,
                        torch.where(miss, slots, -1).view(-1))
    fills = torch.where(ids >= 0, source.block_tokens, 0)  # no block: no token read
    out, lse = paged_rows_attention(q, caches.blocks, slots, ids.clamp(min=0) * source.block_tokens, fills, scale=scale)
    if ranked is not None:
        prefetch.after_selection(reqs, layer, ranked, num_far, sets, lists)
    return out, lse, ids
