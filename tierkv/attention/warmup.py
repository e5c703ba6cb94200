"""Compiling the far path's Triton kernels before the first request: every variant a step can reach.

Primitives:
  - ``far_query_counts``: one query count per tile shape (BLOCK_M) a launch can pick.
  - ``launch_far_variants``: one far-path launch per variant, on tiny tensors of the engine's shapes.
  - ``warm_far_kernels``: the same on a CUDA device, timed and logged; a no-op elsewhere.

A far-path launch's compiled signature is fixed by the engine (heads, head dim, block tokens,
dtype) except for its tile shape: ``triton_paged.tile_rows`` picks BLOCK_M from the query count
(rows of 1 to 63 queries read far blocks through these kernels; vLLM's FlashAttention takes
longer ones). The split merge reads a fixed tile of splits, so any split count is one variant;
step-varying ints and the block lists' addresses are not specialized (``triton_kernels``).

    partial_attention_kernel   one launch per BLOCK_M of far_query_counts (paged, no mask)
                               + one of each query over blocks of its own (rows=True: sparse decode)
    merge_splits_kernel        one launch
"""
from __future__ import annotations

import logging
import time

import torch

from tierkv.attention.flash import MIN_QUERIES
from tierkv.blocks import BlockLayout

logger = logging.getLogger(__name__)


def far_query_counts(group: int) -> list[int]:
    """The smallest query count of each tile shape that rows of 1..MIN_QUERIES queries can pick, for
    `group` query heads per kv head. Imports triton."""
    from tierkv.attention.triton_paged import tile_rows
    first: dict[int, int] = {}
    for num_q in range(1, MIN_QUERIES + 1):
        first.setdefault(tile_rows(num_q, group), num_q)
    return sorted(first.values())


def launch_far_variants(num_heads: int, layout: BlockLayout, device: torch.device, rows: bool = False) -> int:
    """Launch each far-path kernel variant once on `device` (zeros in the engine's shapes and dtype,
    block lists int64 as the staging chunks hold them); returns the number of launches. rows: also
    `paged_rows_attention` (the sparse policy's decoding rows). Imports triton; no host sync."""
    from tierkv.attention import triton_paged
    T = layout.block_tokens
    pool = torch.zeros((2, *layout.shape), dtype=layout.dtype, device=device)  # [2 slots, 2, Hkv, T, D]
    slots = torch.arange(2, dtype=torch.int64, device=device)
    starts, fills = slots * T, torch.full((2,), T, dtype=torch.int64, device=device)
    scale = layout.head_dim ** -0.5
    query_counts = far_query_counts(num_heads // layout.num_kv_heads)
    for num_q in query_counts:
        q = torch.zeros(num_q, num_heads, layout.head_dim, dtype=layout.dtype, device=device)
        part = triton_paged.paged_partial_attention(q, pool, slots, starts, fills, scale=scale, num_splits=1)
    triton_paged.merge_partials([part, part])
    launches = len(query_counts) + 1
    if rows:
        q = torch.zeros(2, num_heads, layout.head_dim, dtype=layout.dtype, device=device)
        triton_paged.paged_rows_attention(q, pool, slots.expand(2, 2), starts.expand(2, 2), fills.expand(2, 2),
                                          scale=scale, num_splits=1)
        launches += 1
    return launches


def warm_far_kernels(num_heads: int, layout: BlockLayout, device: torch.device | str, rows: bool = False) -> int:
    """Compile the far path's Triton kernels for an engine of `num_heads` query heads (this rank's) over
    blocks of `layout` on `device`, so no request compiles one; returns the launches (0 and no triton
    import off CUDA or without triton). Waits for them once: call it at set-up, never per step."""
    from tierkv.attention import triton_installed
    device = torch.device(device)
    if device.type != "cuda" or not triton_installed():
        return 0
    started = time.perf_counter()
    launches = launch_far_variants(num_heads, layout, device, rows)
    torch.cuda.synchronize(device)
    logger.info("tierkv: far-path Triton kernels compiled before serving: %d launches in %.2f s",
                launches, time.perf_counter() - started)
    return launches
