"""Triton kernel of the sparse selection's block bound (`tierkv.sparse.BlockSummaries`).

Primitives: `block_bounds`, `block_bounds_rows`.

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
def _bounds(q_ptr, table_ptr, table_rows, read, weight, stride_qh, stride_tb, stride_th,
            NUM_KV_HEADS: tl.constexpr, G: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
            BLOCK: tl.constexpr):
    """Both kernels' bound: float32 [BLOCK], the bound of q (q_ptr: its first head) over the table rows
    `table_rows` where `read`, -inf elsewhere (nothing read there)."""
    d = tl.arange(0, D_PAD)
    in_dims = d < HEAD_DIM
    mask = read[:, None] & in_dims[None, :]
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    for kv_head in tl.static_range(NUM_KV_HEADS):
        at = table_ptr + table_rows[:, None].to(tl.int64) * stride_tb + kv_head * stride_th + d[None, :]
        kmax = tl.load(at, mask=mask, other=0.0).to(tl.float32)
        kmin = tl.load(at + HEAD_DIM, mask=mask, other=0.0).to(tl.float32)
        for g in tl.static_range(G):
            q = tl.load(q_ptr + (kv_head * G + g) * stride_qh + d, mask=in_dims, other=0.0).to(tl.float32)
            mid = (0.5 - 0.5 * weight) * q
            a = weight * tl.maximum(q, 0.0) + mid
            b = weight * tl.minimum(q, 0.0) + mid
            bound = tl.sum(kmax * a[None, :] + kmin * b[None, :], axis=1)
            best = tl.maximum(best, bound)
    return tl.where(read, best, float("-inf"))


@triton.jit
def _block_bounds_kernel(q_ptr, table_ptr, out_ptr, limit_ptr, first, num_rows, weight,
                         stride_qh, stride_tb, stride_th,
                         NUM_KV_HEADS: tl.constexpr, G: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                         BLOCK: tl.constexpr, HAS_LIMIT: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)   # output rows; table rows first + rows
    in_rows = rows < num_rows
    best = _bounds(q_ptr, table_ptr, first + rows, in_rows, weight, stride_qh, stride_tb, stride_th,
                   NUM_KV_HEADS, G, HEAD_DIM, D_PAD, BLOCK)
    if HAS_LIMIT:
        best = tl.where(first + rows < tl.load(limit_ptr), best, float("-inf"))
    tl.store(out_ptr + rows, best, mask=in_rows)


def block_bounds(table: torch.Tensor, q: torch.Tensor, first: int, stop: int,
                 limit: torch.Tensor | None = None, out: torch.Tensor | None = None, *,
                 bound_weight: float = 1.0) -> torch.Tensor:
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
        q, table, out, limit if limit is not None else out, first, stop - first, float(bound_weight),
        q.stride(0), table.stride(0), table.stride(1),
        NUM_KV_HEADS=num_kv_heads, G=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        D_PAD=triton.next_power_of_2(head_dim), BLOCK=BLOCK_B, HAS_LIMIT=limit is not None,
    )
    return out


@triton.jit
def _block_bounds_rows_kernel(q_ptr, tables_ptr, like_ptr, out_ptr, limits_ptr, width, weight,
                              stride_qr, stride_qh, stride_tb, stride_th, stride_or,
                              NUM_KV_HEADS: tl.constexpr, G: tl.constexpr, HEAD_DIM: tl.constexpr,
                              D_PAD: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(1).to(tl.int64)
    table_ptr = tl.load(tables_ptr + r).to(tl.pointer_type(like_ptr.dtype.element_ty))  # row r's table
    # 16-byte aligned (the wrapper's contract): without the hint the compiler, knowing nothing of a loaded
    # address, reads the table one element at a time (216 us per launch of 10 rows on the H200, against
    # 125 us for ten one-table launches; the PTX of each is counted by a CPU test)
    table_ptr = tl.multiple_of(table_ptr, 16)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    # nothing at or past the row's far count is read (its table may end there)
    best = _bounds(q_ptr + r * stride_qr, table_ptr, rows, rows < tl.load(limits_ptr + r), weight, stride_qh, stride_tb,
                   stride_th, NUM_KV_HEADS, G, HEAD_DIM, D_PAD, BLOCK)
    tl.store(out_ptr + r * stride_or + rows, best, mask=rows < width)


def block_bounds_rows(addresses: torch.Tensor, like: torch.Tensor, q: torch.Tensor, limits: torch.Tensor,
                      out: torch.Tensor, *, block: int = BLOCK_B, num_warps: int | None = None,
                      bound_weight: float = 1.0) -> torch.Tensor:
    """The masked bound of m rows, each over a table of its own, in one launch: addresses int64 [m]
    on the device (row r's table [capacity_r, num_kv_heads, 2 * head_dim] starts at addresses[r], a
    multiple of 16 bytes; every table has `like`'s dtype and row layout, contiguous), q [m, num_heads, head_dim], limits
    int64 [m] (row r's far count, at most its capacity) -> out float32 [m, width] (written): block b
    of row r scores its bound below limits[r], -inf from there. block (a power of two) and num_warps:
    blocks per program and warps per program (Triton's default when None), the launch shape
    `benchmarks/bench_bounds.py` compares. No host sync."""
    m, width = out.shape
    _, num_kv_heads, twice = like.shape
    num_heads, head_dim = q.shape[1], q.shape[2]
    if (twice != 2 * head_dim or num_heads % num_kv_heads or q.shape[0] != m or addresses.shape != (m,)
            or limits.shape != (m,) or addresses.dtype != torch.int64 or not like.is_contiguous()
            or out.dtype != torch.float32 or out.stride(1) != 1):
        raise ValueError(f"block_bounds_rows: addresses {tuple(addresses.shape)}, like {tuple(like.shape)}, q "
                         f"{tuple(q.shape)}, limits {tuple(limits.shape)}, out {out.dtype} {tuple(out.shape)}")
    if block < 1 or block & (block - 1):
        raise ValueError(f"block_bounds_rows: block must be a power of two, got {block}")
    if m == 0 or width == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    grid = (triton.cdiv(width, block), m)
    _block_bounds_rows_kernel[grid](
        q, addresses, like, out, limits, width, float(bound_weight), q.stride(0), q.stride(1), like.stride(0), like.stride(1), out.stride(0),
        NUM_KV_HEADS=num_kv_heads, G=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        D_PAD=triton.next_power_of_2(head_dim), BLOCK=block, **({"num_warps": num_warps} if num_warps else {}),
    )
    return out
