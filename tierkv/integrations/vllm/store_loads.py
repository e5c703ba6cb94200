"""A step's prefix loads into vLLM's paged cache, layer by layer, `lookahead_layers` ahead.

Primitives: `LayerLoads`. No vLLM import.

    begin_loads(spans)          the step's blocks to load; layers [0, lookahead) start their H2D
    finish_layer_load(L)        before layer L's attention: its blocks written into vLLM's cache
                                (stream order), layer L + lookahead started
    CPU-tier slots (pinned by acquire) --H2D on the copy stream--> fresh [n, 2, H, T, D] --> kv_cache[block_ids]

A block the CPU tier cannot pin (too small for a layer) is read from the tier holding it; a block
no tier holds any more becomes a load error (`take_errors`: vLLM recomputes it). Pins go back once
the copy has landed (`poll`).

Under the hot window a step loads at most a window of blocks per request: they are staged in a ring of
lookahead + 1 buffers of one window each (`_LoadRing`, made at the first load and kept; 25 MiB for an
8B model's 2048-token window in 64-token blocks), so a prefix hit allocates nothing on the device. A fresh
tensor per layer instead would be a new cudaMalloc for each layer the host runs ahead of the GPU, the first
time a hit comes (15 ms of a 100k-token repeat's first step on an H100). Bigger loads (several requests'
windows in one step, or no hot window: the whole prefix) are staged in fresh tensors.
"""
from __future__ import annotations

from typing import Sequence

import torch

from tierkv.block_io import allocating_on_copy_stream
from tierkv.integrations.vllm.paged_layout import BlockSpan
from tierkv.transfer.device import to_device_no_sync


class _LayerLoad:
    def __init__(self, handle, staged: torch.Tensor, block_ids: torch.Tensor, ring_index: int | None = None):
        self.handle, self.staged, self.block_ids, self.ring_index = handle, staged, block_ids, ring_index


class _LoadRing:
    """lookahead + 1 device buffers of `capacity` blocks; layer L stages in buffer L % (lookahead + 1). A copy
    into a buffer waits (on the device, never the host) for the compute stream's write out of the layer that
    used it last; a plan dropped before its writes leaves its copies ordered before the next on the copy stream."""

    def __init__(self, store, capacity: int):
        self.store, self.capacity = store, capacity
        self._buffers: list[torch.Tensor] = []
        self._written: list = []  # per buffer, a compute event after its last write out (None: never written)

    @property
    def num_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers)

    def take(self, layer: int) -> tuple[int, torch.Tensor, list]:
        """(index, the buffer, what a copy into it waits for) of `layer`."""
        store = self.store
        if not self._buffers:
            with allocating_on_copy_stream(store.engine, "h2d"):
                self._buffers = [store.layout.empty(self.capacity, device=store.device) for _ in range(store.lookahead + 1)]
            self._written = [None] * len(self._buffers)
        i = layer % len(self._buffers)
        return i, self._buffers[i], [e for e in (self._written[i],) if e is not None]

    def written(self, i: int) -> None:
        """Buffer i's blocks are written out: enqueued on the compute stream, now."""
        engine = self.store.engine
        engine.release_event(self._written[i])
        self._written[i] = engine.record_compute_event()


