"""PyTorch reference for partial attention over paged or contiguous KV.

Used on CPU and as the oracle for the Triton kernels. Everything is computed in
float32 regardless of the input dtype.

Primitives:
  - ``paged_partial_attention``: attend to a set of blocks in a paged KV pool,
    return ``(out, lse)``.
  - ``contiguous_partial_attention``: the same over plain ``[num_k, kv_heads, dim]``
    tensors with explicit key positions.
  - ``paged_rows_attention``: each query over blocks of its own, row by row.
  - ``merge_partials``: exact log-sum-exp merge of ``(out, lse)`` pairs.
  - ``merge_two_into``: the merge of two parts written into an existing output.

Argument checks and the empty result are the backends' shared contract
(``tierkv.attention.contract``).

Mask rule: the key at absolute position ``p`` is visible to query ``i`` iff
``p <= q_positions[i]``; ``q_positions=None`` means no causal mask. A query row
that sees no key gets ``out = 0`` and ``lse = -inf``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tierkv.attention.contract import (check_block_fills, check_contiguous_args, check_merge_two_args, check_paged_args,
                                       check_rows_args, empty_result, stack_parts)

# Upper bound on the float32 score tensor built per key chunk, in elements.
_MAX_SCORE_ELEMENTS = 1 << 25


def _attend(
    q: torch.Tensor,          # [num_q, num_heads, head_dim]
    k: torch.Tensor,          # [num_k, num_kv_heads, head_dim]
    v: torch.Tensor,          # [num_k, num_kv_heads, head_dim]
    visible: torch.Tensor,    # bool [num_q, num_k]
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention of one key chunk, in float32, with GQA grouping."""
    num_q, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    if k.shape[0] == 0:
        return empty_result(num_q, num_heads, head_dim, q.device)
    qg = q.float().reshape(num_q, num_kv_heads, group, head_dim)
    scores = torch.einsum("qhgd,khd->hgqk", qg, k.float()) * scale  # [kv_heads, group, num_q, num_k]
    scores = scores.masked_fill(~visible, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    probs = torch.exp(scores - row_max)
    denom = probs.sum(dim=-1, keepdim=True)                          # [kv_heads, group, num_q, 1]
    out = torch.einsum("hgqk,khd->qhgd", probs, v.float())           # [num_q, kv_heads, group, dim]
    safe_denom = torch.where(denom > 0, denom, torch.ones_like(denom))
    out = out / safe_denom.permute(2, 0, 1, 3)
    lse = (row_max + torch.log(denom)).squeeze(-1).permute(2, 0, 1)  # [num_q, kv_heads, group]
    return out.reshape(num_q, num_heads, head_dim), lse.reshape(num_q, num_heads)



def _visible(
    k_positions: torch.Tensor,          # int [num_k]
    k_valid: torch.Tensor | None,       # bool [num_k]
    q_positions: torch.Tensor | None,   # int [num_q]
    num_q: int,
) -> torch.Tensor:
    """bool [num_q, num_k]: key j is visible to query i."""
    num_k = k_positions.shape[0]
    if q_positions is None:
        visible = torch.ones(num_q, num_k, dtype=torch.bool, device=k_positions.device)
    else:
        visible = k_positions.long()[None, :] <= q_positions.long()[:, None]
    if k_valid is not None:
        visible = visible & k_valid[None, :]
    return visible



def _keys_per_chunk(num_q: int, num_heads: int) -> int:
    return max(1, _MAX_SCORE_ELEMENTS // max(1, num_q * num_heads))



def contiguous_partial_attention(
    q: torch.Tensor,                          # [num_q, num_heads, head_dim]
    k: torch.Tensor,                          # [num_k, num_kv_heads, head_dim]
    v: torch.Tensor,                          # [num_k, num_kv_heads, head_dim]
    *,
    scale: float,
    q_positions: torch.Tensor | None = None,  # int [num_q]
    k_positions: torch.Tensor | None = None,  # int [num_k]; None = arange(num_k)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` over plain K/V tensors; returns float32 ``(out, lse)``.

    out: float32 [num_q, num_heads, head_dim]; lse: float32 [num_q, num_heads].
    """
    check_contiguous_args(q, k, v, q_positions, k_positions)
    num_q, num_heads, head_dim = q.shape
    num_k = k.shape[0]
    if k_positions is None:
        k_positions = torch.arange(num_k, device=q.device)
    chunk = _keys_per_chunk(num_q, num_heads)
    parts = []
    for lo in range(0, num_k, chunk):
        hi = min(lo + chunk, num_k)
        visible = _visible(k_positions[lo:hi], None, q_positions, num_q)
        parts.append(_attend(q, k[lo:hi], v[lo:hi], visible, scale))
    if not parts:
        return empty_result(num_q, num_heads, head_dim, q.device)
    return parts[0] if len(parts) == 1 else merge_partials(parts)



def paged_partial_attention(
    q: torch.Tensor,                # [num_q, num_heads, head_dim]
    kv_pool: torch.Tensor,          # [num_slots, 2, num_kv_heads, block_tokens, head_dim]
    block_slots: torch.Tensor,      # int [num_blocks]
    block_start_pos: torch.Tensor,  # int [num_blocks]
    block_num_tokens: torch.Tensor, # int [num_blocks], 1..block_tokens
    *,
    scale: float,
    q_positions: torch.Tensor | None = None,  # int [num_q]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` over the listed pool blocks; returns float32 ``(out, lse)``.

    Gathers the blocks into contiguous K/V (a chunk at a time to bound memory)
    and masks tokens at or past ``block_num_tokens``.
    """
    check_paged_args(q, kv_pool, block_slots, block_start_pos, block_num_tokens, q_positions)
    if not block_num_tokens.is_cuda:  # on CUDA reading the fills would sync the host
        check_block_fills(block_num_tokens, kv_pool.shape[3])
    num_q, num_heads, head_dim = q.shape
    num_kv_heads, block_tokens = kv_pool.shape[2], kv_pool.shape[3]
    num_blocks = block_slots.shape[0]
    offsets = torch.arange(block_tokens, device=q.device)
    blocks_per_chunk = max(1, _keys_per_chunk(num_q, num_heads) // block_tokens)
    parts = []
    for lo in range(0, num_blocks, blocks_per_chunk):
        hi = min(lo + blocks_per_chunk, num_blocks)
        kv = kv_pool[block_slots[lo:hi].long()]                # [n, 2, kv_heads, block_tokens, dim]
        kv = kv.permute(1, 0, 3, 2, 4).reshape(2, -1, num_kv_heads, head_dim)
        k_positions = (block_start_pos[lo:hi].long()[:, None] + offsets).reshape(-1)
        k_valid = (offsets[None, :] < block_num_tokens[lo:hi].long()[:, None]).reshape(-1)
        kv = torch.where(k_valid[None, :, None, None], kv, 0)  # tokens past the fill may be garbage
        visible = _visible(k_positions, k_valid, q_positions, num_q)
        parts.append(_attend(q, kv[0], kv[1], visible, scale))
    if not parts:
        return empty_result(num_q, num_heads, head_dim, q.device)
    return parts[0] if len(parts) == 1 else merge_partials(parts)



def paged_rows_attention(
    q: torch.Tensor,                # [num_q, num_heads, head_dim]
    kv_pool: torch.Tensor,          # [num_slots, 2, num_kv_heads, block_tokens, head_dim]
    block_slots: torch.Tensor,      # int [num_q, num_blocks]: query i reads the blocks of row i
    block_start_pos: torch.Tensor,  # int [num_q, num_blocks]
    block_num_tokens: torch.Tensor, # int [num_q, num_blocks], 1..block_tokens
    *,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query over blocks of its own (no causal mask): `paged_partial_attention` row by row;
    float32 ``(out, lse)``."""
    check_rows_args(q, kv_pool, block_slots, block_start_pos, block_num_tokens)
    parts = [paged_partial_attention(q[i : i + 1], kv_pool, block_slots[i], block_start_pos[i], block_num_tokens[i],
                                     scale=scale) for i in range(q.shape[0])]
    if not parts:
        return empty_result(0, q.shape[1], q.shape[2], q.device)
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])



def merge_partials(parts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact LSE merge of ``(out, lse)`` pairs with identical shapes.

    out_i: [..., head_dim], lse_i: [...]; returns float32 of the same shapes.
    Rows whose lse is -inf in every part come out as ``out = 0, lse = -inf``.
    """
    outs, lses = stack_parts(parts)                        # [P, ..., dim], [P, ...]
    row_max = lses.amax(dim=0)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(lses - row_max)                    # [P, ...]; 0 where lse = -inf
    total = weights.sum(dim=0)
    out = (weights.unsqueeze(-1) * outs).sum(dim=0)
    out = out / torch.where(total > 0, total, torch.ones_like(total)).unsqueeze(-1)
    return out, row_max + torch.log(total)



def merge_two_into(output: torch.Tensor, first: tuple[torch.Tensor, torch.Tensor],
                   second: tuple[torch.Tensor, torch.Tensor]) -> None:
    """output [n, H, D] (any float dtype) = the LSE merge of two (out, lse) parts, in place."""
    check_merge_two_args(output, first, second)
    output.copy_(merge_partials([first, second])[0])

