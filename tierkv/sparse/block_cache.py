"""The GPU far-block cache of sparse decode: far blocks kept in staging slots across steps, LRU.

Primitives: `FarBlockCache` (`lookup`, `admit`, `invalidate`, `slots`), `gather_pairs`.

Each layer owns C staging slots; a miss area of k slots follows (k = blocks selected per step):

    staging: [ layer 0: C slots | layer 1: C slots | ... | layer L-1: C slots | miss area: k ]

The directory lives on the device, so looking blocks up and choosing victims never waits for
the host (all shapes are fixed; a pair that copies nothing carries slot -1):

    slot_of_block [L, cap + 1]  local slot of block b, -1 when not cached (entry cap: a sink for masked writes)
    block_of_slot [L, C + 1]    block held by slot c, -1 when empty (entry C: the sink)
    last_use      [L, C + 1]    tick of the last admission or hit (ticks are host integers, one per use)

`admit(layer, ids, mask, tick, step_tick)` maps the masked, uncached ids to the least recently
used slots not touched since `step_tick` (so nothing read or filled in this step is replaced),
and returns the (CPU slot, staging slot) pairs to copy; an id that finds no such slot is not
cached (-1). Blocks are immutable once full, so a cached block stays valid until evicted.
"""
from __future__ import annotations

import torch

from tierkv.config import ConfigError
from tierkv.units import format_bytes

_NEVER = -(2**62)  # last_use of an empty slot: older than any tick


def cache_slots_per_layer(num_layers: int, staging_blocks: int, blocks_per_step: int, block_bytes: int) -> int:
    """C, the far-block cache slots of each layer; ConfigError when they cannot hold one selection."""
    slots = (staging_blocks - blocks_per_step) // num_layers
    if slots < blocks_per_step:
        needed = (num_layers + 1) * blocks_per_step * block_bytes
        raise ConfigError(
            "scheduler.staging_bytes", staging_blocks * block_bytes,
            f"predictor 'query' keeps at least one selection per layer plus a miss area on the GPU: "
            f"(layers + 1) x {blocks_per_step} blocks of {format_bytes(block_bytes)}, at least {format_bytes(needed)}")
    return slots


class FarBlockCache:
    def __init__(self, num_layers: int, staging_blocks: int, blocks_per_step: int, block_bytes: int,
                 device: torch.device):
        self.num_layers = num_layers
        self.k = blocks_per_step
        self.slots_per_layer = cache_slots_per_layer(num_layers, staging_blocks, blocks_per_step, block_bytes)  # C
        self.miss_area = num_layers * self.slots_per_layer
        self.device = device
        self._capacity = 0
        self.slot_of_block = torch.full((num_layers, 1), -1, dtype=torch.int64, device=device)
        self.block_of_slot = torch.full((num_layers, self.slots_per_layer + 1), -1, dtype=torch.int64, device=device)
        self.last_use = torch.full((num_layers, self.slots_per_layer + 1), _NEVER, dtype=torch.int64, device=device)
        self._miss_slots = torch.arange(self.miss_area, self.miss_area + blocks_per_step, device=device)

    def reserve(self, num_blocks: int) -> None:
        """Make the directory cover block ids below `num_blocks` (host-known; no sync)."""
        if num_blocks <= self._capacity:
            return
        capacity = max(num_blocks, 2 * self._capacity, 256)
        grown = torch.full((self.num_layers, capacity + 1), -1, dtype=torch.int64, device=self.device)
        grown[:, : self._capacity] = self.slot_of_block[:, : self._capacity]
        self.slot_of_block, self._capacity = grown, capacity

    def invalidate(self) -> None:
        """Forget every cached block (the staging slots were overwritten, e.g. by a prefill chunk)."""
        self.slot_of_block.fill_(-1)
        self.block_of_slot.fill_(-1)
        self.last_use.fill_(_NEVER)

    def lookup(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """ids int64 [n] (device) -> int64 [n] local slots, -1 where not cached."""
        return self.slot_of_block[layer].index_select(0, ids)

    def touch(self, layer: int, local_slots: torch.Tensor, tick: int) -> None:
        """Mark slots (int64 [n], -1 entries ignored) as used at `tick`."""
        sink = self.slots_per_layer
        self.last_use[layer].index_fill_(0, torch.where(local_slots >= 0, local_slots, sink), tick)

    def admit(self, layer: int, ids: torch.Tensor, mask: torch.Tensor, tick: int, step_tick: int) -> torch.Tensor:
        """Give the masked ids (int64 [n], bool [n]; none of them cached, no duplicates) slots.

        Returns int64 [n]: the local slot each masked id now owns, -1 where it is unmasked or
        where no slot untouched since `step_tick` was left. The caller copies the blocks in.
        """
        C, cap = self.slots_per_layer, self._capacity
        last_use = self.last_use[layer, :C]
        evictable = last_use < step_tick                                          # [C]
        order = torch.argsort(torch.where(evictable, last_use, tick + 1))         # LRU first, touched last
        rank = torch.cumsum(mask.to(torch.int64), 0) - 1                          # [n]
        ok = mask & (rank < evictable.sum())
        victim = torch.where(ok, order.index_select(0, rank.clamp(0, C - 1)), C)  # [n], C = sink
        old = self.block_of_slot[layer].index_select(0, victim)
        directory = self.slot_of_block[layer]
        directory.index_fill_(0, torch.where(ok & (old >= 0), old, cap), -1)     # unmap the evicted blocks
        directory.index_put_((torch.where(ok, ids, cap),), victim)               # map the admitted ones
        self.block_of_slot[layer].index_put_((victim,), torch.where(ok, ids, -1))
        self.last_use[layer].index_fill_(0, victim, tick)
        directory[cap : cap + 1].fill_(-1)  # the sink entries hold nothing (fill_: no host-to-device copy)
        self.block_of_slot[layer, C : C + 1].fill_(-1)
        return torch.where(ok, victim, -1)

    def staging_slots(self, layer: int, local_slots: torch.Tensor) -> torch.Tensor:
        """Local slots (int64 [n], -1 kept) -> staging slots."""
        return torch.where(local_slots >= 0, local_slots + layer * self.slots_per_layer, -1)

    def miss_slots(self, n: int) -> torch.Tensor:
        """The first n miss-area staging slots, int64 [n] on the device."""
        return self._miss_slots[:n]


def gather_pairs(io, src_slots: torch.Tensor, staging: torch.Tensor, dst_slots: torch.Tensor, *, after,
                 skip_on_device: bool):
    """Copy CPU-tier slots src_slots[i] to staging[dst_slots[i]] where src_slots[i] >= 0.

    src_slots, dst_slots: int64 [n] on the device. `skip_on_device` (the cupy copy kernel and a
    plain CPU tier): the pairs go to the kernel as they are and it skips those with a negative
    slot (counting them in the engine's invalid-pair counter), so the host never waits; the
    engine counted every listed pair as moved, so their bytes are taken back here and the caller
    adds the bytes actually copied once its device counters reach the host. Otherwise (CPU
    engine, torch_uva / copy_loop backends, quantized tiers) the pairs are dropped on the host,
    which on CUDA is a host sync. Returns the handle, or None when nothing was left to copy.
    """
    if skip_on_device:
        handle = io.gather(src_slots, staging, dst_slots, after=after)
        io.engine.num_bytes_moved["h2d"] -= handle.num_bytes
        return handle
    keep = src_slots >= 0
    src, dst = src_slots[keep].cpu(), dst_slots[keep].cpu()
    if src.numel() == 0:
        return None
    return io.gather(src, staging, dst, after=after)
