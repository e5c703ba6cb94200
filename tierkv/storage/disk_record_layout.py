"""What a disk record's header names as its block's layout, and which records a tier takes as its own.

Primitives: `RecordLayout`.

A plain tier's records name its layout's dtype and shape. A sealed tier stores flat uint8 blocks whose shape
depends only on their byte size, so bf16 and fp16 blocks of one shape seal alike; its records also name the
layout that was sealed, in the dtype field, so that two models' sealed tiers on one directory (the default
path is one for every model, the secret one per user) tell each other's records apart as plain tiers do
(disk_index: another layout's records are kept, outside the tier's capacity, never evicted by it):

    tier                       dtype field                          shape field
    plain                      "bfloat16"                           (2, H, T, D)
    sealed                     "uint8;sealed bfloat16 2x2x16x64"    (2, 1, 1, S / 2)
    sealed, written untagged   "uint8"                              (2, 1, 1, S / 2)

Untagged sealed records (written before the tag existed) are still taken as the tier's own, as they were:
an upgrade keeps its blocks, and they age out through the LRU. Which model sealed one cannot be told without
opening it, so another model's untagged record may be evicted too; SealedTier drops an evicted block it cannot
open without reporting it. A version without the tag reads a tagged record as another layout's: kept, unread.
"""
from __future__ import annotations

from tierkv.blocks import BlockLayout, dtype_name
from tierkv.storage.auth import SealedLayout


class RecordLayout:
    """The dtype and shape fields a tier of `layout` writes, and those it reads as its own."""

    def __init__(self, layout: BlockLayout):
        self.shape = tuple(layout.shape)
        self.dtype_name = dtype_name(layout.dtype)
        own = {self.dtype_name}
        if isinstance(layout, SealedLayout):
            sealed = layout.sealed_from
            self.dtype_name += f";sealed {dtype_name(sealed.dtype)} {'x'.join(map(str, sealed.shape))}"
            own.add(self.dtype_name)
        self._own_dtype_names = frozenset(own)

    def is_own(self, dtype_name: str, shape: tuple[int, ...]) -> bool:
        """Whether a record whose header names this dtype and shape holds one of this tier's blocks."""
        return shape == self.shape and dtype_name in self._own_dtype_names
