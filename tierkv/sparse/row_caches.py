"""The GPU far-block cache of the graphed sparse decode rows: each row keeps, per layer, the blocks
of its last selection on the GPU, and a step copies across PCIe only the selected blocks that are
not there yet.

Primitives: `RowCaches` (`take`, `give_back`, `place`, `place_rows`, `snapshot`, `restore`, `stats`), `CacheSet`,
`cache_rows`, `least_set_bytes`, `staging_for_caches`.

A cache set is one selection per layer (k blocks each) and belongs to one request at a time; the
CUDA graphs bake its addresses in, as they bake the request's summary tables and slot lists:

    blocks  [sets * L * C, 2, H, T, D]       set s, layer l: slots (s*L + l)*C .. +C (C = k, or S*k
                                             below)
    held    int64 [sets, L, C]               block id in each slot, -1 when empty

With `scheduler.sparse_cache_selections` S > 1 each layer has C = S*k slots (`width`) and a missing
id takes the least recently used slot the selection does not read (one Triton launch on CUDA as
well), so a block selected again after a step or more away is still there.

Where staging cannot hold a selection per layer for every row, the sets keep nothing
(`per_layer=False`): one selection's slots per set, which every layer of every step overwrites, so
every selected block is copied (as before the caches existed):

    blocks  [sets * k, 2, H, T, D]           set s: slots s*k .. +k, for every layer

`place_rows` runs on the device with fixed shapes (a graph captures it): the selected ids [k] that a
slot holds keep it; the others take, in order, the slots whose block was not selected again, and
are the misses the caller copies in (on CUDA one Triton launch for every row, `tierkv.cache_kernels`;
elsewhere, or where it cannot build, `place`'s PyTorch ops row by row). Far blocks are immutable once far, so a held block stays valid for
its request; a set handed to another request is emptied first (`give_back`). Counters (hits,
misses, rows that missed) stay on the device until `stats` reads them: a replay never waits. A
negative id stands for no block (a row with fewer far blocks than k): never held, hit or missed;
its slot is one of the set's, read with no token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tierkv.optional_kernel import OptionalKernel
from tierkv.units import format_bytes

_ROWS_KERNEL = OptionalKernel("far-block cache placement of several rows (tierkv.cache_kernels)")
KERNEL_MAX_K = 256  # slots per layer the placement kernels take (their comparisons live in one program's registers)


def _place_rows_kernel(lru: bool):
    from tierkv.cache_kernels import place_rows, place_rows_lru

    return place_rows_lru if lru else place_rows


def staging_for_caches(rows: int, selections: int, eager_bytes: int, num_layers: int, k: int, block_bytes: int,
                       codes_bytes: int) -> int:
    """The least scheduler.staging_bytes in which `cache_rows` gives `rows` rows caches of
    `selections` selections per layer (they and the eager regions within three quarters)."""
    kept = RowCaches.bytes_per_set(num_layers, k, block_bytes, selections=selections) + codes_bytes
    return -(-4 * (rows * kept + eager_bytes) // 3)


def least_set_bytes(num_layers: int, k: int, block_bytes: int, codes_bytes: int) -> int:
    """One row's least far-block cache set (one selection for all layers: keeps nothing) and its codes."""
    return RowCaches.bytes_per_set(num_layers, k, block_bytes, per_layer=False) + codes_bytes