class LayerLoads:
    """The loads of a `VllmKVStore` (a worker's): reads its keys, tiers, block I/O, paged layout and
    registered caches; counts blocks_loaded (blocks whose every layer landed in vLLM's cache) and
    load_failures in its counts. lock: the store's,
    held where the tiers are touched."""

    def __init__(self, store, lock):
        self.store, self._lock = store, lock
        self.error_block_ids: set[int] = set()
        self._step_errors: set[int] = set()  # this step's blocks some layer of which no tier held
        self._loads: dict[int, _LayerLoad] = {}
        self._plan: list[BlockSpan] = []
        self._ids = torch.empty(0, dtype=torch.int64)
        self._hashes: list[str] = []
        self._pins: list[tuple[object, list[str], list[int]]] = []   # (H2D handle, keys pinned for it, their slots)
        self._next_layer = 0
        self._ring: _LoadRing | None = None  # under the hot window, made at its first load

    @property
    def ring_bytes(self) -> int:
        """Device bytes the hot window's load ring holds (0 before its first load, or without one)."""
        return self._ring.num_bytes if self._ring is not None else 0

    def _ring_for(self, n: int) -> _LoadRing | None:
        """The ring staging loads of `n` blocks per layer, or None: no hot window, or more than one window."""
        far = self.store.hot_window
        if far is None:
            return None
        if self._ring is None:
            self._ring = _LoadRing(self.store, -(-far.window_tokens // far.block_tokens) + 1)
        return self._ring if n <= self._ring.capacity else None

    def begin(self, spans: Sequence[BlockSpan]) -> None:
        """Plan this step's loads and start the first `lookahead` layers' H2D copies. What an earlier step
        left planned (its forward raised before its layers ran) is dropped first: vLLM may have given
        those block ids to another request since (its pins go back at the next `poll`)."""
        self._loads.clear()
        self._plan, self._next_layer = [], 0
        self._step_errors = set()
        spans = [s for s in spans if s.block_ids]
        if not spans:
            return
        self._plan = list(spans)
        self._ids = torch.tensor([b for s in spans for b in s.block_ids], dtype=torch.int64)
        self._hashes = [h for s in spans for h in s.hashes]
        self._next_layer = 0
        while self._next_layer < min(self.store.lookahead, self.store.num_layers):
            self._issue(self._next_layer)
            self._next_layer += 1

    def _issue(self, layer: int) -> None:
        """One layer's blocks: pinned in the CPU tier and copied H2D on the copy stream; blocks the
        CPU tier cannot pin (too small for a layer) are read from the tier holding them and copied
        from there; blocks no tier holds any more become load errors (vLLM recomputes them)."""
        store = self.store
        keys = store.keys(self._hashes, layer)
        with self._lock:
            slots = store.chain.acquire_many(keys)
        if slots is not None:
            self._issue_pinned(layer, keys, slots)
            return
        ids = self._ids
        found = store.chain.get_many(keys, promote=False)
        missing = [i for i, b in enumerate(found) if b is None]
        if missing:
            self.error_block_ids.update(int(ids[i]) for i in missing)
            self._step_errors.update(int(ids[i]) for i in missing)
            store.counts["load_failures"] += len(missing)
        present = [i for i, b in enumerate(found) if b is not None]
        if present:
            rows = torch.stack([found[i] for i in present]).to(store.device)
            self._loads[layer] = _LayerLoad(None, rows, to_device_no_sync(ids[torch.tensor(present)], store.device))

    def _issue_pinned(self, layer: int, keys: list[str], slots: list[int]) -> None:
        """The H2D copy of one layer's blocks pinned at CPU-tier `slots`, staged in the ring when it holds them."""
        store, n = self.store, len(keys)
        ring = self._ring_for(n)
        if ring is not None:
            ring_index, buffer, after = ring.take(layer)
        else:
            ring_index, after = None, None
            with allocating_on_copy_stream(store.engine, "h2d"):
                buffer = store.layout.empty(n, device=store.device)
        handle = store.io.gather(torch.tensor(slots, dtype=torch.int64), buffer, torch.arange(n, dtype=torch.int64),
                                 after=after)
        self._pins.append((handle, keys, slots))
        self._loads[layer] = _LayerLoad(handle, buffer[:n], to_device_no_sync(self._ids, store.device), ring_index)

    def finish_layer(self, layer: int) -> None:
        """Before layer `layer`'s attention: its loaded blocks are in vLLM's cache (stream order)."""
        store = self.store
        load = self._loads.pop(layer, None)
        if load is not None:
            if load.handle is not None:
                load.handle.wait_on_current_stream()
            store.paged.write(store.kv_caches[layer], load.block_ids, load.staged)
            if load.staged.is_cuda:
                load.staged.record_stream(torch.cuda.current_stream(load.staged.device))
            if load.ring_index is not None:
                self._ring.written(load.ring_index)
        if self._plan and self._next_layer < store.num_layers and layer + store.lookahead >= self._next_layer:
            self._issue(self._next_layer)
            self._next_layer += 1
        if layer == store.num_layers - 1:
            if self._plan:  # every layer's blocks written (a forward that raised before here counts none)
                store.counts["blocks_loaded"] += len(self._hashes) - len(self._step_errors)
            self._plan = []

    @property
    def step_errors(self) -> frozenset[int]:
        """vLLM block ids of this step's loads that some layer of no tier held (so far in the step's layers)."""
        return frozenset(self._step_errors)

    def take_errors(self) -> set[int]:
        """vLLM block ids whose blocks no tier held (vLLM recomputes them), since the last call."""
        errors, self.error_block_ids = self.error_block_ids, set()
        return errors

    def poll(self, wait: bool) -> None:
        """Unpin landed loads (all of them when `wait`); under the hot window their pins are kept as landed
        saves' are (`LayerSaves.keep_pins`): a loaded window block must still be in the CPU tier when it turns
        far. Caller holds the store's lock."""
        pins = []
        for handle, keys, slots in self._pins:
            if wait:
                handle.synchronize()
            if wait or handle.is_done():
                if self.store.saves.keep_pinned:
                    self.store.saves.keep_pins(keys, slots)
                else:
                    self.store.cpu.release(keys)
            else:
                pins.append((handle, keys, slots))
        self._pins = pins
