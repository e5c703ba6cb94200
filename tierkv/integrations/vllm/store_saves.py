"""A step's saves out of vLLM's paged cache into the CPU tier, and the pins of landed saves.

Primitives: `LayerSaves`. No vLLM import.

    save_layers(layers, kvs, spans)   kv_cache[block_ids] --copy on the compute stream--> private
                                      [len(layers), n, 2, H, T, D] --D2H on the copy stream-->
                                      CPU-tier slots (prepared, pinned)
    poll()                            once the copy has landed: the slots become visible to lookups
                                      and are written through to the tiers below

The private copy means vLLM may free or reuse a saved block as soon as the forward returns. In-flight
save bytes are bounded by `scheduler.staging_bytes`; past it the oldest save is waited for. A block
the CPU tier refuses (every slot pinned, or the block is being written) goes to the tiers below.

Under the hot window (`keep_pinned`), landed saves (and landed loads' window blocks, `keep_pins`) stay
pinned in the CPU tier until the far-block reader takes the pins over (`pin_for_reader`: the blocks become far) or gives them back
(`release_pins`: its request ends), so a block that becomes far is never pinned twice. A far block
pinned whole (`pin_blocks_for_reader`) gives its landed saves' per-key pins back at once.
"""
from __future__ import annotations

import time
from itertools import repeat
from typing import Sequence

import torch

from tierkv.integrations.vllm.paged_layout import BlockSpan
from tierkv.storage.cpu_blocks import block_group
from tierkv.transfer.device import to_device_no_sync


