"""The CPU tier's slot-level two-phase API, what the GPU transfer engine copies through.

Primitives: `CpuSlotAccess` (prepare_put, prepared_put, complete_put, abort_put, acquire, release,
acquire_blocks, release_blocks), a mixin of `cpu.CpuTier`: its methods run under the tier's lock on the
tier's own index, pins and counters; `PreparedPut`, what `prepared_put` gives its `with` block.

    slots = tier.prepare_put(keys)   # allocate slots, pinned: not evictable, not yet visible
    ... D2H scatter into tier.slab[slots] ...
    tier.complete_put(keys)          # visible to lookups, unpinned
    with tier.prepared_put(keys) as put:   # the same, and whatever is still pending when the block ends
        ...                                # (an exception, a Ctrl-C, a refusal) is given back, unless
        put.complete()                     # completed or handed over (put.hand_over) to an owner who completes it
    slots = tier.acquire(keys)       # pin existing blocks while an H2D gather reads them
    tier.release(keys)
    rows = tier.acquire_blocks(groups)   # [blocks, layers] slots, each block pinned whole (cpu_pins)
    tier.release_blocks(groups)

Latency samples (the tier's `counters`, one per batched call): "get" = acquire (and acquire_blocks),
"put" = prepare_put + complete_put; the copies the transfer engine runs between them are transfer
time, not tier time.
"""
from __future__ import annotations

import time
from collections import deque
from contextlib import contextmanager
from itertools import repeat
from typing import TYPE_CHECKING, Iterator, Sequence

import torch

if TYPE_CHECKING:
    import numpy as np


