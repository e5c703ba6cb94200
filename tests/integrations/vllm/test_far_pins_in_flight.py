"""A far block whose last layers are still saving when it turns far (on a GPU the D2H of a step's last
layers lands after the step) is pinned whole once those saves land, not key by key: the per-key pins
would be given back one by one on the next request's first step (issue 34, target 1)."""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from tests.integrations.vllm.test_store_block_lookup import HASHES, LAYERS, LAYOUT, make_store
from tierkv.integrations.vllm.far_requests import FarPins, FarRequest


class Handle:
    """A save's copy: done only when told, or once waited for."""

    def __init__(self, done: bool):
        self.done, self.waits = done, 0

    def is_done(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waits += 1
        self.done = True


def start_save(store, keys: list[str], done: bool) -> Handle:
    """What `LayerSaves._start_d2h` leaves behind: prepared CPU-tier slots and a copy in flight."""
    slots, evicted = store.cpu.prepare_put(keys)
    assert None not in slots and not evicted
    handle = Handle(done)
    store.saves._pending.append((handle, keys, len(keys) * LAYOUT.num_bytes, slots))
    return handle


@pytest.mark.parametrize("late_layers", [0, 1, LAYERS])
def test_blocks_turning_far_while_their_last_layers_save_are_pinned_whole(late_layers):
    with tempfile.TemporaryDirectory() as root:
        store = make_store(Path(root), 64, 0, 1)
        try:
            store.saves.keep_pinned = True  # the hot window's far-block reader
            hashes = HASHES[:4]
            handles = [start_save(store, store.keys(hashes, layer), done=layer < LAYERS - late_layers)
                       for layer in range(LAYERS)]
            store.poll()  # the landed ones become visible, their pins kept for the reader
            req = FarRequest()
            req.add_hashes("r", 0, hashes)
            pins = FarPins(store, device_slots=False, max_blocks=None)
            assert pins.pin("r", req, len(hashes)) == len(hashes)
            assert req.pinned_groups == store.block_groups(hashes)          # one pin per block
            assert all(not keys for keys in req.pinned_keys)                # none key by key
            assert not store.saves._pins and not store.saves._pin_blocks    # the saves' pins given back
            assert sum(h.waits for h in handles) == late_layers             # only the late saves waited for
            for layer in range(LAYERS):  # the slots given are the keys' own
                slots = store.cpu.acquire(store.keys(hashes, layer))
                store.cpu.release(store.keys(hashes, layer))
                assert req.pinned_slots[layer].tolist() == slots
            pins.release(req)
            assert not store.cpu._pins and not store.cpu._pin_state.blocks.pins
        finally:
            store.close()


def test_a_block_a_lower_tier_holds_waits_for_no_other_save():
    """A far block with a layer on disk only cannot be pinned whole whatever lands: the pin goes key by key
    without waiting for another block's save in flight (a host stall at the step's start on a GPU)."""
    with tempfile.TemporaryDirectory() as root:
        store = make_store(Path(root), 64, 0, 1)
        try:
            store.saves.keep_pinned = True
            far = HASHES[:2]
            block = torch.zeros(LAYOUT.shape, dtype=LAYOUT.dtype)
            for layer in range(LAYERS):  # layer 0 on disk only, the rest in the CPU tier
                keys = store.keys(far, layer)
                store.chain.put_many(keys, [block] * len(keys), start=1 if layer == 0 else 0)
            other = start_save(store, store.keys([HASHES[4]], LAYERS - 1), done=False)
            req = FarRequest()
            req.add_hashes("r", 0, far)
            pins = FarPins(store, device_slots=False, max_blocks=None)
            assert pins.pin("r", req, len(far)) == len(far)
            assert other.waits == 0 and not req.pinned_groups                # key by key, nothing waited for
            assert all(len(keys) == len(far) for keys in req.pinned_keys)
            pins.release(req)
            other.synchronize()
            store.poll()
            store.saves.release_pins(list(store.saves._pins))
            assert not store.cpu._pins
        finally:
            store.close()
