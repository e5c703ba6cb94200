"""GPU tier: block slots on the device, sized by a byte budget, plus a staging ring.

Primitives: `GpuBlockPool`, `ResidencyPlan`, `plan_residency`, `min_resident_blocks`, `staging_region_blocks`,
`own_segments`.

The budget is split evenly across layers. Within a layer's slots, exact mode keeps the
first blocks (sinks, then a cache of far blocks) and a ring of the most recent blocks:

    layer slots:  [ front: blocks 0..P-1 (sinks + far cache) | window ring: W slots ]
    block b is resident  iff  b < P  or  b >= num_blocks - W
    window ring slot of block b >= P:  P + (b - P) % W

Blocks between the front and the window are streamed from the CPU tier through the
staging ring, a separate tensor of `num_regions x region_blocks` slots.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from tierkv.blocks import BlockLayout
from tierkv.config import ConfigError
from tierkv.units import format_bytes


@dataclass(frozen=True)
class ResidencyPlan:
    """Which blocks of a layer stay on the GPU (same for every layer)."""

    num_front_blocks: int   # P: sinks + far-block cache, kept from the start of the sequence
    num_window_blocks: int  # W: ring of the most recent blocks (includes the partial one)

    @property
    def slots_per_layer(self) -> int:
        return self.num_front_blocks + self.num_window_blocks

    def is_resident(self, block_index: int, num_blocks: int) -> bool:
        return block_index < self.num_front_blocks or block_index >= num_blocks - self.num_window_blocks

    def slot_of(self, block_index: int) -> int:
        """Local slot (within the layer) of a resident block."""
        if block_index < self.num_front_blocks:
            return block_index
        return self.num_front_blocks + (block_index - self.num_front_blocks) % self.num_window_blocks

    def streamed_range(self, num_blocks: int) -> range:
        """Blocks of a `num_blocks`-long sequence that are not resident."""
        return range(self.num_front_blocks, max(self.num_front_blocks, num_blocks - self.num_window_blocks))


def window_blocks_of(block_tokens: int, window_tokens: int) -> int:
    """GPU blocks per layer the recent window takes: its tokens, plus the block being filled."""
    return -(-window_tokens // block_tokens) + 1


def min_resident_blocks(block_tokens: int, sink_tokens: int, window_tokens: int) -> int:
    """The fewest GPU blocks per layer a hot window holds: its sink blocks and its window's."""
    return -(-sink_tokens // block_tokens) + window_blocks_of(block_tokens, window_tokens)


def plan_residency(layout: BlockLayout, num_layers: int, budget_bytes: int, sink_tokens: int, window_tokens: int) -> ResidencyPlan:
    """Split the budget; raises ConfigError when sinks + window do not fit."""
    slots_per_layer = budget_bytes // (layout.num_bytes * num_layers)
    window_blocks = window_blocks_of(layout.block_tokens, window_tokens)
    needed = min_resident_blocks(layout.block_tokens, sink_tokens, window_tokens)
    if slots_per_layer < needed:
        raise ConfigError(
            "cache.gpu_budget_bytes", budget_bytes,
            f"holds {slots_per_layer} blocks of {format_bytes(layout.num_bytes)} per layer for {num_layers} layers; "
            f"sinks + window need {needed} per layer (at least {format_bytes(needed * layout.num_bytes * num_layers)})",
        )
    return ResidencyPlan(num_front_blocks=slots_per_layer - window_blocks, num_window_blocks=window_blocks)


def staging_region_blocks(layout: BlockLayout, staging_bytes: int, num_regions: int) -> int:
    """Blocks in each of the staging ring's `num_regions` regions; ConfigError when fewer than one."""
    region_blocks = staging_bytes // (layout.num_bytes * num_regions)
    if region_blocks < 1:
        raise ConfigError(
            "scheduler.staging_bytes", staging_bytes,
            f"must hold at least {num_regions} blocks of {format_bytes(layout.num_bytes)} "
            f"({format_bytes(num_regions * layout.num_bytes)}), one per staging region",
        )
    return region_blocks


class GpuBlockPool:
    """Resident slots for every layer and the staging ring, allocated once on `device`."""

    def __init__(self, layout: BlockLayout, num_layers: int, residency: ResidencyPlan,
                 staging_bytes: int, num_regions: int, device: torch.device):
        self.layout = layout
        self.residency = residency
        self.num_layers = num_layers
        self.device = torch.device(device)
        self.region_blocks = staging_region_blocks(layout, staging_bytes, num_regions)
        self.num_regions = num_regions
        # resident: [num_layers, slots_per_layer, 2, num_kv_heads, block_tokens, head_dim]
        self.resident = torch.zeros((num_layers, residency.slots_per_layer, *layout.shape), dtype=layout.dtype, device=device)
        # staging: [num_regions * region_blocks, 2, num_kv_heads, block_tokens, head_dim]
        self.staging = torch.zeros((num_regions * self.region_blocks, *layout.shape), dtype=layout.dtype, device=device)

    @property
    def resident_bytes(self) -> int:
        """0 while no resident pool exists (a failed resize lost it; the next sequence rebuilds it)."""
        return 0 if self.resident is None else self.resident.numel() * self.resident.element_size()

    @property
    def staging_bytes(self) -> int:
        return self.staging.numel() * self.staging.element_size()

    def region_slots(self, region: int) -> range:
        start = region * self.region_blocks
        return range(start, start + self.region_blocks)


@contextmanager
def own_segments(device: torch.device | str):
    """Allocations made inside (in this thread, on a CUDA `device`) come from a pool of the caching allocator of
    their own: they share no segment with another tensor and take none another freed, so once they and the
    yielded pool are dropped, `torch.cuda.empty_cache()` hands all their bytes back to the driver. Buffers a
    run-time resize replaces are made so: the caching allocator packs tensors under 10 MiB into shared 20 MiB
    segments and carves big ones out of cached free segments, and a segment any live tensor still holds stays
    with the process. Yields the pool (None off CUDA): keep it as long as the tensors."""
    device = torch.device(device)
    if device.type != "cuda":
        yield None
        return
    index = device.index if device.index is not None else torch.cuda.current_device()  # ("cuda": the current one)
    try:
        with torch.cuda.device(index):
            pool = torch.cuda.MemPool()
    except RuntimeError:  # an allocator without pools (PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync frees itself)
        yield None
        return
    with torch.cuda.use_mem_pool(pool, device=index):
        yield pool
