"""One request's far blocks under the hot window: their hashes, and their pins in the CPU tier.

Primitives: `FarRequest`, `FarPins`. No vLLM import.

A request's blocks stay pinned in the CPU tier from the save that wrote them (the store keeps the
pin once the copy lands) or from the step they become far, until the request finishes, so a step
pins only the blocks that became far since the last one (whole, one count per block, when the CPU tier
holds every layer: their saves' per-key pins are then given back):

    blocks   [0 ............ pinned) [pinned ....... num_far) [num_far ....... hashes)
             pinned for reading       pinned by this step      pinned by their saves (released at finish)

Under the sparse policy the pinned slots are also kept on the device, in one buffer per layer
sized for max_model_len when it is known (else grown by doubling), so its address rarely moves;
a finished request's buffers go to the next request (`keep_slot_lists`), and the CUDA graphs
captured for the one serve the other.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection, Sequence

import torch

from tierkv.sparse.request_summaries import RequestSummaries
from tierkv.sparse.row_caches import CacheSet
from tierkv.sparse.summaries import BlockSummaries
from tierkv.transfer.device import append_at, to_device_no_sync


@dataclass
class FarRequest:
    hashes: list[str] = field(default_factory=list)            # chained hashes of its full blocks
    index: dict[str, int] = field(default_factory=dict)        # hash -> block index
    pinned_keys: list[list[str]] = field(default_factory=list)  # per layer, keys pinned in the CPU tier one by one
    pinned_groups: list[str] = field(default_factory=list)      # blocks pinned whole (every layer) in the CPU tier
    pinned_slots: list[torch.Tensor] = field(default_factory=list)  # per layer, int64 CPU-tier slots of those keys
    # sparse policy only
    pinned_slots_dev: list[torch.Tensor] = field(default_factory=list)  # the same slots on the device, in a
    #   buffer sized for max_model_len when known, else grown by doubling (entries past the pinned count
    #   unused): its address rarely moves
    summaries: RequestSummaries | None = None                  # key min/max of its blocks, on the device
    cache: CacheSet | None = None                              # its far-block cache, once the graphs serve it
    previous: dict[int, torch.Tensor] = field(default_factory=dict)  # per layer: a sampled step's selection

    def num_pinned(self) -> int:
        """Its blocks pinned for the far reader (the first ones)."""
        return self.pinned_slots[0].numel() if self.pinned_slots else 0

    @property
    def far_summaries(self) -> BlockSummaries | None:
        """Its blocks' key summaries as the sparse step reads a row's (`far_source.SparseRow`): its far
        blocks start at its first block."""
        return self.summaries.summaries if self.summaries is not None else None

    def add_hashes(self, req_id: str, start: int, hashes: Sequence[str]) -> None:
        """Hashes of its full blocks start.. (sent by the scheduler side as blocks fill)."""
        if start > len(self.hashes):
            raise ValueError(f"request {req_id}: block hashes from {start} arrived, but only {len(self.hashes)} are known")
        for h in self.hashes[start:]:
            self.index.pop(h, None)
        del self.hashes[start:]
        self.index.update((h, start + i) for i, h in enumerate(hashes))
        self.hashes.extend(hashes)


class FarPins:
    """Pins requests' far blocks in the store's CPU tier, and gives them back.

    store: the engine's `VllmKVStore`. device_slots: keep each request's pinned slots on the
    device too (the sparse policy reads them there), in buffers of max_blocks entries when known.
    """

    def __init__(self, store, device_slots: bool, max_blocks: int | None):
        self.store, self.device_slots, self.max_blocks = store, device_slots, max_blocks
        self._spare_slot_lists: list[list[torch.Tensor]] = []

    def pin(self, req_id: str, req: FarRequest, num_blocks: int) -> int:
        """Pin blocks [pinned, num_blocks) of every layer in the CPU tier (promoting from below);
        returns how many blocks of each layer it pinned."""
        num_layers = self.store.num_layers
        if not req.pinned_keys:
            req.pinned_keys = [[] for _ in range(num_layers)]
            req.pinned_slots = [torch.empty(0, dtype=torch.int64) for _ in range(num_layers)]
            # sized for the longest request when known: the buffer never moves, so no graph recaptures
            if self._spare_slot_lists:  # a finished request's (entries past the pinned count are unused)
                req.pinned_slots_dev = self._spare_slot_lists.pop()
            else:
                size = (self.max_blocks or 0) if self.device_slots else 0  # read by the sparse policy only
                req.pinned_slots_dev = [torch.empty(size, dtype=torch.int64, device=self.store.device)
                                        for _ in range(num_layers)]  # fmt: skip
        first = req.pinned_slots[0].numel()
        if num_blocks <= first:
            return 0
        if num_blocks > len(req.hashes):
            raise RuntimeError(f"request {req_id}: {num_blocks} far blocks needed, but the hashes of only "
                               f"{len(req.hashes)} were sent; the connector's metadata is out of step")
        hashes = req.hashes[first:num_blocks]
        groups = self.store.block_groups(hashes)
        rows = self._pin_whole(groups, hashes) if groups is not None else None  # one pin per block
        if rows is not None:
            req.pinned_groups.extend(groups)
            columns = torch.from_numpy(rows.T.copy())  # [layers, blocks]
            for layer in range(num_layers):
                self._add_slots(req, layer, first, columns[layer])
            return len(hashes)
        for layer in range(num_layers):
            keys = self.store.keys(hashes, layer)
            slots = self._pin_layer(req_id, keys, layer, first, num_blocks)
            req.pinned_keys[layer].extend(keys)
            self._add_slots(req, layer, first, torch.tensor(slots, dtype=torch.int64))
        return len(hashes)

    def _pin_whole(self, groups: list[str], hashes: list[str]):
        """The blocks pinned whole, or None. A block's last layers may still be saving when it turns far (their
        D2H lands after the step that wrote them): those saves land first, as the per-key path would wait for
        them, so the request's far blocks are one count each, not one per key for the next request to give back.
        Nothing is waited for when none of their saves is in flight (a block some lower tier holds instead)."""
        saves = self.store.saves
        rows = saves.pin_blocks_for_reader(groups, hashes)
        if rows is None and saves.land(groups):
            rows = saves.pin_blocks_for_reader(groups, hashes)
        return rows

    def _add_slots(self, req: FarRequest, layer: int, first: int, new: torch.Tensor) -> None:
        """Slots of `layer`'s blocks first.. (int64, CPU) appended to the request's, and to its device copy."""
        req.pinned_slots[layer] = torch.cat([req.pinned_slots[layer], new])
        if self.device_slots:
            req.pinned_slots_dev[layer] = append_at(req.pinned_slots_dev[layer], first,
                                                    to_device_no_sync(new, self.store.device))  # fmt: skip

    def _pin_layer(self, req_id: str, keys: list[str], layer: int, first: int, num_blocks: int) -> list[int]:
        slots = self.store.saves.pin_for_reader(keys)
        if slots is None:  # a save still in flight: let it land and look again
            self.store.poll(wait=True)
            slots = self.store.saves.pin_for_reader(keys)
        if slots is None:
            held = self.store.num_held(keys)
            where = f"request {req_id}: far blocks {first}..{num_blocks - 1} of layer {layer}"
            if held < len(keys):  # never saved, or a tier lost them since (evicted, deleted, found corrupt)
                dropped = self.store.counts["saves_dropped"]
                why = (f"; {dropped} saves were dropped since start: every CPU-tier slot was pinned by running requests "
                       "and no tier below took them. The CPU tier must hold every running request's KV (raise "
                       "tiers[0].capacity_bytes, add a disk tier, or lower max_num_seqs)" if dropped else "")
                raise RuntimeError(
                    f"{where}: {len(keys) - held} of {len(keys)} are in no tier (never saved, or lost or found "
                    f"corrupt since: see the tiers' lost_blocks and corrupt_blocks counts){why}")
            raise RuntimeError(
                f"{where} cannot be pinned in the CPU tier (all {len(keys)} found in the tiers); the CPU tier must "
                "hold the far KV of every running request (raise tiers[0].capacity_bytes)")
        return slots

    def keep_slot_lists(self, req: FarRequest) -> None:
        """A finished request's device slot lists serve the next request (same addresses)."""
        if req.pinned_slots_dev:
            self._spare_slot_lists.append(req.pinned_slots_dev)

    def release(self, req: FarRequest, still_needed: Collection[str] = ()) -> None:
        """Unpin a finished request's far blocks, and the saved (or loaded) blocks of it that never became far,
        but for blocks `still_needed` (hashes another running request holds past its far part: their landed
        pins stay for that request's far reader, or its own release)."""
        if req.pinned_groups:
            self.store.saves.unpin_blocks(req.pinned_groups)
        for keys in req.pinned_keys:
            self.store.saves.unpin(keys)
        if self.store.saves.keep_pinned:
            self.store.poll(wait=True)  # saves still in flight land (pinned) before their pins go back
            first = req.num_pinned()  # blocks pinned for reading
            # with the blocks it saved again once far (a save's pin kept for a block its reader held already)
            again = self.store.saves.with_saved_pins(req.hashes[:first])
            mine = [h for h in (*again, *req.hashes[first:]) if h not in still_needed]
            for layer in range(self.store.num_layers):
                self.store.saves.release_pins(self.store.keys(mine, layer))
