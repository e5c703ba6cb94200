"""Whole-block read pins of the CPU tier: a block pinned in every layer with one count, not one per key.

Primitives: `BlockPins` (pin, release, holds, lower_bound_pinned_keys, second_chance, forget, clear). Used
under the tier's lock by `CpuTier.acquire_blocks` / `release_blocks`; blocks are the groups of
`cpu_blocks.BlockLayers` (hash + rank suffix), all of whose `num_layers` keys are visible when pinned.

    pins[group]    read pins of the whole block: none of its keys is evicted or replaced while > 0
    chances[group] after a release, how many of its keys an eviction walk still moves to the recent
                   end instead of evicting (the keys were read until then; a per-key acquire moves
                   each key at once, which for a 100k-token prefix is 200k moves on the critical path)

A long repeated prefix is some 6k blocks of 32 layers: pinning it per block is 6k dict updates where
per key it is 200k lookups, LRU moves and pin counts.
"""
from __future__ import annotations

from typing import Sequence

from tierkv.storage.cpu_blocks import BlockLayers


class BlockPins:
    def __init__(self, index: BlockLayers):
        self.index = index
        self.pins: dict[str, int] = {}
        self.chances: dict[str, int] = {}
        self._pinned_keys = 0  # num_layers per pinned block: visible keys the pins hold (see lower_bound...)

    def pin(self, groups: Sequence[str]) -> None:
        """One pin of each block (a block listed twice is pinned twice)."""
        pins, n = self.pins, self.index.num_layers
        for group in groups:
            count = pins.get(group, 0)
            if not count:
                self._pinned_keys += n
            pins[group] = count + 1

    def release(self, groups: Sequence[str]) -> None:
        """One pin of each block given back (a block without a pin is left alone); its keys get their
        second chance against eviction."""
        pins, chances, n = self.pins, self.chances, self.index.num_layers
        for group in groups:
            count = pins.get(group, 0)
            if count <= 0:
                continue
            if count == 1:
                del pins[group]
                self._pinned_keys -= n
            else:
                pins[group] = count - 1
            chances[group] = n

    def holds(self, key: str) -> bool:
        """Whether key's block is pinned whole."""
        if not self.pins:
            return False
        group = self.index.group(key)
        return group is not None and self.pins.get(group, 0) > 0

    def lower_bound_pinned_keys(self) -> int:
        """At most the visible keys these pins hold: a block's keys are all visible when it is pinned
        and none leaves while it is (they may also hold key pins: the tier takes the larger count)."""
        return self._pinned_keys

    def second_chance(self, key: str) -> bool:
        """Whether an eviction walk should move key to the recent end instead of evicting it (and use
        up one of its block's chances)."""
        if not self.chances:
            return False
        group = self.index.group(key)
        left = self.chances.get(group, 0) if group is not None else 0
        if not left:
            return False
        if left == 1:
            del self.chances[group]
        else:
            self.chances[group] = left - 1
        return True

    def forget(self, key: str) -> None:
        """key left the tier: drop its block's chances once no layer of it is held."""
        if self.chances:
            group = self.index.group(key)
            if group is not None and group not in self.index.counts:
                self.chances.pop(group, None)

    def clear(self) -> None:
        self.pins.clear()
        self.chances.clear()
        self._pinned_keys = 0
