"""The tier chain's promotions: blocks found below the first (CPU) tier copied up into it, for a lookup or into
slots pinned for a reader.

Primitives: `ChainPromotion` (acquire_many, acquire_available), a mixin of `chain.TierChain`:

    slots = chain.acquire_many(keys)       # every key pinned in tier 0 (lower hits promoted), or None
    slots = chain.acquire_available(keys)  # what can be pinned: None per key no tier gives back readable
    chain.tiers[0].release([k for k, s in zip(keys, slots) if s is not None])

A promotion into pinned slots goes through the first tier's `prepared_put`: a refusal, an exception or a
Ctrl-C gives its slots back.
"""
from __future__ import annotations

from typing import Sequence

import torch


class ChainPromotion:
    """The promotions of `TierChain`, which holds the state they use: `tiers`, `_lock`, `num_promoted`, and its
    `get_many` and `spill`."""

    def _promote(self, keys: list[str], blocks: list[torch.Tensor]) -> None:
        """get_many's lower-tier hits into tier 0, unpinned; its evictions spill."""
        results = self.tiers[0].put_many(keys, blocks)
        for result in results:
            self.spill(0, result.evicted)
        with self._lock:
            self.num_promoted += sum(r.ok for r in results)

    def acquire_many(self, keys: Sequence[str]) -> list[int] | None:
        """Pin every key in the first (CPU) tier, promoting lower-tier blocks into pinned slots.

        Blocks already in the first tier are pinned before any promotion, so promotions cannot
        evict them. Returns their slots (release them with `tiers[0].release`), or None with
        nothing left pinned when some block is in no tier (or none could give it back readable).
        """
        slots = self.acquire_available(keys)
        if None in slots:
            self.tiers[0].release([k for k, s in zip(keys, slots) if s is not None])
            return None
        return slots

    def acquire_available(self, keys: Sequence[str]) -> list[int | None]:
        """As `acquire_many`, but pins what it can: a slot per key some tier gave back readable, None
        for a key no tier holds any more or whose block failed its checks there (counted by that tier,
        and dropped), or every lower-tier key when the first tier cannot hold them all pinned. The
        caller releases the slots it got (`tiers[0].release`)."""
        first = self.tiers[0]
        slots: list[int | None] = list(first.acquire(keys))
        lower = [i for i, s in enumerate(slots) if s is None]
        if not lower:  # all in the first tier: the usual case
            return slots
        try:
            return self._acquire_lower(keys, slots, lower)
        except BaseException:  # the pins taken above would otherwise hold their slots for good
            first.release([k for k, s in zip(keys, slots) if s is not None])
            raise

    def _acquire_lower(self, keys: Sequence[str], slots: list[int | None], lower: list[int]) -> list[int | None]:
        """acquire_available's promotions of the keys at `lower` (tier 0 missed them) into pinned slots."""
        first = self.tiers[0]
        blocks = self.get_many([keys[i] for i in lower], promote=False, start=1)  # tier 0 just missed them
        readable = [(i, b) for i, b in zip(lower, blocks) if b is not None]
        if not readable:
            return slots
        readable_keys = [keys[i] for i, _ in readable]
        with first.prepared_put(readable_keys) as put:  # given back unless completed (a refusal, a Ctrl-C)
            self.spill(0, put.evicted)
            if None in put.slots:
                return slots
            first.write_slots(put.slots, torch.stack([b for _, b in readable]))
            for (i, _), slot in zip(readable, put.slots):
                slots[i] = slot
            put.complete(keep_pinned=True)
        with self._lock:
            self.num_promoted += len(readable_keys)
        return slots
