"""The contract every partial-attention backend shares (reference, cpu_flash, triton_paged):
argument checks and the two results they build the same way.

Primitives:
  - ``check_paged_args`` / ``check_rows_args`` / ``check_contiguous_args`` /
    ``check_merge_two_args``: shape, dtype and device validation, ``ValueError`` naming what is
    wrong (no host sync: tensor values are never read).
  - ``empty_result``: ``(out, lse)`` of rows that saw no key: ``out = 0``, ``lse = -inf``.
  - ``stack_parts``: validate ``(out, lse)`` parts and stack them into float32.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def check_paged_args(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    block_slots: torch.Tensor,
    block_start_pos: torch.Tensor,
    block_num_tokens: torch.Tensor,
    q_positions: torch.Tensor | None,
) -> None:
    """Raise ``ValueError`` on inconsistent shapes, dtypes or devices."""
    _check_query(q)
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
    if block_slots.dim() != 1:
        raise ValueError(f"block_slots must be 1-D [num_blocks], got shape {tuple(block_slots.shape)}")
    for name, t in (("block_slots", block_slots), ("block_start_pos", block_start_pos),
                    ("block_num_tokens", block_num_tokens)):
        _check_index_vector(name, t, block_slots.shape[0], q.device)
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
    _check_query(q)
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



def check_block_fills(block_num_tokens: torch.Tensor, block_tokens: int) -> None:
    """Raise ``ValueError`` unless every fill is in 0..block_tokens (0: a padding entry, no token read).
    Reads the values: a host sync on CUDA, so the CPU paths call it and the kernels do not."""
    bad = (block_num_tokens < 0) | (block_num_tokens > block_tokens)
    if bool(bad.any()):
        raise ValueError(f"block_num_tokens must be in 0..{block_tokens} (the pool's block_tokens), "
                         f"got {block_num_tokens[bad][:4].tolist()}")


def _check_query(q: torch.Tensor) -> None:
    # zero heads would pass the GQA check (0 % n == 0) and divide by zero inside the CPU flash op
    if q.dim() != 3 or q.shape[1] == 0:
        raise ValueError(f"q must be [num_q, num_heads >= 1, head_dim], got shape {tuple(q.shape)}")


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



def empty_result(
    num_q: int, num_heads: int, head_dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """out = 0 float32 [num_q, num_heads, head_dim], lse = -inf float32 [num_q, num_heads]."""
    out = torch.zeros(num_q, num_heads, head_dim, dtype=torch.float32, device=device)
    lse = torch.full((num_q, num_heads), float("-inf"), dtype=torch.float32, device=device)
    return out, lse



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

