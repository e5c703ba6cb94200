"""Elastic GPU budget: resize the hot window at run time and give the memory back.

Primitives: `resize_hot_window(pool, io, residency, seq)`.

It changes the GPU pool it is given (`pool.resident`, `pool.residency`) and nothing else; the
runtime reads the new residency back from its pool.

Every full block already has a copy in the CPU tier (blocks are written back when they fill),
so shrinking loses nothing. A resize builds the new resident pool, fills it for the running
sequence (if any), then frees the old pool and empties the allocator's cache so the driver,
and any other process, sees the memory free:

    partial last block -> a small temporary (it is the only block not yet in the CPU tier)
    old pool  -> freed, torch.cuda.empty_cache()
    new pool  <- CPU tier   the resident full blocks (one batched gather), then the partial block

It runs between forward steps (a running sequence applies a pending resize when its next
step starts), so no attention ever reads a pool being replaced. A resize that fails (the
allocation, the refill) leaves the old pool working: see `resize_hot_window`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tierkv.budget_change import HotWindowLost
from tierkv.storage.gpu import GpuBlockPool, ResidencyPlan

if TYPE_CHECKING:
    from tierkv.block_io import BlockIO
    from tierkv.engine.sequence import SequenceKV


def resize_hot_window(pool: GpuBlockPool, io: "BlockIO", residency: ResidencyPlan, seq: "SequenceKV | None") -> int:
    """Swap in a resident pool shaped by `residency`; returns the bytes freed (negative: taken).

    A shrink frees the old pool before allocating the new one, so it never needs old + new
    bytes at once (the card may be full); a grow builds the new pool first, so the old one
    stays in place until the new one is full. Only the partial last block lives on the GPU
    alone; it is kept aside in a small temporary while the pools change.

    On any failure (allocation, refill) the old residency is back in force and the exception
    propagates: a grow never touched the old pool; a shrink rebuilds it from the CPU tier and
    the temporary. When that rebuild fails too, raises HotWindowLost (the sequence cannot go on).
    """
    old_residency = pool.residency
    old_bytes = pool.resident_bytes
    num_tokens = seq.seq_length if seq is not None else 0
    num_blocks = -(-num_tokens // pool.layout.block_tokens)
    partial = None
    if num_tokens:
        seq.wait_for_write_back()  # every full block is in the CPU tier
        if num_tokens % pool.layout.block_tokens:
            partial = pool.resident[:, old_residency.slot_of(num_blocks - 1)].clone()  # [L, 2, H, T, D]
    new_bytes = pool.num_layers * residency.slots_per_layer * pool.layout.num_bytes
    if new_bytes > old_bytes:  # growing: build first, so a failure leaves the old pool in place
        try:
            new_pool = _build(pool, io, residency, seq, num_blocks, partial)
        except Exception:
            _release_cached(pool)
            raise
    else:                      # shrinking: free first, so old + new never need to fit together
        pool.resident = None
        _release_cached(pool)
        try:
            new_pool = _build(pool, io, residency, seq, num_blocks, partial)
        except Exception as exc:
            _rebuild_old(pool, io, old_residency, seq, num_blocks, partial, exc)
            raise
    pool.resident = new_pool
    pool.residency = residency
    _release_cached(pool)
    return old_bytes - new_bytes


def _build(pool: GpuBlockPool, io, residency: ResidencyPlan, seq, num_blocks: int, partial) -> torch.Tensor:
    """A pool shaped by `residency`, filled for `seq` (its first `num_blocks` blocks)."""
    new_pool = _allocate(pool, residency)
    if num_blocks:
        _refill(pool, io, seq, new_pool, residency, num_blocks, partial)
    return new_pool


def _rebuild_old(pool: GpuBlockPool, io, old_residency: ResidencyPlan, seq, num_blocks: int, partial, cause: Exception) -> None:
    """After a failed shrink: the old pool again, from the CPU tier and the partial block's temporary."""
    _release_cached(pool)
    try:
        pool.resident = _build(pool, io, old_residency, seq, num_blocks, partial)
    except Exception as again:
        raise HotWindowLost(f"resizing the GPU hot window failed ({type(cause).__name__}: {cause}) and so did "
                            f"rebuilding the old pool ({type(again).__name__}: {again})") from again


def _allocate(pool: GpuBlockPool, residency: ResidencyPlan) -> torch.Tensor:
    return torch.zeros((pool.num_layers, residency.slots_per_layer, *pool.layout.shape),
                       dtype=pool.layout.dtype, device=pool.device)


def _release_cached(pool: GpuBlockPool) -> None:
    """Hand freed pool memory back to the driver once nothing reads it."""
    if pool.device.type == "cuda":
        torch.cuda.current_stream(pool.device).synchronize()
        torch.cuda.empty_cache()


def _refill(pool: GpuBlockPool, io, seq, new_pool, residency, num_blocks: int, partial) -> None:
    """Gather the new pool's resident full blocks from the CPU tier; put the partial block back."""
    full_blocks = num_blocks - (partial is not None)
    wanted = [b for b in range(full_blocks) if residency.is_resident(b, num_blocks)]
    if wanted:
        per_layer = residency.slots_per_layer
        src = [seq.cpu_slots[layer][b] for layer in range(pool.num_layers) for b in wanted]
        dst = [layer * per_layer + residency.slot_of(b) for layer in range(pool.num_layers) for b in wanted]
        handle = io.gather(torch.tensor(src, dtype=torch.int64), new_pool.view(-1, *pool.layout.shape),
                           torch.tensor(dst, dtype=torch.int64))
        handle.wait_on_current_stream()
    if partial is not None:
        new_pool[:, residency.slot_of(num_blocks - 1)] = partial
