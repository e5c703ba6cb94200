"""The hot window's eager far attention, the parts the CUDA graphs do not serve: one partial
attention per staging chunk or sparse fetch, then per row assembled or LSE-merged with the near part.

Primitives: `chunk_partial`, `assemble_rows`, `merge_with_near`, `profiled`. No vLLM import.

    parts: {row index: [(out [rows, H, D], lse [rows, H]) float32, one per chunk or fetch]}
    rows:  the step's `FarRow`s; row i's queries are q[rows[i].q_start : rows[i].q_end]
"""
from __future__ import annotations

import contextlib
from typing import Sequence

import torch
from torch.profiler import record_function

from tierkv.attention import merge_partials, paged_partial_attention
from tierkv.attention.flash import MIN_QUERIES, can_use_flash, flash_partial_attention, gather_blocks
from tierkv.integrations.vllm.far_step import FarRow

Partial = tuple[torch.Tensor, torch.Tensor]  # (out [rows, H, D], lse [rows, H]), float32


def profiled(name: str):
    """A named range in a running torch profiler's trace, nothing otherwise: entering a
    `record_function` costs 30-60 us of host time even with no profiler running."""
    return record_function(name) if torch._C._autograd._profiler_enabled() else contextlib.nullcontext()


def chunk_partial(q_row: torch.Tensor, staging: torch.Tensor, chunk, first: int, end: int, scale: float,
                  dense=None) -> Partial:
    """A row's queries q_row [m, H, D] over its blocks [first, end) of a staging chunk (`chunk.slots`
    index `staging`, the ring's [num_slots, 2, Hkv, T, D] on the device).

    dense: `(q [m, H, D], k, v [n, Hkv, D], scale) -> (out, lse)` without a mask, for rows of at
    least `MIN_QUERIES` queries (prefill chunks), over the blocks gathered into contiguous K and V;
    the vLLM backend passes vLLM's own FlashAttention. Without it such rows use PyTorch's fused
    kernels on CUDA and the paged reference elsewhere."""
    slots = chunk.slots[first:end]
    if dense is not None and q_row.shape[0] >= MIN_QUERIES:
        k, v = gather_blocks(staging, slots)
        return dense(q_row, k, v, scale)
    if can_use_flash(q_row):
        k, v = gather_blocks(staging, slots)
        return flash_partial_attention(q_row, k, v, scale=scale, causal=False)
    return paged_partial_attention(q_row, staging, slots, chunk.start_pos[first:end], chunk.num_tokens[first:end],
                                   scale=scale)  # fmt: skip


def assemble_rows(rows: Sequence[FarRow], parts: dict[int, list[Partial]], shape: torch.Size,
                  device: torch.device) -> Partial:
    """Each row's parts merged into one (out [n, H, D], lse [n, H]) over the step's `shape` [n, H, D]:
    float32, lse -inf (and out 0) for rows without parts."""
    out = torch.zeros(shape, dtype=torch.float32, device=device)
    lse = torch.full(shape[:2], float("-inf"), dtype=torch.float32, device=device)
    for i, row_parts in parts.items():
        row = rows[i]
        o, l = row_parts[0] if len(row_parts) == 1 else merge_partials(row_parts)
        out[row.q_start : row.q_end] = o
        lse[row.q_start : row.q_end] = l
    return out, lse


def merge_with_near(output: torch.Tensor, near_out: torch.Tensor, near_lse: torch.Tensor, rows: Sequence[FarRow],
                    parts: dict[int, list[Partial]]) -> None:
    """output [n, H, D] (any dtype) = the LSE merge of the near part (near_out [n, H, D], near_lse
    [n, H]) with the far parts. A step of one row (a prefill chunk) merges near and every far chunk
    in one pass; other steps assemble the far rows first."""
    n = near_out.shape[0]
    if len(parts) == 1:
        (i, row_parts), = parts.items()
        if (rows[i].q_start, rows[i].q_end) == (0, n):
            output.copy_(merge_partials([(near_out, near_lse), *row_parts])[0])
            return
    output.copy_(merge_partials([(near_out, near_lse), assemble_rows(rows, parts, near_out.shape, near_out.device)])[0])
