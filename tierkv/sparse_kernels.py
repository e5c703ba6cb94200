"""Triton kernel of the sparse selection's block bound (`tierkv.sparse.BlockSummaries`).

Primitives: `block_bounds`.

One launch computes, for a contiguous run of blocks of one layer's summary table, the bound

    score[b] = max over heads h of  sum_d max(q[h, d], 0) * kmax[b, h', d] + min(q[h, d], 0) * kmin[b, h', d]

(h' = h's KV head), the same value as the PyTorch path (a cast of the table, a batched matmul and
a max over heads: some ten launches, and a float32 copy of the table). With a device limit,
blocks at or past it score -inf, so a CUDA graph can take the far count as an input. One program
per BLOCK_B blocks reads their rows once, every KV head in turn, and keeps the running max in
float32. Imported lazily where a CUDA table arrives; also runs under the Triton interpreter
(`TRITON_INTERPRET=1`) on CPU tensors.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_B = 16  # blocks per program


@triton.jit
def _block_bounds_kernel(q_ptr, table_ptr, out_ptr, limit_ptr, first, num_rows,
                         stride_qh, stride_tb, stride_th,
                         NUM_KV_HEADS: tl.constexpr, G: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                         BLOCK: tl.constexpr, HAS_LIMIT: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)   # output rows; table rows first + rows
    d = tl.arange(0, D_PAD)
    in_rows = rows < num_rows
    in_dims = d < HEAD_DIM
    mask = in_rows[:, None] & in_dims[None, :]
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    for kv_head in tl.static_range(NUM_KV_HEADS):
        at = table_ptr + (first + rows)[:, None].to(tl.int64) * stride_tb + kv_head * stride_th + d[None, :]
        kmax = tl.load(at, mask=mask, other=0.0).to(tl.float32)
        kmin = tl.load(at + HEAD_DIM, mask=mask, other=0.0).to(tl.float32)
        for g in tl.static_range(G):
            q = tl.load(q_ptr + (kv_head * G + g) * stride_qh + d, mask=in_dims, other=0.0).to(tl.float32)
            bound = tl.sum(kmax * tl.maximum(q, 0.0)[None, :] + kmin * tl.minimum(q, 0.0)[None, :], axis=1)
            best = tl.maximum(best, bound)
    if HAS_LIMIT:
        best = tl.where(first + rows < tl.load(limit_ptr), best, float("-inf"))
    tl.store(out_ptr + rows, best, mask=in_rows)


def block_bounds(table: torch.Tensor, q: torch.Tensor, first: int, stop: int,
                 limit: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """table [capacity, num_kv_heads, 2 * head_dim] (key max | key min per block), q [num_heads,
    head_dim] -> float32 [stop - first]: the bound of blocks first..stop-1. limit: int64 0-d on the
    device; blocks at or past it score -inf. out: where to write it (contiguous float32 [stop -
    first], such as a row of a batch's scores). No host sync."""
    capacity, num_kv_heads, width = table.shape
    num_heads, head_dim = q.shape
    if width != 2 * head_dim or num_heads % num_kv_heads or not 0 <= first <= stop <= capacity:
        raise ValueError(f"block_bounds: table {tuple(table.shape)}, q {tuple(q.shape)}, blocks {first}..{stop}")
    if table.stride(-1) != 1:
        raise ValueError("block_bounds: the table's last dimension must be contiguous")
    q = q if q.stride(-1) == 1 else q.contiguous()
    if out is None:
        out = torch.empty(stop - first, dtype=torch.float32, device=table.device)
    elif out.shape != (stop - first,) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"block_bounds: out must be contiguous float32 [{stop - first}], got {out.dtype} "
                         f"{tuple(out.shape)}")
    if stop == first:
        return out
    grid = (triton.cdiv(stop - first, BLOCK_B),)
    _block_bounds_kernel[grid](
        q, table, out, limit if limit is not None else out, first, stop - first,
        q.stride(0), table.stride(0), table.stride(1),
        NUM_KV_HEADS=num_kv_heads, G=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        D_PAD=triton.next_power_of_2(head_dim), BLOCK=BLOCK_B, HAS_LIMIT=limit is not None,
    )
    return out
