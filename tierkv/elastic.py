"""Elastic GPU budget: resize the hot window at run time and give the memory back.

Primitives: `resize_hot_window(runtime, residency)`.

Every full block already has a copy in the CPU tier (blocks are written back when they fill),
so shrinking loses nothing. A resize builds the new resident pool, fills it for the running
sequence (if any), then frees the old pool and empties the allocator's cache so the driver,
and any other process, sees the memory free:

    new pool  <- old pool   blocks resident before and after (device copy, one batch)
    new pool  <- CPU tier   blocks resident only after (one batched gather)
    old pool  -> freed, torch.cuda.empty_cache()

It runs between forward steps (a running sequence applies a pending resize when its next
step starts), so no attention ever reads a pool being replaced.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tierkv.storage.gpu import ResidencyPlan

if TYPE_CHECKING:
    from tierkv.runtime import KVRuntime
    from tierkv.sequence import SequenceKV


def resize_hot_window(rt: "KVRuntime", residency: ResidencyPlan, seq: "SequenceKV | None") -> int:
    """Swap in a resident pool shaped by `residency`; returns the bytes freed (negative: taken)."""
    old_pool, old_residency = rt.pool.resident, rt.residency
    new_pool = torch.zeros((rt.num_layers, residency.slots_per_layer, *rt.layout.shape),
                           dtype=rt.layout.dtype, device=rt.device)
    if seq is not None and seq.seq_length > 0:
        _refill(rt, seq, old_pool, old_residency, new_pool, residency)
    freed = old_pool.numel() * old_pool.element_size() - new_pool.numel() * new_pool.element_size()
    rt.pool.resident = new_pool
    rt.pool.residency = residency
    rt.residency = residency
    del old_pool
    if rt.device.type == "cuda":
        torch.cuda.current_stream(rt.device).synchronize()  # the copies out of the old pool are done
        torch.cuda.empty_cache()
    return freed


def _refill(rt, seq, old_pool, old_residency, new_pool, residency) -> None:
    num_blocks = -(-seq.seq_length // rt.layout.block_tokens)
    keep_old, keep_new, fetch_blocks, fetch_new = [], [], [], []
    for b in range(num_blocks):
        if not residency.is_resident(b, num_blocks):
            continue
        if old_residency.is_resident(b, num_blocks):
            keep_old.append(old_residency.slot_of(b))
            keep_new.append(residency.slot_of(b))
        else:  # a full block (the partial one is always resident): its copy is in the CPU tier
            fetch_blocks.append(b)
            fetch_new.append(residency.slot_of(b))
    if keep_old:
        src = torch.tensor(keep_old, device=old_pool.device)
        dst = torch.tensor(keep_new, device=old_pool.device)
        new_pool[:, dst] = old_pool[:, src]
    if fetch_blocks:
        seq.wait_for_write_back()
        per_layer = residency.slots_per_layer
        src = [seq.cpu_slots[layer][b] for layer in range(rt.num_layers) for b in fetch_blocks]
        dst = [layer * per_layer + s for layer in range(rt.num_layers) for s in fetch_new]
        handle = rt.engine.gather_h2d(rt.cpu.slab, torch.tensor(src, dtype=torch.int64),
                                      new_pool.view(-1, *rt.layout.shape), torch.tensor(dst, dtype=torch.int64))
        handle.wait_on_current_stream()
