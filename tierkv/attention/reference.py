"""PyTorch reference for partial attention over paged or contiguous KV.

Used on CPU and as the oracle for the Triton kernels. Everything is computed in
float32 regardless of the input dtype.

Primitives:
  - ``paged_partial_attention``: attend to a set of blocks in a paged KV pool,
    return ``(out, lse)``.
  - ``contiguous_partial_attention``: the same over plain ``[num_k, kv_heads, dim]``
    tensors with explicit key positions.
  - ``merge_partials``: exact log-sum-exp merge of ``(out, lse)`` pairs.
  - ``check_paged_args`` / ``check_contiguous_args``: shape and dtype validation
    shared with the Triton launchers (no host sync: values are never read).
  - ``empty_result`` / ``stack_parts``: small helpers shared with the launchers.

Mask rule: the key at absolute position ``p`` is visible to query ``i`` iff
``p <= q_positions[i]``; ``q_positions=None`` means no causal mask. A query row
that sees no key gets ``out = 0`` and ``lse = -inf``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Upper bound on the float32 score tensor built per key chunk, in elements.
_MAX_SCORE_ELEMENTS = 1 << 25


def check_paged_args(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    block_slots: torch.Tensor,
    block_start_pos: torch.Tensor,
    block_num_tokens: torch.Tensor,
    q_positions: torch.Tensor | None,
) -> None:
    """Raise ``ValueError`` on inconsistent shapes, dtypes or devices."""
    if q.dim() != 3:
        raise ValueError(f"q must be [num_q, num_heads, head_dim], got shape {tuple(q.shape)}")
    if kv_pool.dim() != 5 or kv_pool.shape[1] != 2:
        raise ValueError(
            "kv_pool must be [num_slots, 2, num_kv_heads, block_tokens, head_dim], "
            f"got shape {tuple(kv_pool.shape)}"
        )
    if kv_pool.shape[-1] != q.shape[-1]:
        raise ValueError(f"head_dim mismatch: q {q.shape[-1]}, kv_pool {kv_pool.shape[-1]}")
    if kv_pool.dtype != q.dtype or kv_pool.device != q.device:
        raise ValueError(f"kv_pool is {kv_pool.dtype} on {kv_pool.device}, q is {q.dtype} on {q.device}")
    _check_gqa(q.shape[1], kv_pool.shape[2])
    num_blocks = block_slots.shape[0] if block_slots.dim() == 1 else None
    for name, t in (("block_slots", block_slots), ("block_start_pos", block_start_pos),
                    ("block_num_tokens", block_num_tokens)):
        _check_index_vector(name, t, num_blocks, q.device)
    if q_positions is not None:
        _check_index_vector("q_positions", q_positions, q.shape[0], q.device)


def check_contiguous_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor | None,
    k_positions: torch.Tensor | None,
) -> None:
    """Raise ``ValueError`` on inconsistent shapes, dtypes or devices."""
    if q.dim() != 3:
        raise ValueError(f"q must be [num_q, num_heads, head_dim], got shape {tuple(q.shape)}")
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(
            f"k and v must both be [num_k, num_kv_heads, head_dim], got {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"head_dim mismatch: q {q.shape[-1]}, k {k.shape[-1]}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name} is {t.dtype} on {t.device}, q is {q.dtype} on {q.device}")
    _check_gqa(q.shape[1], k.shape[1])
    if q_positions is not None:
        _check_index_vector("q_positions", q_positions, q.shape[0], q.device)
    if k_positions is not None:
        _check_index_vector("k_positions", k_positions, k.shape[0], q.device)


def _check_gqa(num_heads: int, num_kv_heads: int) -> None:
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")


def _check_index_vector(name: str, t: torch.Tensor, length: int | None, device: torch.device) -> None:
    if t.dim() != 1 or (length is not None and t.shape[0] != length):
        raise ValueError(f"{name} must be 1-D of length {length}, got shape {tuple(t.shape)}")
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, q is on {device}")


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


def empty_result(
    num_q: int, num_heads: int, head_dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """out = 0 float32 [num_q, num_heads, head_dim], lse = -inf float32 [num_q, num_heads]."""
    out = torch.zeros(num_q, num_heads, head_dim, dtype=torch.float32, device=device)
    lse = torch.full((num_q, num_heads), float("-inf"), dtype=torch.float32, device=device)
    return out, lse


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


def check_rows_args(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    block_slots: torch.Tensor,
    block_start_pos: torch.Tensor,
    block_num_tokens: torch.Tensor,
) -> None:
    """`check_paged_args` for block lists of one row per query ([num_q, num_blocks] each)."""
    for name, t in (("block_slots", block_slots), ("block_start_pos", block_start_pos),
                    ("block_num_tokens", block_num_tokens)):
        if t.dim() != 2 or t.shape != block_slots.shape or t.shape[0] != q.shape[0]:
            raise ValueError(f"{name} must be [num_q, num_blocks] = [{q.shape[0]}, n] like block_slots "
                             f"{tuple(block_slots.shape)}, got {tuple(t.shape)}")
    check_paged_args(q, kv_pool, block_slots[0] if q.shape[0] else block_slots.reshape(-1),
                     block_start_pos[0] if q.shape[0] else block_start_pos.reshape(-1),
                     block_num_tokens[0] if q.shape[0] else block_num_tokens.reshape(-1), None)


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


def stack_parts(parts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate and stack parts into float32 ``[P, ..., dim]`` and ``[P, ...]``."""
    if len(parts) == 0:
        raise ValueError("merge_partials needs at least one (out, lse) part, got none")
    out0, lse0 = parts[0]
    if out0.shape[:-1] != lse0.shape:
        raise ValueError(f"out shape {tuple(out0.shape)} does not match lse shape {tuple(lse0.shape)}")
    for i, (out, lse) in enumerate(parts):
        if out.shape != out0.shape or lse.shape != lse0.shape:
            raise ValueError(
                f"part {i} has shapes {tuple(out.shape)}, {tuple(lse.shape)}; "
                f"part 0 has {tuple(out0.shape)}, {tuple(lse0.shape)}"
            )
    outs = torch.stack([out.float() for out, _ in parts])
    lses = torch.stack([lse.float() for _, lse in parts])
    return outs, lses


def check_merge_two_args(output: torch.Tensor, first: tuple[torch.Tensor, torch.Tensor],
                         second: tuple[torch.Tensor, torch.Tensor]) -> None:
    """output [n, H, D]; each part (out [n, H, D], lse [n, H]); head dims contiguous."""
    for name, (out, lse) in (("first", first), ("second", second)):
        if out.shape != output.shape or lse.shape != output.shape[:2]:
            raise ValueError(f"merge_two_into: {name} part has shapes {tuple(out.shape)}, {tuple(lse.shape)}; "
                             f"output has {tuple(output.shape)}")
        if out.stride(-1) != 1:
            raise ValueError(f"merge_two_into: the {name} part's head dim must be contiguous")
    if output.stride(-1) != 1:
        raise ValueError("merge_two_into: the output's head dim must be contiguous")


def merge_two_into(output: torch.Tensor, first: tuple[torch.Tensor, torch.Tensor],
                   second: tuple[torch.Tensor, torch.Tensor]) -> None:
    """output [n, H, D] (any float dtype) = the LSE merge of two (out, lse) parts, in place."""
    check_merge_two_args(output, first, second)
    output.copy_(merge_partials([first, second])[0])
