"""A disk or Redis tier that stores blocks quantized (int8 or fp8 e4m3 with per-head scales).

Primitives: `QuantizedTier`.

    put:  blocks [2, H, T, D] (KV dtype) --pack_blocks--> [2, H, T + 1, D] codes --> inner tier
    get:  inner tier --> packed --unpack_blocks--> blocks in the KV dtype

The inner tier is an ordinary DiskTier or RedisTier built with the packed layout, so its
checksums, crash safety, capacity (about twice the blocks per byte) and health handling are
unchanged; its counters are this tier's counters and count the bytes actually stored. Blocks
it evicts are unpacked before they travel down the chain.
"""
from __future__ import annotations

from typing import Sequence

import torch

from tierkv.blocks import BlockLayout
from tierkv.quant import pack_blocks, packed_layout, unpack_blocks
from tierkv.storage.base import PutResult, StorageTier
from tierkv.storage.wrapped import WrappedTier


class QuantizedTier(WrappedTier):
    def __init__(self, inner: StorageTier, layout: BlockLayout, quant_format: str):
        if inner.layout != packed_layout(layout, quant_format):
            raise ValueError(f"{inner.name}: inner layout {inner.layout} is not the packed {quant_format} form of {layout}")
        super().__init__(inner, layout)
        self.quant_format = quant_format

    # -- conversions ------------------------------------------------------------------------
    def _unpack(self, packed: torch.Tensor) -> torch.Tensor:
        return unpack_blocks(packed, self.quant_format, self.layout.dtype)

    def _unpacked_evictions(self, result: PutResult) -> PutResult:
        packed = [(k, b) for k, b in result.evicted if b is not None]  # None: no tier below, only counted
        if packed:
            blocks = iter(self._unpack(torch.stack([b for _, b in packed])).unbind(0))
            result.evicted = [(k, None if b is None else next(blocks)) for k, b in result.evicted]
        return result

    # -- StorageTier contract -----------------------------------------------------------------
    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        return self.inner.contains_many(keys)

    def get_many(self, keys: Sequence[str]) -> list[torch.Tensor | None]:
        found = self.inner.get_many(keys)
        hits = [i for i, b in enumerate(found) if b is not None]
        if not hits:
            return found
        blocks = self._unpack(torch.stack([found[i] for i in hits])).unbind(0)
        out: list[torch.Tensor | None] = [None] * len(keys)
        for i, block in zip(hits, blocks):
            out[i] = block
        return out

    def put_many(self, keys: Sequence[str], blocks: Sequence[torch.Tensor]) -> list[PutResult]:
        self._check_put(keys, blocks)
        if not keys:
            return []
        packed = pack_blocks(torch.stack(list(blocks)).cpu(), self.quant_format)
        return [self._unpacked_evictions(r) for r in self.inner.put_many(keys, list(packed.unbind(0)))]

    def remove_many(self, keys: Sequence[str]) -> list[bool]:
        return self.inner.remove_many(keys)

    def __repr__(self) -> str:
        return f"QuantizedTier({self.quant_format}, {self.inner!r})"
