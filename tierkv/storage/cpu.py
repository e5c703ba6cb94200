"""CPU tier: a slab of fixed-size block slots in (pinned) host memory, LRU-evicted.

Primitives: `CpuTier` with the `StorageTier` contract, its slot index and LRU eviction, plus the
slot-level two-phase API the GPU transfer engine uses (prepare_put / complete_put, acquire /
release, acquire_blocks / release_blocks: `cpu_slots.CpuSlotAccess`):

    tier.index_blocks(num_layers)    # per block hash, the layers held (cpu_blocks), kept from now on
    n = tier.held_prefix(hashes)     # leading blocks held for every layer: one probe per block

    slab: [num_slots, 2, num_kv_heads, block_tokens, head_dim]   (pinned when CUDA is present;
          quantized or not, and how it is pinned: `tierkv.storage.cpu_slab`)

A pinned block is never evicted; a put that finds every slot pinned fails (ok=False).

Latency histograms (`counters`, one sample per batched call): "get" = get_many and acquire,
"put" = put_many and prepare_put + complete_put; the copies the transfer engine runs between
them are transfer time, not tier time.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Sequence

import torch

from tierkv.blocks import BlockLayout
from tierkv.storage.base import PutResult, StorageTier
from tierkv.storage.cpu_pins import BlockPins, TierPins
from tierkv.storage.cpu_blocks import BlockLayers
from tierkv.storage.cpu_slab import CpuSlab, slot_num_bytes
from tierkv.storage.cpu_slots import CpuSlotAccess


class CpuTier(CpuSlotAccess, StorageTier):
    kind = "cpu"

    def __init__(self, name: str, layout: BlockLayout, capacity_bytes: int, *, pin_memory: bool | None = None,
                 quant_format: str | None = None):
        """quant_format: None (blocks stored as given, bit-exact) or a `tierkv.quant` format
        ("int8", "float8_e4m3fn"): one byte per value plus a float32 scale per block, K/V and head;
        `capacity_bytes` then holds about twice the bf16 blocks."""
        super().__init__(name, layout, capacity_bytes)
        self.quant_format = quant_format
        self.slot_bytes = slot_num_bytes(layout, quant_format)
        self.num_slots = capacity_bytes // self.slot_bytes
        if self.num_slots < 1:
            raise ValueError(f"{name}: capacity {capacity_bytes} bytes holds no block of {self.slot_bytes} bytes")
        self.is_pinned = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._contents = CpuSlab(name, layout, self.num_slots, quant_format, self.is_pinned)
        self.slab, self.scales = self._contents.slab, self._contents.scales  # cpu_slab: shapes and dtypes
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # visible blocks, LRU first
        self._pending: dict[str, int] = {}  # prepared, not yet complete
        self._prepare_s: dict[str, float] = {}  # pending key -> seconds its batch's prepare_put took
        self._pin_state = TierPins()  # cpu_pins: per-key and whole-block pins, the eviction walk
        self._pins: Counter[str] = self._pin_state.keys
        self._free_slots = list(range(self.num_slots - 1, -1, -1))
        self._blocks: BlockLayers | None = None  # per block, layers held (`index_blocks`)
        # PutResult.evicted carries an evicted block's bytes (cloned) for the tier below; TierChain turns it off for
        # its last tier, whose evictions are dropped: (key, None) then, and no copy-out of 256 KiB per block and layer
        self.return_evicted = True

    def index_blocks(self, num_layers: int) -> None:
        """From now on, count per block hash the visible layers in [0, num_layers) (`cpu_blocks`)."""
        with self._lock:
            if self._pin_state.blocks is not None and self._pin_state.blocks.pins:
                raise RuntimeError(f"{self.name}: index_blocks while whole blocks are pinned")
            self._blocks = BlockLayers(num_layers)
            self._blocks.add_many(self._slot_of.items())
            self._pin_state.blocks = BlockPins(self._blocks)

    def held_prefix(self, hashes: Sequence[str], suffix: str = "") -> int | None:
        """Leading `hashes` visible in every layer (keys `block_keys(hashes, layer, suffix)`), one
        probe per block; None unless `index_blocks` was called."""
        with self._lock:
            return None if self._blocks is None else self._blocks.held_prefix(hashes, suffix)

    # -- StorageTier contract --------------------------------------------------------------
    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._slot_of

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:  # once for the batch: a 100k-token prefix asks for 1.5k keys per layer
            slot_of = self._slot_of
            return [key in slot_of for key in keys]

    def held_or_written(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is held here or being written here (a put it refused for that loses nothing)."""
        with self._lock:
            return [key in self._slot_of or key in self._pending for key in keys]

    def get(self, key: str) -> torch.Tensor | None:
        return self.get_many([key])[0]

    def put(self, key: str, block: torch.Tensor) -> PutResult:
        return self.put_many([key], [block])[0]

    def get_many(self, keys: Sequence[str]) -> list[torch.Tensor | None]:
        """Hits are rows of one fresh [num_hits, *layout.shape] tensor the caller owns; None for a miss.

        One lock, one gather and one counter update for the whole batch; each hit becomes the
        most recently used block, in key order.
        """
        with self.counters.timed("get"), self._lock:
            slots = [self._slot_of.get(key) for key in keys]
            for key, slot in zip(keys, slots):
                if slot is not None:
                    self._slot_of.move_to_end(key)
            hit_slots = [slot for slot in slots if slot is not None]
            if hit_slots:  # gather while locked: a later put may reuse these slots
                rows = iter(self.read_slots(hit_slots).unbind(0))
        num_hits = len(hit_slots)
        self.counters.record_lookups(num_hits, len(keys) - num_hits, num_hits * self.slot_bytes)
        return [None if slot is None else next(rows) for slot in slots]

    def peek_many(self, keys: Sequence[str]) -> list[torch.Tensor | None]:
        """As get_many, for the tier's own copies to other tiers: no lookup counted, LRU order kept."""
        with self._lock:
            slots = [self._slot_of.get(key) for key in keys]
            hit_slots = [slot for slot in slots if slot is not None]
            if hit_slots:
                rows = iter(self.read_slots(hit_slots).unbind(0))
        return [None if slot is None else next(rows) for slot in slots]

    def put_many(self, keys: Sequence[str], blocks: Sequence[torch.Tensor]) -> list[PutResult]:
        """Store blocks in key order under one lock, as a loop of put() would; all are checked first."""
        if len(keys) != len(blocks):
            raise ValueError(f"put_many: {len(keys)} keys but {len(blocks)} blocks")
        for key, block in zip(keys, blocks):
            self._check_block(key, block)  # all or nothing: fail before the first write
        results = []
        try:
            with self.counters.timed("put"), self._lock:
                try:
                    for key, block in zip(keys, blocks):
                        results.append(self._put_one(key, block))
                except BaseException:  # a Ctrl-C between taking a slot and indexing it: the slot is in no list
                    self._reclaim_lost_slots()
                    raise
        finally:  # what landed before an interrupt is stored: counted
            num_stored = sum(r.ok for r in results)
            self.counters.add(
                puts=num_stored, put_failures=len(results) - num_stored, bytes_written=num_stored * self.slot_bytes,
                evictions=sum(len(r.evicted) for r in results),
            )  # fmt: skip
        return results

    def _put_one(self, key: str, block: torch.Tensor) -> PutResult:
        """put_many's step for one key. Lock held. The slot `_take_slot` gives is in no list (no pin: nobody sees
        it before it is indexed) until the key is visible; the index (`_slot_of`) first, then the per-block
        counts, which thus never count a key that is not visible."""
        result, slot = self._take_slot(key)
        if result.ok:
            self.write_slots([slot], block.unsqueeze(0))
            self._slot_of[key] = slot
            if self._blocks is not None:
                self._blocks.add_many(((key, slot),))
        return result

    # -- slot contents (cpu_slab: quantized or not) ---------------------------------------------
    def read_slots(self, slots: Sequence[int]) -> torch.Tensor:
        """Blocks in the KV dtype: [len(slots), 2, H, T, D], a fresh tensor."""
        return self._contents.read(slots)

    def write_slots(self, slots: Sequence[int], blocks: torch.Tensor) -> None:
        """blocks [len(slots), 2, H, T, D] in the KV dtype -> the slots (quantized if the tier is)."""
        self._contents.write(slots, blocks)

    def remove(self, key: str) -> bool:
        with self._lock:
            if key not in self._slot_of or self._pinned(key):
                return False
            try:
                self._free_slots.append(self._drop(key))
            except BaseException:  # a Ctrl-C as _drop returns
                self._reclaim_lost_slots()
                raise
        self.counters.add(removes=1)
        return True

    def close(self) -> None:
        with self._lock:
            self._slot_of.clear()
            if self._blocks is not None:
                self._blocks.clear()
            self._pending.clear()
            self._prepare_s.clear()
            self._pins.clear()
            if self._pin_state.blocks is not None:
                self._pin_state.blocks.clear()
            self._free_slots = list(range(self.num_slots - 1, -1, -1))

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return (len(self._slot_of) + len(self._pending)) * self.slot_bytes

    # -- internals ---------------------------------------------------------------------------
    def _pinned(self, key: str) -> bool:
        """Whether a reader or a pending write pins key, by its own pin or its whole block's. Lock held."""
        return self._pin_state.pinned(key)

    def _allocate(self, key: str) -> PutResult:
        """Reserve a pinned pending slot for key (see `_take_slot`). Lock held. The slot is recorded pending as it
        is taken, not after `_take_slot` returns: an interrupt (Ctrl-C) in between would leave it in no list."""
        result, _ = self._take_slot(key, self._pending)
        if result.ok:
            self._pins[key] += 1
        return result

    def _take_slot(self, key: str, pending: dict[str, int] | None = None) -> tuple[PutResult, int | None]:
        """A slot for key: its own, a free one, or the LRU unpinned block's. Lock held.

        With `pending`, the slot is recorded there under key as soon as it is taken (before an evicted block is
        copied out), else it is in no index when this returns; an evicted block's bytes (cloned; None unless
        `return_evicted`) are in the result, and the caller counts the eviction.
        """
        if key in self._pending:
            return PutResult(ok=False, error=f"{self.name}: block {key} is already being written"), None
        victim = None
        if key in self._slot_of:
            if self._pinned(key):
                return PutResult(ok=False, error=f"{self.name}: block {key} is pinned by a reader"), None
            slot = self._drop(key)
        elif self._free_slots:
            slot = self._free_slots.pop()
        else:
            victim = self._lru_unpinned()
            if victim is None:
                return PutResult(ok=False, error=f"{self.name}: all {self.num_slots} slots are pinned"), None
            slot = self._drop(victim)
        if pending is not None:
            pending[key] = slot
        if victim is None:
            evicted = []
        else:  # the bytes only where a tier below takes them: no tier below, the copy-out would be thrown away
            evicted = [(victim, self.read_slots([slot])[0] if self.return_evicted else None)]
        return PutResult(ok=True, evicted=evicted), slot

    def _drop(self, key: str) -> int:
        """Take a visible key out of the per-block counts, then out of the index; returns its slot, which the
        caller puts in a list (an interrupt before that: `_reclaim_lost_slots`). Lock held. In that order a Ctrl-C
        between the two leaves the key visible and uncounted (a miss for `held_prefix`, which the next drop of
        the key skips), never counted while its slot is reused."""
        if self._blocks is not None:
            self._pin_state.blocks.forget(key)
            self._blocks.remove(key)
        return self._slot_of.pop(key)

    def _reclaim_lost_slots(self) -> None:
        """Every slot in no list (free, visible, pending) back to the free list: those a put or a drop interrupted
        (Ctrl-C) between taking a slot and recording it. Lock held since that call began, so no other call holds
        a slot between two lists. O(num_slots): for the interrupt path only."""
        held = set(self._free_slots)
        held.update(self._slot_of.values())
        held.update(self._pending.values())
        self._free_slots.extend(slot for slot in range(self.num_slots - 1, -1, -1) if slot not in held)

    def _lru_unpinned(self) -> str | None:
        """The least recently used unpinned key, None if every block is pinned (`TierPins.lru_unpinned`). Lock held."""
        return self._pin_state.lru_unpinned(self._slot_of, len(self._pending))

    def _unpin(self, key: str) -> None:
        self._pin_state.unpin(key)
