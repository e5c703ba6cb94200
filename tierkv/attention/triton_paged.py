"""Triton split-K (flash-decoding) partial attention over paged or contiguous KV: the launchers
(tile sizes, grid, the split merge) of the kernels in ``tierkv.attention.triton_kernels``.

Imported lazily by ``tierkv.attention`` when a CUDA tensor arrives. Also runs under
the Triton interpreter (``TRITON_INTERPRET=1`` at import) on CPU tensors.

Primitives:
  - ``paged_partial_attention`` / ``contiguous_partial_attention`` / ``paged_rows_attention``:
    same contract as ``tierkv.attention.reference``; no host sync, so graph-capturable.
  - ``merge_partials``: the LSE merge as one kernel.
  - ``merge_two_into``: the merge of two parts into an existing output, one kernel.

A launch splits the key axis so the grid covers about ``PROGRAMS_PER_SM`` programs per SM, each
split at least ``MIN_TILES_PER_SPLIT`` tiles long; more than one split costs one merge launch.
A contiguous K/V is walked as if it were blocks of ``CONTIG_TILE`` tokens in slots
``0, 1, 2, ...``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton

from tierkv.attention import triton_kernels
from tierkv.attention.contract import (check_contiguous_args, check_merge_two_args, check_paged_args,
                                       check_rows_args, empty_result, stack_parts)

TILE_TOKENS = 64          # keys per inner-loop step (pow2, >= 16 for tl.dot)
CONTIG_TILE = 64          # virtual block size for contiguous K/V
MIN_TILES_PER_SPLIT = 4   # keep each split long enough to amortize its merge
PROGRAMS_PER_SM = 4       # split until the grid covers this many programs per SM
MERGE_TILE = 32           # splits merge_splits_kernel reads at a time (one compiled variant for any count)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter on CPU: small, so tests still exercise several splits
    return torch.cuda.get_device_properties(device).multi_processor_count


def _pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


def _dim_pad(head_dim: int) -> int:
    return max(16, _pow2(head_dim))  # tl.dot needs K >= 16


class _Plan(NamedTuple):
    """Tile sizes and grid of one launch; host arithmetic on shapes only."""

    block_m: int            # rows (query, head) per program, pow2 >= 16
    q_per_tile: int         # queries per program: block_m // group
    bt_pad: int             # block_tokens rounded up to pow2
    blocks_per_tile: int    # blocks walked per inner-loop step
    blocks_per_split: int   # blocks per program along the key axis
    grid: tuple[int, int, int]  # (query tiles, kv heads, splits)


def tile_rows(num_q: int, group: int, row_blocks: bool = False) -> int:
    """BLOCK_M, the (query, head) rows of one program of a launch of num_q queries: a compile-time
    constant, so each value is one compiled variant. row_blocks: each query reads blocks of its
    own, so a program serves one query."""
    min_rows = max(16, _pow2(group))  # tl.dot needs >= 16 rows
    return min_rows if row_blocks else min(max(64, min_rows), max(min_rows, _pow2(num_q * group)))


def _plan(num_q: int, group: int, num_kv_heads: int, block_tokens: int, num_blocks: int,
          device: torch.device, num_splits: int | None, row_blocks: bool = False) -> _Plan:
    block_m = tile_rows(num_q, group, row_blocks)
    q_per_tile = 1 if row_blocks else block_m // group
    bt_pad = _pow2(block_tokens)
    blocks_per_tile = max(1, TILE_TOKENS // bt_pad)
    num_q_tiles = triton.cdiv(num_q, q_per_tile)
    num_tiles = triton.cdiv(num_blocks, blocks_per_tile)
    if num_splits is None:  # fill the GPU, but keep splits long enough to amortize the merge; each query over
        # blocks of its own (row_blocks) splits as one query would, so a row's result does not depend on the rows beside it
        wanted = triton.cdiv(_num_sms(device) * PROGRAMS_PER_SM, (1 if row_blocks else num_q_tiles) * num_kv_heads)
        num_splits = min(wanted, num_tiles // MIN_TILES_PER_SPLIT)
    tiles_per_split = max(1, triton.cdiv(num_tiles, max(1, num_splits)))
    blocks_per_split = tiles_per_split * blocks_per_tile
    num_splits = max(1, triton.cdiv(num_blocks, blocks_per_split))
    return _Plan(block_m, q_per_tile, bt_pad, blocks_per_tile, blocks_per_split,
                 (num_q_tiles, num_kv_heads, num_splits))


def _launch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    blocks: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,  # slots, start positions, fills
    kv_strides: tuple[int, int, int],   # (block/slot, kv head, token), in elements
    num_kv_heads: int, block_tokens: int, num_blocks: int, num_k: int,
    q_positions: torch.Tensor | None, k_positions: torch.Tensor | None,
    scale: float, num_splits: int | None, row_blocks: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shared host side of the paged and contiguous entry points (no host sync). row_blocks: the
    block lists hold num_blocks entries per query, query after query."""
    num_q, num_heads, head_dim = q.shape
    if num_q == 0:
        return empty_result(0, num_heads, head_dim, q.device)
    q = q if q.stride(-1) == 1 else q.contiguous()
    group = num_heads // num_kv_heads
    plan = _plan(num_q, group, num_kv_heads, block_tokens, num_blocks, q.device, num_splits, row_blocks)
    num_splits = plan.grid[2]
    out_part = torch.empty(num_splits, num_q, num_heads, head_dim, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(num_splits, num_q, num_heads, dtype=torch.float32, device=q.device)
    dummy = torch.zeros(1, dtype=torch.int32, device=q.device)
    slots, starts, fills = blocks if blocks is not None else (dummy, dummy, dummy)
    triton_kernels.partial_attention_kernel[plan.grid](
        q, k, v, out_part, lse_part, slots, starts, fills,
        q_positions if q_positions is not None else dummy,
        k_positions if k_positions is not None else dummy,
        num_q, num_blocks, num_k, plan.blocks_per_split,
        q.stride(0), q.stride(1), *kv_strides,
        out_part.stride(0), out_part.stride(1), out_part.stride(2), lse_part.stride(0), lse_part.stride(1),
        scale * 1.4426950408889634,
        G=group, HEAD_DIM=head_dim, D_PAD=_dim_pad(head_dim),
        BLOCK_M=plan.block_m, Q_PER_TILE=plan.q_per_tile,
        BT=block_tokens, BT_PAD=plan.bt_pad, BLOCKS_PER_TILE=plan.blocks_per_tile,
        PAGED=blocks is not None, HAS_QPOS=q_positions is not None, HAS_KPOS=k_positions is not None,
        SKIP_MASKED_TILES=q_positions is not None and plan.grid[0] > 1,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,  # no tf32 for float32 inputs
        ROW_BLOCKS=row_blocks, num_warps=4, num_stages=3 if _dim_pad(head_dim) * q.element_size() <= 256 else 2,
    )
    if num_splits == 1:
        return out_part[0], lse_part[0]
    return _merge_stacked(out_part, lse_part)


def _merge_stacked(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """outs float32 [S, ..., dim], lses float32 [S, ...], both contiguous -> merged."""
    head_dim = outs.shape[-1]
    num_rows = lses[0].numel()
    out = torch.empty(outs.shape[1:], dtype=torch.float32, device=outs.device)
    lse = torch.empty(lses.shape[1:], dtype=torch.float32, device=outs.device)
    if num_rows > 0:
        triton_kernels.merge_splits_kernel[(num_rows,)](
            outs, lses, out, lse, outs.shape[0], num_rows,
            HEAD_DIM=head_dim, D_PAD=_dim_pad(head_dim), S_TILE=MERGE_TILE,
        )
    return out, lse


def paged_partial_attention(
    q: torch.Tensor,                # [num_q, num_heads, head_dim]
    kv_pool: torch.Tensor,          # [num_slots, 2, num_kv_heads, block_tokens, head_dim]
    block_slots: torch.Tensor,      # int [num_blocks]
    block_start_pos: torch.Tensor,  # int [num_blocks]
    block_num_tokens: torch.Tensor, # int [num_blocks], 1..block_tokens
    *,
    scale: float,
    q_positions: torch.Tensor | None = None,  # int [num_q]
    num_splits: int | None = None,  # None = pick from the grid size; tests force it
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of ``reference.paged_partial_attention``; returns float32 (out, lse)."""
    check_paged_args(q, kv_pool, block_slots, block_start_pos, block_num_tokens, q_positions)
    if kv_pool.stride(-1) != 1:
        raise ValueError("kv_pool must be contiguous in head_dim")
    k, v = kv_pool[:, 0], kv_pool[:, 1]  # [num_slots, kv_heads, block_tokens, dim] views
    return _launch(
        q, k, v, (block_slots, block_start_pos, block_num_tokens), (k.stride(0), k.stride(1), k.stride(2)),
        kv_pool.shape[2], kv_pool.shape[3], block_slots.shape[0], 0, q_positions, None, scale, num_splits,
    )


def paged_rows_attention(
    q: torch.Tensor,                # [num_q, num_heads, head_dim]
    kv_pool: torch.Tensor,          # [num_slots, 2, num_kv_heads, block_tokens, head_dim]
    block_slots: torch.Tensor,      # int [num_q, num_blocks]
    block_start_pos: torch.Tensor,  # int [num_q, num_blocks]
    block_num_tokens: torch.Tensor, # int [num_q, num_blocks], 1..block_tokens
    *,
    scale: float,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of ``reference.paged_rows_attention``: one launch for every query."""
    check_rows_args(q, kv_pool, block_slots, block_start_pos, block_num_tokens)
    if kv_pool.stride(-1) != 1:
        raise ValueError("kv_pool must be contiguous in head_dim")
    lists = tuple(t.contiguous() for t in (block_slots, block_start_pos, block_num_tokens))
    k, v = kv_pool[:, 0], kv_pool[:, 1]
    return _launch(
        q, k, v, lists, (k.stride(0), k.stride(1), k.stride(2)), kv_pool.shape[2], kv_pool.shape[3],
        block_slots.shape[1], 0, None, None, scale, num_splits, row_blocks=True,
    )


def contiguous_partial_attention(
    q: torch.Tensor,                          # [num_q, num_heads, head_dim]
    k: torch.Tensor,                          # [num_k, num_kv_heads, head_dim]
    v: torch.Tensor,                          # [num_k, num_kv_heads, head_dim]
    *,
    scale: float,
    q_positions: torch.Tensor | None = None,  # int [num_q]
    k_positions: torch.Tensor | None = None,  # int [num_k]; None = arange(num_k)
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of ``reference.contiguous_partial_attention``."""
    check_contiguous_args(q, k, v, q_positions, k_positions)
    if k.stride() != v.stride() or k.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    num_k = k.shape[0]
    kv_strides = (CONTIG_TILE * k.stride(0), k.stride(1), k.stride(0))
    return _launch(
        q, k, v, None, kv_strides, k.shape[1], CONTIG_TILE, triton.cdiv(num_k, CONTIG_TILE), num_k,
        q_positions, k_positions, scale, num_splits,
    )


def merge_partials(parts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of ``reference.merge_partials`` (stack, then one merge kernel)."""
    outs, lses = stack_parts(parts)
    return _merge_stacked(outs.contiguous(), lses.contiguous())


def merge_two_into(output: torch.Tensor, first: tuple[torch.Tensor, torch.Tensor],
                   second: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Triton twin of ``reference.merge_two_into``: one launch, any strides with a contiguous head dim."""
    check_merge_two_args(output, first, second)
    num_q, num_heads, head_dim = output.shape
    (a, a_lse), (b, b_lse) = first, second
    if num_q * num_heads == 0:
        return
    triton_kernels.merge_two_kernel[(num_q * num_heads,)](
        output, a, a_lse, b, b_lse, num_heads,
        output.stride(0), output.stride(1), a.stride(0), a.stride(1), a_lse.stride(0), a_lse.stride(1),
        b.stride(0), b.stride(1), b_lse.stride(0), b_lse.stride(1),
        HEAD_DIM=head_dim, D_PAD=_dim_pad(head_dim),
    )