class LayerSaves:
    """The saves of a `VllmKVStore` (a worker's): reads its keys, tiers, block I/O and paged layout;
    counts blocks_saved and save_fallbacks in its counts. lock: the store's, held where the tiers
    are touched."""

    def __init__(self, store, lock):
        self.store, self._lock = store, lock
        self.max_inflight_bytes = store.config.scheduler.staging_bytes
        self._pending: list[tuple[object, list[str], int, list[int]]] = []  # (handle, keys, bytes, slots)
        self.keep_pinned = False  # set by the hot window's far-block reader
        self._pins: dict[str, int] = {}  # landed saves kept pinned: key -> CPU-tier slot
        self._pin_blocks: dict[str, int] = {}  # block (hash + suffix) -> its keys in _pins
        self.host_s = [0.0, 0.0]  # save_layers' host seconds since the caller last took them: reads, tier

    def save_layers(self, layers: Sequence[int], kvs: Sequence[torch.Tensor],
                    spans: Sequence[BlockSpan]) -> torch.Tensor | None:
        """Copy this step's full blocks of `layers` out of vLLM's caches (`kvs`, one per layer) and
        start their D2H: one read per layer, then one slot reservation and one D2H for all of them.
        Returns the private copy [len(layers), n, 2, H, T, D], None if the spans hold no block."""
        if len(kvs) != len(layers):
            raise ValueError(f"save_layers: {len(layers)} layers but {len(kvs)} KV caches; one cache per layer")
        block_ids = [b for s in spans for b in s.block_ids]
        if not block_ids or not layers:
            return None
        store = self.store
        hashes = [h for s in spans for h in s.hashes]
        keys = [key for layer in layers for key in store.keys(hashes, layer)]   # layer-major, as the blocks
        started = time.perf_counter()
        ids = to_device_no_sync(block_ids, kvs[0].device)
        if len(kvs) == 1:
            blocks = store.paged.read(kvs[0], ids).unsqueeze(0)                # private copy, compute stream
        else:
            blocks = store.paged.read_layers(kvs, ids)
        flat = blocks.flatten(0, 1)
        read = time.perf_counter()
        self.host_s[0] += read - started
        self._start_d2h(keys, flat)
        self._bound_inflight()
        self.host_s[1] += time.perf_counter() - read
        return blocks

    def _start_d2h(self, keys: list[str], flat: torch.Tensor) -> None:
        """flat [len(keys), 2, H, T, D] into prepared CPU-tier slots, given back if anything stops this before the
        copy is in `_pending` (`CpuSlotAccess.prepared_put`); blocks refused a slot to the tiers below.
        Under the hot window a block the CPU tier holds already is pinned for the saving request, as a landed
        save's (`keep_pins`), and not written again (a rewrite would take it out of the tier until it lands)."""
        store = self.store
        with self._lock:
            if self.keep_pinned:
                keys, flat = self._pin_held(keys, flat)
                if not keys:
                    return
            with store.cpu.prepared_put(keys) as put:  # given back unless handed over (an exception, a Ctrl-C)
                store.chain.spill(0, put.evicted)
                slots = put.slots
                ok = [i for i, s in enumerate(slots) if s is not None]
                refused = [i for i, s in enumerate(slots) if s is None]
                if ok:
                    chosen = flat if len(ok) == len(keys) else flat[torch.tensor(ok, device=flat.device)]
                    put.copy = store.io.scatter(chosen, torch.tensor([slots[i] for i in ok], dtype=torch.int64))
                    put.hand_over(self._pending, (put.copy, [keys[i] for i in ok], len(ok) * store.layout.num_bytes,
                                                  [slots[i] for i in ok]))  # fmt: skip
                    store.counts["blocks_saved"] += len(ok)
        if refused:  # every CPU slot pinned or the block is being written: hand it to the tiers below
            store.counts["save_fallbacks"] += len(refused)
            index = torch.tensor(refused, device=flat.device)
            results = store.chain.put_many([keys[i] for i in refused], list(flat.index_select(0, index).cpu()), start=1)
            failed = [keys[i] for i, result in zip(refused, results) if not result.ok]
            if failed:  # no tier below took them (full, down): lost unless the CPU tier holds or is writing them
                store.counts["saves_dropped"] += store.cpu.held_or_written(failed).count(False)

    def _pin_held(self, keys: list[str], flat: torch.Tensor) -> tuple[list[str], torch.Tensor]:
        """Pin the blocks among `keys` the CPU tier holds for the saving request (kept until they turn far or
        the request ends); returns the others and their rows of `flat`. Lock held."""
        cpu = self.store.cpu
        found = cpu.contains_many(keys)  # no lookup counted: most saves are of new blocks
        if not any(found):
            return keys, flat
        held = [i for i, f in enumerate(found) if f]
        slots = cpu.acquire([keys[i] for i in held])
        pinned = [(keys[i], slot) for i, slot in zip(held, slots) if slot is not None]
        if not pinned:
            return keys, flat
        self.keep_pins([k for k, _ in pinned], [slot for _, slot in pinned])
        taken = {k for k, _ in pinned}
        rest = [i for i, key in enumerate(keys) if key not in taken]
        return [keys[i] for i in rest], flat.index_select(0, torch.tensor(rest, dtype=torch.int64, device=flat.device))

    def land(self, groups: Sequence[str]) -> bool:
        """Wait for the saves in flight of blocks `groups` (block names, `block_group`) and make every landed
        save visible; False, with nothing waited for, when none of theirs is in flight. Others' saves and
        the loads are not waited for."""
        with self._lock:
            wanted = set(groups)
            theirs = [p for p in self._pending if not wanted.isdisjoint(map(block_group, p[1]))]
            for handle, *_ in theirs:
                handle.synchronize()
            if theirs:
                self.poll(wait=False)
            return bool(theirs)

    def _bound_inflight(self) -> None:
        while sum(p[2] for p in self._pending) > self.max_inflight_bytes and len(self._pending) > 1:
            self._pending[0][0].synchronize()
            self.store.poll()

    def poll(self, wait: bool) -> None:
        """Make landed saves visible (all of them when `wait`). Caller holds the store's lock."""
        still = []
        for pending in self._pending:
            handle, keys, _, slots = pending
            if wait:
                handle.synchronize()
            if wait or handle.is_done():
                self.store.cpu.complete_put(keys, keep_pinned=self.keep_pinned)
                self.store.chain.write_through(keys)
                if self.keep_pinned:
                    self.keep_pins(keys, slots)
            else:
                still.append(pending)
        self._pending = still

    # -- pins of landed saves (hot window) ---------------------------------------------------------
    def keep_pins(self, keys: Sequence[str], slots: Sequence[int]) -> None:
        """Hold the caller's CPU-tier pins of `keys` (at `slots`: a landed save's, or a landed load's window blocks)
        until the far reader takes them or their request ends: one pin per key is held, a key already held gives
        the caller's pin back. Lock held."""
        pins, new, extra = self._pins, [], []
        for key, slot in zip(keys, slots):  # a key twice in `keys` (two requests loading one block) holds one pin
            if key in pins:
                extra.append(key)
            else:
                pins[key] = slot
                new.append(key)
        self._count_blocks(new, 1)
        if extra:
            self.store.cpu.release(extra)

    def take_pins(self, keys: Sequence[str]) -> list[int | None]:
        """Slots of landed saves still pinned for the caller, who now owns the pins; None elsewhere."""
        with self._lock:
            pins = self._pins
            if not pins:
                return [None] * len(keys)
            slots = list(map(pins.pop, keys, repeat(None)))
            self._count_blocks([k for k, s in zip(keys, slots) if s is not None], -1)
            return slots

    def pin_for_reader(self, keys: Sequence[str]) -> list[int] | None:
        """CPU-tier slots of `keys`, pinned for a reader who gives them back with `unpin`: pins of
        landed saves taken over, the rest pinned (promoted from lower tiers if needed). None, with
        nothing pinned, if some block is in no tier (a save still in flight: `poll(wait=True)`)."""
        slots = self.take_pins(keys)
        if slots.count(None) == len(slots):  # none taken over (a repeated prefix's far blocks): pin them all
            with self._lock:
                return self.store.chain.acquire_many(keys)
        rest = [i for i, s in enumerate(slots) if s is None]
        if not rest:
            return slots
        with self._lock:
            acquired = self.store.chain.acquire_many([keys[i] for i in rest])
            if acquired is None:  # hand the taken pins back, unchanged
                taken = [(k, s) for k, s in zip(keys, slots) if s is not None]
                self._pins.update(taken)
                self._count_blocks([k for k, _ in taken], 1)
                return None
        for i, slot in zip(rest, acquired):
            slots[i] = slot
        return slots

    def pin_blocks_for_reader(self, groups: Sequence[str], hashes: Sequence[str]):
        """CPU-tier slots [len(groups), layers] of whole blocks `groups` (the names of blocks `hashes`;
        `CpuTier.acquire_blocks`: one pin per block, given back with `unpin_blocks`); None, nothing pinned,
        when some block is not in the CPU tier in every layer (then `pin_for_reader`, key by key). Landed
        saves of these blocks still pinned key by key give their pins back once the whole-block pin holds
        the block: a request's far blocks are then released with one count per block at its finish, not
        one per key (some 200k keys for a 100k-token prefix, on the next request's first step)."""
        acquire = getattr(self.store.cpu, "acquire_blocks", None)
        if acquire is None:
            return None
        with self._lock:
            rows = acquire(groups)
            if rows is not None and self._pin_blocks:
                saved = self._pin_blocks
                held = [h for g, h in zip(groups, hashes) if g in saved]
                if held:
                    self._release_saved([k for layer in range(self.store.num_layers) for k in self.store.keys(held, layer)])
            return rows

    def unpin_blocks(self, groups: Sequence[str]) -> None:
        """Give back pins from `pin_blocks_for_reader`."""
        with self._lock:
            self.store.cpu.release_blocks(groups)

    def unpin(self, keys: Sequence[str]) -> None:
        """Give back pins from `pin_for_reader`."""
        with self._lock:
            self.store.cpu.release(keys)

    def with_saved_pins(self, hashes: Sequence[str]) -> list[str]:
        """Of blocks `hashes`, those some layer of which holds a landed save's pin."""
        with self._lock:
            counts = self._pin_blocks
            if not counts or not hashes:
                return []
            groups = self.store.block_groups(hashes) or [block_group(key) for key in self.store.keys(hashes, 0)]
            return [h for h, group in zip(hashes, groups) if group in counts]

    def release_pins(self, keys: Sequence[str]) -> None:
        """Give back the pins of landed saves nobody took (blocks that never became far)."""
        with self._lock:
            self._release_saved(keys)

    def _release_saved(self, keys: Sequence[str]) -> None:
        """Give back the landed saves' pins among `keys` (others left alone). Lock held."""
        pins = self._pins
        held = [k for k in keys if pins.pop(k, None) is not None]
        if held:
            self._count_blocks(held, -1)
            self.store.cpu.release(held)

    def _count_blocks(self, keys: Sequence[str], delta: int) -> None:
        """Keep `_pin_blocks` (per block, its keys holding a landed save's pin) in step with `_pins`. Lock held."""
        counts = self._pin_blocks
        for key in keys:
            group = block_group(key)
            count = counts.get(group, 0) + delta
            if count > 0:
                counts[group] = count
            else:
                counts.pop(group, None)
