"""The Triton kernels of split-K (flash-decoding) partial attention; their Python launchers
(tile sizes, grids, the split merge) are ``tierkv.attention.triton_paged``.

Primitives:
  - ``partial_attention_kernel``: one program per (query tile, kv head, split).
  - ``merge_splits_kernel``: one program per (query, head) row, folding the splits.
  - ``merge_two_kernel``: one program per (query, head), the LSE merge of two parts.

Work decomposition of ``partial_attention_kernel``::

    rows of a query tile (BLOCK_M)            keys of a split
    r -> query  q0 + r // G                   blocks [lo, lo + blocks_per_split)
    r -> head   kv_head * G + r % G           walked BLOCKS_PER_TILE blocks at a time
    (all G query heads of one kv head         tile column n -> block n // BT_PAD,
     share every K/V load)                                  token n %  BT_PAD

Each program keeps an online softmax in float32 and writes a normalized partial
``out`` plus ``lse`` for its split; ``merge_splits_kernel`` folds the splits.
Runs under the Triton interpreter (``TRITON_INTERPRET=1`` at import) on CPU tensors.
"""

from __future__ import annotations

import inspect

import triton
import triton.language as tl

# the block lists' addresses (slices of a chunk's lists at any offset) out of the compiled signature;
# Triton before 3.2 has no such option (and then compiles one variant per alignment, as it used to)
_ANY_ALIGNMENT = ({"do_not_specialize_on_alignment": ["slots_ptr", "starts_ptr", "fills_ptr", "qpos_ptr", "kpos_ptr"]}
                  if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters else {})


# every int that varies from step to step (counts, and the part strides, which grow with num_q) and
# the block lists' addresses stay out of the compiled signature: one variant per tile shape, whatever
# the step (`tierkv.attention.warmup`)
@triton.jit(do_not_specialize=["num_q", "num_blocks", "num_k", "blocks_per_split", "stride_os", "stride_ls"],
            **_ANY_ALIGNMENT)
def partial_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr,
    slots_ptr, starts_ptr, fills_ptr, qpos_ptr, kpos_ptr,
    num_q, num_blocks, num_k, blocks_per_split,
    stride_qq, stride_qh,
    stride_kslot, stride_kh, stride_kt,
    stride_os, stride_oq, stride_oh, stride_ls, stride_lq,
    qk_scale_log2,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, Q_PER_TILE: tl.constexpr,
    BT: tl.constexpr, BT_PAD: tl.constexpr, BLOCKS_PER_TILE: tl.constexpr,
    PAGED: tl.constexpr, HAS_QPOS: tl.constexpr, HAS_KPOS: tl.constexpr,
    SKIP_MASKED_TILES: tl.constexpr, DOT_PRECISION: tl.constexpr, ROW_BLOCKS: tl.constexpr = False,
):
    pid_m = tl.program_id(0)
    if ROW_BLOCKS:  # one query per program, reading its own num_blocks entries of the block lists
        row_blocks = pid_m.to(tl.int64) * num_blocks
        slots_ptr += row_blocks
        starts_ptr += row_blocks
        fills_ptr += row_blocks
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    rows = tl.arange(0, BLOCK_M)
    q_idx = (pid_m * Q_PER_TILE + rows // G).to(tl.int64)
    head = kv_head * G + rows % G
    row_ok = (rows < Q_PER_TILE * G) & (q_idx < num_q)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q_offs = q_idx[:, None] * stride_qq + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, D_PAD]
    if HAS_QPOS:
        qpos = tl.load(qpos_ptr + q_idx, mask=row_ok, other=-1).to(tl.int64)
        q_max = tl.max(qpos, axis=0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)   # running max, log2 units
    l_i = tl.zeros([BLOCK_M], tl.float32)                  # running denominator
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    cols = tl.arange(0, BLOCKS_PER_TILE * BT_PAD)
    col_block = cols // BT_PAD
    col_tok = cols % BT_PAD
    block_lo = split * blocks_per_split
    block_hi = tl.minimum(block_lo + blocks_per_split, num_blocks)
    for b0 in range(block_lo, block_hi, BLOCKS_PER_TILE):
        b = b0 + col_block
        b_ok = b < block_hi
        if PAGED:
            slot = tl.load(slots_ptr + b, mask=b_ok, other=0).to(tl.int64)
            fill = tl.load(fills_ptr + b, mask=b_ok, other=0)
            kpos = tl.load(starts_ptr + b, mask=b_ok, other=0).to(tl.int64) + col_tok
            tok_ok = b_ok & (col_tok < fill)
        else:
            slot = b.to(tl.int64)
            key = slot * BT + col_tok
            tok_ok = b_ok & (col_tok < BT) & (key < num_k)
            if HAS_KPOS:
                kpos = tl.load(kpos_ptr + key, mask=tok_ok, other=0).to(tl.int64)
            else:
                kpos = key
        run_tile = True
        if SKIP_MASKED_TILES:
            run_tile = tl.min(tl.where(tok_ok, kpos, q_max + 1), axis=0) <= q_max
        if run_tile:
            kv_offs = slot * stride_kslot + kv_head * stride_kh + col_tok.to(tl.int64) * stride_kt
            kv_mask = tok_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + kv_offs[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, D_PAD]
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale_log2  # [BLOCK_M, BLOCK_N]
            visible = tok_ok[None, :]
            if HAS_QPOS:
                visible = visible & (kpos[None, :] <= qpos[:, None])
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.math.exp2(m_i - m_safe)
            p = tl.math.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + kv_offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    o_offs = split * stride_os + q_idx[:, None] * stride_oq + head[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + o_offs, out, mask=row_ok[:, None] & d_ok[None, :])
    tl.store(lse_ptr + split * stride_ls + q_idx * stride_lq + head, lse, mask=row_ok)


