"""A step's prefix loads into vLLM's paged cache, layer by layer, `lookahead_layers` ahead.

Primitives: `LayerLoads`. No vLLM import.

    begin_loads(spans)          the step's blocks to load; layers [0, lookahead) start their H2D
    finish_layer_load(L)        before layer L's attention: its blocks written into vLLM's cache
                                (stream order), layer L + lookahead started
    CPU-tier slots (pinned by acquire) --H2D on the copy stream--> fresh [n, 2, H, T, D] --> kv_cache[block_ids]

A block the CPU tier cannot pin (too small for a layer) is read from the tier holding it; a block
no tier holds any more becomes a load error (`take_errors`: vLLM recomputes it). Pins go back once
the copy has landed (`poll`).
"""
from __future__ import annotations

from typing import Sequence

import torch

from tierkv.block_io import allocating_on_copy_stream
from tierkv.integrations.vllm.paged_layout import BlockSpan
from tierkv.transfer.device import to_device_no_sync


class _LayerLoad:
    def __init__(self, handle, staged: torch.Tensor, block_ids: torch.Tensor):
        self.handle, self.staged, self.block_ids = handle, staged, block_ids


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
        n = len(keys)
        with allocating_on_copy_stream(store.engine, "h2d"):
            staged = store.layout.empty(n, device=store.device)
        ids = self._ids
        if slots is not None:
            handle = store.io.gather(torch.tensor(slots, dtype=torch.int64), staged, torch.arange(n, dtype=torch.int64))
            self._pins.append((handle, keys, slots))
        else:
            found = store.chain.get_many(keys, promote=False)
            missing = [i for i, b in enumerate(found) if b is None]
            if missing:
                self.error_block_ids.update(int(ids[i]) for i in missing)
                self._step_errors.update(int(ids[i]) for i in missing)
                store.counts["load_failures"] += len(missing)
            present = [i for i, b in enumerate(found) if b is not None]
            handle = None
            if present:
                rows = torch.stack([found[i] for i in present]).to(store.device)
                staged, ids = rows, ids[torch.tensor(present)]
            else:
                return
        self._loads[layer] = _LayerLoad(handle, staged, to_device_no_sync(ids, store.device))

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
        if self._plan and self._next_layer < store.num_layers and layer + store.lookahead >= self._next_layer:
            self._issue(self._next_layer)
            self._next_layer += 1
        if layer == store.num_layers - 1:
            if self._plan:  # every layer's blocks written (a forward that raised before here counts none)
                store.counts["blocks_loaded"] += len(self._hashes) - len(self._step_errors)
            self._plan = []

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