def cache_rows(wanted: int, selections: int, staging_bytes: int, eager_bytes: int, num_layers: int, k: int,
               block_bytes: int, codes_bytes: int, ring_bytes: int = 0) -> tuple[int, bool, str | None]:
    """How many of `wanted` decoding rows the graphs serve, and whether their caches keep
    `selections` selections per layer: (rows, per_layer, a warning or None). Everything fits within
    three quarters of `staging_bytes`, beside the eager regions (eager_bytes); a run-time resize's
    (`ring_bytes`: one region of the start-up main ring, which it leaves) may pass that to give every wanted
    row a set; each row also needs codes_bytes (a quantized tier's code buffers). Every wanted row with caches
    per layer, else sets that keep nothing (one selection each, every block copied every step) for
    as many rows as fit; 0 selections asks for the latter."""
    shared = least_set_bytes(num_layers, k, block_bytes, codes_bytes)
    room = 3 * staging_bytes // 4 - eager_bytes
    if ring_bytes:  # every wanted row keeps a set that keeps nothing, if the ring's region leaves room for it
        room = min(max(room, wanted * shared), staging_bytes - ring_bytes - eager_bytes)
    rows = max(0, min(wanted, room // shared))
    eager = f", {wanted - rows} run eagerly" if rows < wanted else ""
    if selections == 0:  # asked to keep nothing
        return rows, False, (f"scheduler.staging_bytes {format_bytes(staging_bytes)} holds {rows} of {wanted} decoding "
                             f"rows' selections ({format_bytes(shared)} each){eager}" if rows < wanted else None)
    kept = RowCaches.bytes_per_set(num_layers, k, block_bytes, selections=selections) + codes_bytes
    if room >= wanted * kept:
        return wanted, True, None
    needed = staging_for_caches(wanted, selections, eager_bytes, num_layers, k, block_bytes, codes_bytes)
    return rows, False, (f"scheduler.staging_bytes {format_bytes(staging_bytes)} cannot hold far-block caches for "
                         f"{wanted} decoding rows ({format_bytes(kept)} each, within three quarters of it: raise it to "
                         f"{format_bytes(needed)} to keep selections across steps); {rows} rows copy every selected "
                         f"block each step{eager}")


@dataclass(frozen=True)
class CacheSet:
    """One request's cache: `index` into the sets, its slots in `RowCaches.blocks` from `base(layer)`."""

    index: int
    num_layers: int       # layers with slots of their own: all of them, or 1 when the sets keep nothing
    width: int            # slots per layer: k, or a multiple of k (kept selections, least recently used replaced)

    def base(self, layer: int) -> int:
        return (self.index * self.num_layers + layer % self.num_layers) * self.width


def _scatter_into(t: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """t[index[i]] = values[i] for the indices below len(t); an index of len(t) writes nothing (device
    work only, no host wait)."""
    extended = torch.cat([t, t[:1]])
    extended.scatter_(0, index, values)
    t.copy_(extended[:-1])


class RowCaches:
    def __init__(self, num_sets: int, num_layers: int, k: int, block_shape: tuple, dtype: torch.dtype,
                 device: torch.device, per_layer: bool = True, selections: int = 1,
                 storage: torch.Tensor | None = None):
        """num_sets caches of `selections` selections (k blocks of block_shape each) per layer, on
        `device`; per_layer=False: one selection per set, shared by the layers, nothing kept.
        storage: blocks [n, *block_shape] of `dtype` on `device` whose first slots hold the caches
        (memory the caller accounts for, such as staging), instead of memory of their own."""
        if selections < 1:
            raise ValueError(f"selections: got {selections}; a cache keeps at least one selection per layer")
        self.num_sets, self.num_layers, self.k, self.per_layer = num_sets, num_layers, k, per_layer
        layers_kept = num_layers if per_layer else 1
        self.width = k * selections if per_layer else k  # slots per layer
        slots = num_sets * layers_kept * self.width
        if storage is None:
            self.blocks = torch.empty((slots, *block_shape), dtype=dtype, device=device)
        elif storage.shape[0] < slots or tuple(storage.shape[1:]) != tuple(block_shape) or storage.dtype != dtype:
            raise ValueError(f"storage: {tuple(storage.shape)} {storage.dtype} cannot hold {slots} blocks of "
                             f"{tuple(block_shape)} {dtype}")
        else:
            self.blocks = storage[:slots]
        self.held = torch.full((num_sets, num_layers, self.width), -1, dtype=torch.int64, device=device)
        # past one selection per layer: each slot's last use (a tick of its set's clock, -1: never), oldest replaced
        self.last_use = torch.full_like(self.held, -1) if self.width > k else None
        # there too (the next-step prefetch needs spare slots): whether a slot holds a prefetched block no
        # selection has read yet, and how many prefetched blocks a selection read (on the device)
        self.fresh = torch.zeros_like(self.held, dtype=torch.int8) if self.last_use is not None else None
        self.prefetch_used = torch.zeros(1, dtype=torch.int64, device=device)
        self.clock = torch.zeros(num_sets, dtype=torch.int64, device=device)
        # hits, misses, rows with a miss (each a stall: fetched at selection, the output waits for it)
        self.counters = torch.zeros(3, dtype=torch.int64, device=device)
        self._spare = [CacheSet(s, layers_kept, self.width) for s in reversed(range(num_sets))]
        # per_layer=False: every id a miss, read from the set's own k slots
        self._order = torch.arange(k, device=device)
        self._zero = torch.zeros((), dtype=torch.int64, device=device)

    @staticmethod
    def bytes_per_set(num_layers: int, k: int, block_bytes: int, per_layer: bool = True, selections: int = 1) -> int:
        return (num_layers * selections if per_layer else 1) * k * block_bytes

    @property
    def num_bytes(self) -> int:
        return self.blocks.numel() * self.blocks.element_size()

    def take(self) -> CacheSet | None:
        """An empty cache set, the last one given back first; None when every set is taken."""
        return self._spare.pop() if self._spare else None

    def give_back(self, cache: CacheSet) -> None:
        """`cache`'s request finished: its set is emptied (in stream order, after the request's last
        replay) and goes to the next request."""
        self.held[cache.index].fill_(-1)
        if self.last_use is not None:
            self.last_use[cache.index].fill_(-1)
            self.fresh[cache.index].fill_(0)
        self._spare.append(cache)

    def place(self, cache: CacheSet, layer: int, ids: torch.Tensor, counters: torch.Tensor | None = None,
              prefetch: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The selection ids (int64 [k] on the device, distinct where not negative; a negative id
        stands for no block) of `cache`'s request at `layer`:
        (slots int64 [k], the slot of `blocks` each id is read from; miss bool [k], the ids the caller
        copies into those slots), in PyTorch ops (what `place_rows` does row by row where its kernel
        cannot run). counters: where the hits, misses and rows that missed are added (default the
        caches' own). prefetch: the ids are a prediction (the next-step prefetch), not a selection:
        the slots it fills are marked fresh, and a later selection that reads a fresh slot counts a
        prefetched block used (`prefetch_used`; caches of several selections only). Device work
        only, no host wait."""
        counters = self.counters if counters is None else counters
        if not self.per_layer:  # nothing kept: the set's slots, every id copied
            miss = ids >= 0
            counters.add_(torch.stack([self._zero, miss.sum(), miss.any().to(torch.int64)]))
            return self._order + cache.base(layer), miss
        held = self.held[cache.index, layer]
        if self.last_use is None:
            return self._place_torch(cache, layer, ids, held, counters=counters)
        last_use, tick = self.last_use[cache.index, layer], self.clock[cache.index : cache.index + 1]
        return self._place_torch(cache, layer, ids, held, last_use, tick, counters, self.fresh[cache.index, layer],
                                 prefetch)

    def place_rows(self, caches: list[CacheSet], sets: torch.Tensor, layer: int, ids: torch.Tensor,
                   counters: torch.Tensor | None = None, prefetch: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """`place` for m rows at once, row r the ids[r] (int64 [m, j], j at most the slots per layer) of
        the request holding caches[r], whose indices `sets` holds (int64 [m] on the device; a CUDA graph
        bakes it): (slots int64 [m, j], miss bool [m, j]). One Triton launch for every row on CUDA; row
        by row elsewhere. counters, prefetch: as `place`."""
        counters = self.counters if counters is None else counters
        if ids.shape[0] == 0 or ids.shape[1] == 0:  # no row, or empty selections: nothing placed or launched
            return torch.zeros(ids.shape, dtype=torch.int64, device=ids.device), torch.zeros(
                ids.shape, dtype=torch.bool, device=ids.device)
        if not self.per_layer:  # nothing kept: each set's slots, every id copied
            miss = ids >= 0
            counters.add_(torch.stack([self._zero, miss.sum(), miss.any(1).sum()]))
            return self._order[: ids.shape[1]] + (sets * self.width).unsqueeze(1), miss
        lru = self.last_use is not None
        if ids.is_cuda and self.width <= KERNEL_MAX_K:
            args = ((self.held, self.last_use, self.clock) if lru else (self.held,)) + (sets, layer, ids, counters)
            more = {"fresh": self.fresh, "used": self.prefetch_used, "prefetch": prefetch} if lru else {}
            ok, placed = _ROWS_KERNEL.run(lambda: _place_rows_kernel(lru)(*args, **more), on_cuda=True)
            if ok:
                return placed
        # a row without a set (a full decode graph's row without far blocks: all its ids negative) places nothing
        placed = [self.place(cache, layer, ids[r], counters, prefetch) if cache is not None
                  else (torch.zeros_like(ids[r]), torch.zeros_like(ids[r], dtype=torch.bool))
                  for r, cache in enumerate(caches)]
        return torch.stack([p[0] for p in placed]), torch.stack([p[1] for p in placed])

    def _place_torch(self, cache: CacheSet, layer: int, ids: torch.Tensor, held: torch.Tensor,
                     last_use: torch.Tensor | None = None, tick: torch.Tensor | None = None,
                     counters: torch.Tensor | None = None, fresh: torch.Tensor | None = None,
                     prefetch: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """`place` in PyTorch ops over the layer's C slots (held int64 [C]): a held id is read in
        place; the r-th missing id takes the r-th slot the selection does not read (at least as many
        as the misses: C - hits >= k - hits), in slot order, or with last_use (int64 [C], C > k) least
        recently used first, every slot read or filled then stamped with the set's tick (int64 [1],
        advanced by one); fresh (int8 [C], with last_use) marked as `place`'s prefetch says."""
        valid = ids >= 0                                               # a negative id selects nothing
        same = (ids.unsqueeze(1) == held.unsqueeze(0)) & valid.unsqueeze(1)  # [k, C]: id i is held in slot j
        hit = same.any(1)
        miss = valid & ~hit
        read = same.any(0)                                             # [C]: slots this selection reads
        order = (read.to(torch.int64) if last_use is None            # unread first, then by last use; ties by slot
                 else torch.where(read, torch.iinfo(torch.int64).max, last_use))
        victims = torch.argsort(order, stable=True)
        miss_rank = (torch.cumsum(miss, 0) - 1).clamp_(min=0)
        local = torch.where(hit, same.to(torch.int8).argmax(1),
                            torch.where(miss, victims.index_select(0, miss_rank), 0))
        target = torch.where(valid, local, held.shape[0])  # a negative id writes nothing
        if fresh is not None and prefetch:  # the blocks it copies in are fresh; held ones keep their mark
            _scatter_into(fresh, torch.where(miss, local, held.shape[0]), torch.ones_like(fresh[: ids.shape[0]]))
        elif fresh is not None:  # a selection: the fresh slots it reads were prefetches used; none stays fresh
            self.prefetch_used.add_((read & (fresh != 0)).sum())
            _scatter_into(fresh, target, torch.zeros_like(fresh[: ids.shape[0]]))
        _scatter_into(held, target, ids)
        if last_use is not None:
            _scatter_into(last_use, target, tick.expand(ids.shape[0]))
            tick.add_(1)
        (self.counters if counters is None else counters).add_(
            torch.stack([hit.sum(), miss.sum(), miss.any().to(torch.int64)]))
        return local + cache.base(layer), miss

    def snapshot(self) -> tuple:
        """What the sets hold, their clocks and the counters, copied (device work only)."""
        lru = self.last_use is not None
        return (self.held.clone(), self.last_use.clone() if lru else None, self.clock.clone(), self.counters.clone(),
                self.fresh.clone() if lru else None, self.prefetch_used.clone())

    def restore(self, saved: tuple) -> None:
        """Back to a `snapshot` (the blocks a run copied in since are then not held: copied again)."""
        held, last_use, clock, counters, fresh, used = saved
        self.held.copy_(held)
        if last_use is not None:
            self.last_use.copy_(last_use)
            self.fresh.copy_(fresh)
        self.clock.copy_(clock)
        self.counters.copy_(counters)
        self.prefetch_used.copy_(used)

    def stats(self) -> dict:
        """The counters, read from the device (one sync)."""
        hits, misses, stalled_rows = self.counters.tolist()
        return {"cache_hits": hits, "cache_misses": misses, "cache_stalled_rows": stalled_rows,
                "cache_sets": self.num_sets, "cache_bytes": self.num_bytes, "cache_per_layer": self.per_layer,
                "cache_slots_per_layer": self.width}

    def __repr__(self) -> str:
        layers = self.num_layers if self.per_layer else 1
        return f"RowCaches({self.num_sets} sets of {layers} x {self.width} blocks, {format_bytes(self.num_bytes)})"