@triton.jit(do_not_specialize=["num_splits", "num_rows"])
def merge_splits_kernel(
    out_part_ptr, lse_part_ptr, out_ptr, lse_ptr,  # [S, rows, dim], [S, rows], [rows, dim], [rows]
    num_splits, num_rows,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, S_TILE: tl.constexpr,
):
    """The splits' lse max and sum are read S_TILE at a time: one compiled variant for any split count."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, S_TILE)
    m_tile = tl.full([S_TILE], float("-inf"), tl.float32)
    for s0 in range(0, num_splits, S_TILE):
        lses = tl.load(lse_part_ptr + (s0 + s) * num_rows + row, mask=s0 + s < num_splits, other=float("-inf"))
        m_tile = tl.maximum(m_tile, lses)
    m = tl.max(m_tile, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    sum_tile = tl.zeros([S_TILE], tl.float32)
    for s0 in range(0, num_splits, S_TILE):
        lses = tl.load(lse_part_ptr + (s0 + s) * num_rows + row, mask=s0 + s < num_splits, other=float("-inf"))
        sum_tile += tl.exp(lses - m_safe)
    total = tl.sum(sum_tile, axis=0)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    acc = tl.zeros([D_PAD], tl.float32)
    for i in range(0, num_splits):
        w = tl.exp(tl.load(lse_part_ptr + i * num_rows + row) - m_safe)
        o = tl.load(out_part_ptr + (i * num_rows + row) * HEAD_DIM + d, mask=d_ok, other=0.0)
        acc += tl.where(w > 0.0, w * o, 0.0)
    seen = total > 0.0
    tl.store(out_ptr + row * HEAD_DIM + d, acc / tl.where(seen, total, 1.0), mask=d_ok)
    tl.store(lse_ptr + row, tl.where(seen, m_safe + tl.log(tl.where(seen, total, 1.0)), float("-inf")))


@triton.jit
def merge_two_kernel(
    out_ptr, a_ptr, a_lse_ptr, b_ptr, b_lse_ptr, num_heads,
    s_out_q, s_out_h, s_a_q, s_a_h, s_al_q, s_al_h, s_b_q, s_b_h, s_bl_q, s_bl_h,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
):
    """One program per (query, head): out = the LSE merge of parts a and b, in out's dtype."""
    row = tl.program_id(0)
    q, h = row // num_heads, row % num_heads
    la = tl.load(a_lse_ptr + q * s_al_q + h * s_al_h).to(tl.float32)
    lb = tl.load(b_lse_ptr + q * s_bl_q + h * s_bl_h).to(tl.float32)
    m = tl.maximum(la, lb)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    wa = tl.exp(la - m_safe)
    wb = tl.exp(lb - m_safe)
    total = wa + wb
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    oa = tl.load(a_ptr + q * s_a_q + h * s_a_h + d, mask=d_ok, other=0.0).to(tl.float32)
    ob = tl.load(b_ptr + q * s_b_q + h * s_b_h + d, mask=d_ok, other=0.0).to(tl.float32)
    acc = tl.where(wa > 0.0, wa * oa, 0.0) + tl.where(wb > 0.0, wb * ob, 0.0)
    out = acc / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + q * s_out_q + h * s_out_h + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)