class CpuSlotAccess:
    """The two-phase slot API of `CpuTier`, which holds the state it reads: `_lock`, `_slot_of` (visible
    blocks, LRU first), `_pending`, `_prepare_s`, `_pins`, `_pin_state`, `_free_slots`, `_blocks`,
    `counters`, `slot_bytes`, and the internals `_allocate`, `_reclaim_lost_slots` and `_unpin`."""

    def prepare_put(self, keys: Sequence[str]) -> tuple[list[int | None], list[tuple[str, torch.Tensor | None]]]:
        """Allocate a pinned slot per key (None where no slot is free); returns (slots, evicted).
        An exception part-way (a KeyboardInterrupt between two keys) gives back the slots it took."""
        slots: list[int | None] = []
        evicted: list[tuple[str, torch.Tensor]] = []
        start = time.perf_counter()
        with self._lock:
            pending, slot_of, free, pins = self._pending, self._slot_of, self._free_slots, self._pins
            was_pending = pending.keys() & keys
            try:
                one_by_one: Sequence[str] = keys
                if self._fresh_with_room(keys):  # a save of new blocks into free slots: C-level passes
                    slots = free[len(free) - len(keys):][::-1]  # popped from the end, in key order
                    pending.update(zip(keys, slots))
                    del free[len(free) - len(keys):]
                    pins.update(keys)
                    one_by_one = ()
                for key in one_by_one:
                    if free and key not in pending and key not in slot_of:  # the common case, as _allocate does it
                        slot = pending[key] = free[-1]  # pending before it leaves the free list: an interrupt
                        del free[-1]                    # between the two leaves it in both (_give_back)
                        pins[key] += 1
                        slots.append(slot)
                        continue
                    result = self._allocate(key)
                    evicted.extend(result.evicted)
                    slots.append(self._pending[key] if result.ok else None)
                elapsed = time.perf_counter() - start
                self._prepare_s.update((k, elapsed) for k, s in zip(keys, slots) if s is not None)
            except BaseException:
                self._give_back([k for k in dict.fromkeys(keys) if k in pending and k not in was_pending])
                self._reclaim_lost_slots()  # one taken and not yet recorded pending (Ctrl-C in `_take_slot`)
                raise
        self.counters.add(evictions=len(evicted))
        return slots, evicted

    @contextmanager
    def prepared_put(self, keys: Sequence[str]) -> Iterator["PreparedPut"]:
        """prepare_put(keys) for a `with` block, which completes the slots (`put.complete`) or hands them over
        (`put.hand_over`). Otherwise, when the block ends (a refusal, an exception, a KeyboardInterrupt), the
        slots it took that are still pending are given back, once `put.copy` (a copy the block enqueued into
        them) has ended."""
        put, took = PreparedPut(self, keys), {}
        try:
            put.slots, put.evicted = self.prepare_put(keys)  # raising, it gives back what it took itself
            # the slots it took (a key pending before it is refused one): the give-back touches no other writer's
            took = {k: s for k, s in zip(keys, put.slots) if s is not None}
            yield put
        finally:
            if took and not put.is_handed_over:
                if put.copy is not None:
                    put.copy.synchronize()  # the copy into the slots ends before they are given back
                with self._lock:  # still pending in the slot it took (a key refused here may be another's now)
                    self._give_back([k for k, s in took.items() if self._pending.get(k) == s])

    def _give_back(self, keys: Sequence[str]) -> None:
        """Pending `keys` aborted, their slots free again (a slot the fast path listed as pending but had not yet
        taken off the free list stays there): what a prepare_put that raised part-way, or a `prepared_put` block
        that ended with slots pending, took. Lock held."""
        free = set(self._free_slots)
        for key in keys:
            slot = self._pending.pop(key)
            if slot not in free:
                self._free_slots.append(slot)
            self._prepare_s.pop(key, None)
            self._unpin(key)

    def _fresh_with_room(self, keys: Sequence[str]) -> bool:
        """Whether every key is new (neither pending nor visible), listed once, and a free slot waits for
        each: then `prepare_put` takes slots from the free list's end, as its per-key loop would. Lock held."""
        return (len(keys) <= len(self._free_slots) and self._pending.keys().isdisjoint(keys)
                and self._slot_of.keys().isdisjoint(keys) and len(set(keys)) == len(keys))

    def complete_put(self, keys: Sequence[str], *, keep_pinned: bool = False) -> None:
        """Make prepared blocks visible (their bytes are now in the slab); unpin unless `keep_pinned`.
        Records one "put" latency sample: this call's time plus its batch's prepare_put time."""
        start = time.perf_counter()
        with self._lock:
            prepared_s = max(map(self._prepare_s.pop, keys), default=None)
            self._slot_of.update(zip(keys, map(self._pending.pop, keys)))  # in key order, as one by one
            if not keep_pinned:
                for key in keys:
                    self._unpin(key)
            if self._blocks is not None:
                self._blocks.add_many(zip(keys, map(self._slot_of.__getitem__, keys)))
        if prepared_s is not None:
            self.counters.observe_latency("put", prepared_s + time.perf_counter() - start)
        self.counters.add(puts=len(keys), bytes_written=len(keys) * self.slot_bytes)

    def abort_put(self, keys: Sequence[str]) -> None:
        """Give back prepared slots whose bytes were never written; the keys stay absent."""
        with self._lock:
            for key in keys:
                self._free_slots.append(self._pending.pop(key))
                self._prepare_s.pop(key, None)
                self._unpin(key)

    def acquire(self, keys: Sequence[str]) -> list[int | None]:
        """Slots of visible blocks, pinned until `release`; None for a miss. Counts lookups.
        Hits become the most recently used blocks, in key order (a key listed twice is pinned twice).
        A long prefix pins some 200k keys per request: lookups, LRU bumps and pin counts are C-level
        passes (`map`, `Counter.update`). Records one "get" latency sample for the batch."""
        start = time.perf_counter()
        with self._lock:
            slot_of = self._slot_of
            slots = list(map(slot_of.get, keys))
            hits = keys if None not in slots else [k for k, s in zip(keys, slots) if s is not None]
            deque(map(slot_of.move_to_end, hits), maxlen=0)  # LRU bump, in key order
            self._pins.update(hits)  # Counter.update counts an iterable in C
            num_hits = len(hits)
        self.counters.observe_latency("get", time.perf_counter() - start)
        self.counters.record_lookups(num_hits, len(keys) - num_hits, num_hits * self.slot_bytes)
        return slots

    def release(self, keys: Sequence[str]) -> None:
        """One pin of each key given back (a key without a pin is left alone; a key listed twice
        gives back two). One C-level pass pops every count: exact when none was above one, a key
        listed twice included (its second pop finds nothing, as its second unpin would). Else the
        counts go back and the keys are unpinned one by one."""
        with self._lock:
            pins = self._pins
            counts = list(map(pins.pop, keys, repeat(0)))
            if max(counts, default=0) > 1:
                for key, count in zip(keys, counts):
                    if count:  # a key listed twice: its first pop holds the count
                        pins[key] = count
                for key in keys:
                    self._unpin(key)

    def acquire_blocks(self, groups: Sequence[str]) -> "np.ndarray | None":
        """Slots [len(groups), num_layers] of blocks visible in every layer (`index_blocks`; a group is a
        block hash plus its key suffix), each block pinned whole until `release_blocks`; None, with
        nothing pinned, when the index is off or some block is not held in every layer (use
        `acquire`). One probe and one count per block, not per key; its keys count as hits, and as
        used when released (`cpu_pins`)."""
        start = time.perf_counter()
        with self._lock:
            rows = self._blocks.slot_rows(groups) if self._blocks is not None else None
            if rows is None:
                return None
            self._pin_state.blocks.pin(groups)
        self.counters.observe_latency("get", time.perf_counter() - start)
        self.counters.record_lookups(rows.size, 0, rows.size * self.slot_bytes)
        return rows

    def release_blocks(self, groups: Sequence[str]) -> None:
        """One whole-block pin of each group given back (a group without one is left alone)."""
        with self._lock:
            if self._pin_state.blocks is not None:
                self._pin_state.blocks.release(groups)


class PreparedPut:
    """Slots `CpuSlotAccess.prepared_put` reserved for `keys`: `slots` (None where the tier had none) and
    `evicted`, as prepare_put returns them; pending and pinned until completed or handed over. `copy`: a copy
    the caller enqueued into the slots (anything with `synchronize()`), waited for before a give-back."""

    def __init__(self, tier: CpuSlotAccess, keys: Sequence[str]):
        self.tier, self.keys = tier, keys
        self.slots: list[int | None] = []
        self.evicted: list[tuple[str, torch.Tensor | None]] = []
        self.copy = None
        self._is_completed = False
        self._record: list | None = None
        self._entry: object = None

    def complete(self, *, keep_pinned: bool = False) -> None:
        """tier.complete_put(keys): every key got a slot and its bytes are written."""
        self.tier.complete_put(self.keys, keep_pinned=keep_pinned)
        self._is_completed = True

    def hand_over(self, record: list, entry: object) -> None:
        """Append `entry` to `record`, whose owner completes (or gives back) these slots later. The append is the
        hand-over: `is_handed_over` looks for the entry, so an interrupt just after it gives nothing back."""
        self._record, self._entry = record, entry
        record.append(entry)

    @property
    def is_handed_over(self) -> bool:
        if self._is_completed:
            return True
        return self._record is not None and any(entry is self._entry for entry in reversed(self._record))
