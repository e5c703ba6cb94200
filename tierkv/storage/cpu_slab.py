"""The CPU tier's slab: what its block slots hold, the blocks as given or quantized.

Primitives: `CpuSlab`, `slot_num_bytes`.

    slab:    [num_slots, 2, H, T, D]  the KV dtype (bit-exact), or uint8 codes under a quant format
    scales:  [num_slots, 2, H] float32 under a quant format (per block, K/V and head), else None

Both live in host memory, pinned when asked (`tierkv.storage.pinned_slab`, which locks no more
host memory than the slab uses). Which key sits in which slot is the tier's business (`cpu`).
"""
from __future__ import annotations

from typing import Sequence

import torch

from tierkv.blocks import BlockLayout
from tierkv.quant import dequantize_blocks, quantize_blocks
from tierkv.storage.pinned_slab import allocate_slab


def slot_num_bytes(layout: BlockLayout, quant_format: str | None) -> int:
    """Bytes of one slot: a block in the KV dtype, or one byte per value plus its float32 scales."""
    if quant_format is None:
        return layout.num_bytes
    return layout.num_bytes // layout.dtype.itemsize + 2 * layout.num_kv_heads * 4


class CpuSlab:
    """num_slots block slots of `layout` in host memory; quant_format: None or a `tierkv.quant`
    format ("int8", "float8_e4m3fn"). Not thread-safe: the tier's lock guards every call."""

    def __init__(self, name: str, layout: BlockLayout, num_slots: int, quant_format: str | None, pin_memory: bool):
        self.layout, self.quant_format = layout, quant_format
        slab_dtype = layout.dtype if quant_format is None else torch.uint8
        self.slab = allocate_slab((num_slots, *layout.shape), slab_dtype, pin_memory, name)
        self.scales = (torch.empty((num_slots, 2, layout.num_kv_heads), dtype=torch.float32, pin_memory=pin_memory)
                       if quant_format is not None else None)  # fmt: skip

    def read(self, slots: Sequence[int]) -> torch.Tensor:
        """Blocks in the KV dtype: [len(slots), 2, H, T, D], a fresh tensor."""
        index = torch.as_tensor(list(slots), dtype=torch.int64)
        if self.quant_format is None:
            return self.slab.index_select(0, index)
        return dequantize_blocks(self.slab.index_select(0, index), self.scales.index_select(0, index),
                                 self.quant_format, self.layout.dtype)  # fmt: skip

    def write(self, slots: Sequence[int], blocks: torch.Tensor) -> None:
        """blocks [len(slots), 2, H, T, D] in the KV dtype -> the slots (quantized if the slab is)."""
        if self.quant_format is None:
            if len(slots) == 1:
                self.slab[slots[0]].copy_(blocks[0])
            else:
                self.slab.index_copy_(0, torch.as_tensor(list(slots), dtype=torch.int64), blocks)
            return
        index = torch.as_tensor(list(slots), dtype=torch.int64)
        codes, scales = quantize_blocks(blocks, self.quant_format)
        self.slab.index_copy_(0, index, codes)
        self.scales.index_copy_(0, index, scales)
