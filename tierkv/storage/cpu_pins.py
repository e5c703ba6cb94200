"""Who holds the CPU tier's blocks, and which block an eviction takes: per-key pins (readers and pending
writes), whole-block read pins (a block pinned in every layer with one count, not one per key), and the
least-recently-used walk that steps over both.

Primitives: `TierPins` (keys, blocks, pinned, unpin, lru_unpinned), `BlockPins` (pin, release, holds,
lower_bound_pinned_keys, second_chance, forget, clear). Used under the tier's lock by `CpuTier`; blocks are
the groups of `cpu_blocks.BlockLayers` (hash + rank suffix), all of whose `num_layers` keys are visible
when pinned whole.

    pins[group]    read pins of the whole block: none of its keys is evicted or replaced while > 0
    chances[group] after a release, which of its layers' keys (a bit per layer) an eviction walk still
                   moves to the recent end once instead of evicting (the keys were read until then; a
                   per-key acquire moves each key at once, which for a 100k-token prefix is 200k moves
                   on the critical path); a key leaving the tier takes its bit with it, so no key has
                   more than one chance (the walk's bound counts one per visible key)

A long repeated prefix is some 6k blocks of 32 layers: pinning it per block is 6k dict updates where
per key it is 200k lookups, LRU moves and pin counts.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Sequence

from tierkv.storage.cpu_blocks import BlockLayers


class TierPins:
    """keys: pins per key (a Counter the tier updates in C-level passes); blocks: whole-block pins, once
    the tier indexes its blocks (`CpuTier.index_blocks`)."""

    def __init__(self):
        self.keys: Counter[str] = Counter()
        self.blocks: BlockPins | None = None

    def pinned(self, key: str) -> bool:
        """Whether a reader or a pending write pins key, by its own pin or its whole block's."""
        return self.keys.get(key, 0) > 0 or (self.blocks is not None and self.blocks.holds(key))

    def unpin(self, key: str) -> None:
        """One pin of key given back (a key without a pin is left alone). Plain dict operations, not
        Counter arithmetic: a finished long request gives back some 50k pins."""
        count = self.keys.get(key, 0) - 1
        if count > 0:
            self.keys[key] = count
        else:
            self.keys.pop(key, None)

    def lru_unpinned(self, slot_of: OrderedDict, num_pending: int) -> str | None:
        """The least recently used unpinned key of `slot_of` (visible keys, LRU first), None if every
        one is pinned.

        Pinned blocks met on the way are in use, so they move to the recent end: a long-pinned run at
        the old end (the far blocks of a long request) is stepped over once, not on every eviction; so
        do keys of a block released after a whole-block read, once each (their second chance). When
        every visible key is pinned (each pinned key is visible or pending: the larger of the two
        counts is a lower bound), there is nothing to find: no walk, so a full tier of running
        requests' blocks refuses puts at once."""
        keys, whole = self.keys, self.blocks
        pinned = len(keys) - num_pending
        if whole is not None:
            pinned = max(pinned, whole.lower_bound_pinned_keys())
        if pinned >= len(slot_of):
            return None
        # each turn returns, or moves a pinned key, or uses up one of at most len(slot_of) second chances
        for _ in range(2 * len(slot_of) + 1):
            key = next(iter(slot_of))
            if keys.get(key, 0) <= 0 and not (whole is not None and (whole.holds(key) or whole.second_chance(key))):
                return key
            slot_of.move_to_end(key)
        return None


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
            chances[group] = (1 << n) - 1

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
        """Whether an eviction walk should move key to the recent end instead of evicting it (its one chance,
        used up)."""
        if not self.chances:
            return False
        where = self.index.locate(key)
        if where is None:
            return False
        group, layer = where
        left = self.chances.get(group, 0)
        if not left >> layer & 1:
            return False
        self._drop_chance(group, left, layer)
        return True

    def forget(self, key: str) -> None:
        """key left the tier: it takes its chance with it (a released block held every layer, so its chances
        are gone once no layer of it is held)."""
        if self.chances:
            where = self.index.locate(key)
            if where is not None and where[0] in self.chances:
                self._drop_chance(where[0], self.chances[where[0]], where[1])

    def _drop_chance(self, group: str, left: int, layer: int) -> None:
        left &= ~(1 << layer)
        if left:
            self.chances[group] = left
        else:
            del self.chances[group]

    def clear(self) -> None:
        self.pins.clear()
        self.chances.clear()
        self._pinned_keys = 0
