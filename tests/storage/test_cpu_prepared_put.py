"""The CPU tier's put path under interrupts: `prepared_put` gives back what its block leaves pending, and an
interrupt (Ctrl-C) inside prepare_put's per-key path loses no slot."""
from __future__ import annotations

import pytest
import torch

from tests.storage.test_cpu_slots import LAYOUT
from tierkv.blocks import BlockLayout
from tierkv.storage import CpuTier


def full_tier(num_slots: int = 3) -> CpuTier:
    """A tier whose every slot holds an unpinned block ("b0", "b1", ... LRU first): puts evict."""
    tier = CpuTier("cpu", LAYOUT, num_slots * LAYOUT.num_bytes)
    tier.put_many([f"b{i}" for i in range(num_slots)], [torch.full(LAYOUT.shape, float(i)) for i in range(num_slots)])
    return tier


def assert_every_slot_accounted(tier: CpuTier) -> None:
    """Each slot is free, pending or visible, exactly once."""
    slots = list(tier._free_slots) + list(tier._pending.values()) + list(tier._slot_of.values())
    assert sorted(slots) == list(range(tier.num_slots))


class Copy:
    """A copy enqueued into prepared slots; notes when it was waited for."""

    def __init__(self, log: list):
        self.log = log

    def synchronize(self) -> None:
        self.log.append("synchronize")


class RaisingRecord(list):
    """An owner's record of handed-over puts; a KeyboardInterrupt lands just after the append."""

    def append(self, entry) -> None:
        super().append(entry)
        raise KeyboardInterrupt


# -- CpuTier._allocate: an interrupt between taking a slot and recording it pending ------------------------
@pytest.mark.parametrize("key", ["x", "b0"])  # a new block (evicts the LRU one), a rewrite of a visible one
def test_interrupt_as_a_slot_is_taken_loses_no_slot(monkeypatch, key):
    """Ctrl-C as `_take_slot` returns to `_allocate` (a SIGINT during it is raised there): the slot it took is
    pending already, so prepare_put's give-back frees it; every slot is usable again."""
    tier = full_tier()
    take = tier._take_slot

    def take_then_interrupt(*args, **kwargs):
        take(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(tier, "_take_slot", take_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        tier.prepare_put([key])
    monkeypatch.undo()
    assert not tier._pending and not tier._pins
    assert len(tier._free_slots) == 1 and len(tier._slot_of) == 2
    assert_every_slot_accounted(tier)
    slots, _ = tier.prepare_put(["n0", "n1", "n2"])
    assert None not in slots


def test_interrupt_while_an_evicted_block_is_copied_out_loses_no_slot(monkeypatch):
    """Ctrl-C while `_take_slot` clones the evicted block for the next tier (its slot already out of the index)."""
    tier = full_tier()

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(tier, "read_slots", interrupt)
    with pytest.raises(KeyboardInterrupt):
        tier.prepare_put(["x"])
    monkeypatch.undo()
    assert not tier._pending and len(tier._free_slots) == 1
    assert_every_slot_accounted(tier)


# -- CpuSlotAccess.prepared_put ------------------------------------------------------------------------------
@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_prepared_slots_are_given_back_when_the_block_raises_after_the_copy_ended(error):
    tier = CpuTier("cpu", LAYOUT, 4 * LAYOUT.num_bytes)
    log = []
    with pytest.raises(error), tier.prepared_put(["a", "b"]) as put:
        assert None not in put.slots and tier.held_or_written(["a", "b"]) == [True, True]
        put.copy = Copy(log)
        log.append("raise")
        raise error
    assert log == ["raise", "synchronize"]  # the copy into the slots ended before they went back
    assert not tier._pending and not tier._pins and len(tier._free_slots) == 4


def test_prepared_slots_are_given_back_when_the_block_returns_without_completing():
    """A refusal: the block ends without `complete` or `hand_over`, and the slots that were granted go back."""
    tier = CpuTier("cpu", LAYOUT, 2 * LAYOUT.num_bytes)
    tier.prepare_put(["p"])  # another writer's slot, pending
    with tier.prepared_put(["p", "a", "b"]) as put:
        assert put.slots[0] is None and put.slots.count(None) == 2  # "p" being written, one slot for a or b
    assert list(tier._pending) == ["p"]  # the other writer's pending key left alone
    assert_every_slot_accounted(tier)


def test_completed_or_handed_over_slots_stay():
    tier = CpuTier("cpu", LAYOUT, 4 * LAYOUT.num_bytes)
    with tier.prepared_put(["a"]) as put:
        tier.write_slots(put.slots, torch.ones((1, *LAYOUT.shape)))
        put.complete(keep_pinned=True)
    assert tier.contains("a") and tier._pins["a"] == 1
    record = []
    with tier.prepared_put(["b"]) as put:
        put.copy = Copy([])
        put.hand_over(record, ("b", put.copy))
    assert record == [("b", put.copy)] and tier._pending == {"b": put.slots[0]}


def test_an_interrupt_just_after_the_hand_over_gives_nothing_back():
    """Ctrl-C as the record's append returns: the owner holds the put (and completes it later), so the slots stay."""
    tier = CpuTier("cpu", LAYOUT, 4 * LAYOUT.num_bytes)
    record = RaisingRecord()
    with pytest.raises(KeyboardInterrupt), tier.prepared_put(["a"]) as put:
        put.copy = Copy([])
        put.hand_over(record, (["a"], put.copy))
    assert list(record) == [(["a"], put.copy)] and list(tier._pending) == ["a"]
    tier.complete_put(["a"])
    assert tier.contains("a")


def test_a_block_refused_a_key_gives_back_no_other_writers_slot():
    layout = BlockLayout(num_kv_heads=2, block_tokens=4, head_dim=8, dtype=torch.float32)
    cpu = CpuTier("cpu", layout, 2 * layout.num_bytes, pin_memory=False)
    cpu.put_many(["a", "b"], [torch.zeros(layout.shape), torch.ones(layout.shape)])
    cpu.acquire(["a", "b"])  # every slot pinned by a reader
    with cpu.prepared_put(["k"]) as put:
        assert put.slots == [None]  # refused
        cpu.release(["a"])
        other_slots, _ = cpu.prepare_put(["k"])  # another writer prepares k meanwhile
        assert other_slots[0] is not None
    assert "k" in cpu._pending  # the block took nothing: it gives back nothing
    cpu.write_slots(other_slots, torch.full((1, *layout.shape), 7.0))
    cpu.complete_put(["k"])
    assert torch.equal(cpu.get_many(["k"])[0], torch.full(layout.shape, 7.0))
