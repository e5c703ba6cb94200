"""A tier that stores its blocks, transformed, in another tier (quantized, sealed).

Primitives: `WrappedTier`: the inner tier's name, kind, capacity and counters, the parts of the
tier contract that pass straight through (close, used_bytes, held_capacity_bytes, is_healthy, down_nodes,
return_evicted), the
one-key forms on top of the batched ones, and `_check_put`. Subclasses convert blocks on the way
in and out in `get_many`, `put_many`, `contains_many` and `remove_many`.
"""
from __future__ import annotations

from typing import Sequence

import torch

from tierkv.blocks import BlockLayout
from tierkv.storage.base import PutResult, StorageTier


class WrappedTier(StorageTier):
    def __init__(self, inner: StorageTier, layout: BlockLayout):
        super().__init__(inner.name, layout, inner.capacity_bytes)
        self.inner = inner
        self.kind = inner.kind
        self.counters = inner.counters

    def get(self, key: str) -> torch.Tensor | None:
        return self.get_many([key])[0]

    def contains(self, key: str) -> bool:
        return self.contains_many([key])[0]

    def put(self, key: str, block: torch.Tensor) -> PutResult:
        return self.put_many([key], [block])[0]

    def remove(self, key: str) -> bool:
        return self.remove_many([key])[0]

    def _check_put(self, keys: Sequence[str], blocks: Sequence[torch.Tensor]) -> None:
        """All of a put_many's blocks checked before the first is converted or written."""
        if len(keys) != len(blocks):
            raise ValueError(f"put_many: {len(keys)} keys but {len(blocks)} blocks")
        for key, block in zip(keys, blocks):
            self._check_block(key, block)

    def close(self) -> None:
        self.inner.close()

    @property
    def used_bytes(self) -> int:
        return self.inner.used_bytes

    @property
    def held_capacity_bytes(self) -> int | None:
        return self.inner.held_capacity_bytes

    @property
    def is_healthy(self) -> bool:
        return self.inner.is_healthy

    @property
    def down_nodes(self) -> list[str]:
        return self.inner.down_nodes

    @property
    def return_evicted(self) -> bool:
        return getattr(self.inner, "return_evicted", False)

    @return_evicted.setter
    def return_evicted(self, value: bool) -> None:
        if hasattr(self.inner, "return_evicted"):
            self.inner.return_evicted = value
