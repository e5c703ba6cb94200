"""A tier that stores its blocks, transformed, in another tier (quantized, sealed).

Primitives: `WrappedTier`: the inner tier's name, kind, capacity and counters, and the parts of the
tier contract that pass straight through (close, used_bytes, is_healthy, return_evicted).
Subclasses convert blocks on the way in and out.
"""
from __future__ import annotations

from tierkv.blocks import BlockLayout
from tierkv.storage.base import StorageTier


class WrappedTier(StorageTier):
    def __init__(self, inner: StorageTier, layout: BlockLayout):
        super().__init__(inner.name, layout, inner.capacity_bytes)
        self.inner = inner
        self.kind = inner.kind
        self.counters = inner.counters

    def close(self) -> None:
        self.inner.close()

    @property
    def used_bytes(self) -> int:
        return self.inner.used_bytes

    @property
    def is_healthy(self) -> bool:
        return self.inner.is_healthy

    @property
    def return_evicted(self) -> bool:
        return getattr(self.inner, "return_evicted", False)

    @return_evicted.setter
    def return_evicted(self, value: bool) -> None:
        if hasattr(self.inner, "return_evicted"):
            self.inner.return_evicted = value
