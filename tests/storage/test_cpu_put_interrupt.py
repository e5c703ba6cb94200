"""The CPU tier's direct put (`put_many`) and its drops under interrupts: a KeyboardInterrupt (Ctrl-C) between
taking a slot and indexing it, or inside a drop, loses no slot, leaves nothing pending and keeps the per-block
index (`index_blocks`) to the visible keys; the same put run again lands."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from tests.storage.test_cpu_prepared_put import assert_every_slot_accounted
from tests.storage.test_cpu_slots import LAYOUT
from tierkv.storage import CpuTier

NUM_SLOTS = 3
CASES = {  # what the interrupted put of "h/L0" does with its slot
    "free": [],  # takes a free slot
    "evict": ["b/L0", "c/L0", "d/L0"],  # evicts the LRU block ("b/L0")
    "rewrite": ["h/L0", "b/L0"],  # reuses its own slot
}


def block(value: float) -> torch.Tensor:
    return torch.full(LAYOUT.shape, value)


def tier_holding(keys: list[str], *, num_layers: int | None = None) -> CpuTier:
    tier = CpuTier("cpu", LAYOUT, NUM_SLOTS * LAYOUT.num_bytes)
    if num_layers is not None:
        tier.index_blocks(num_layers)
    tier.put_many(keys, [block(float(i)) for i in range(len(keys))])
    return tier


def interrupt_before(monkeypatch, owner, name: str) -> None:
    """owner.name raises KeyboardInterrupt instead of running."""
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(owner, name, interrupted)


def interrupt_after(monkeypatch, owner, name: str) -> None:
    """owner.name runs, then raises KeyboardInterrupt (a Ctrl-C as it returns)."""
    method = getattr(owner, name)

    def interrupted(*args, **kwargs):
        method(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(owner, name, interrupted)


def assert_consistent(tier: CpuTier) -> None:
    """Every slot free, pending or visible once; nothing pending; the per-block index counts the visible keys."""
    assert_every_slot_accounted(tier)
    assert not tier._pending and not tier._pins
    if tier._blocks is not None:
        counted = Counter(tier._blocks.group(key) for key in tier._slot_of)
        counted.pop(None, None)
        assert tier._blocks.counts == dict(counted)
        for key, slot in tier._slot_of.items():
            group, layer = tier._blocks.locate(key)
            assert tier._blocks.rows[group][layer] == slot


def assert_put_lands(tier: CpuTier, others: dict[str, float]) -> None:
    """The interrupted put, run again, lands and reads back; blocks it did not touch read back as before."""
    assert tier.put("h/L0", block(7.0)).ok
    assert torch.equal(tier.get("h/L0"), block(7.0))
    for key, value in others.items():
        if tier.contains(key):
            assert torch.equal(tier.get(key), block(value))
    assert_consistent(tier)


def untouched(keys: list[str]) -> dict[str, float]:
    return {key: float(i) for i, key in enumerate(keys) if key != "h/L0"}


# -- put_many: between taking a slot and indexing it ---------------------------------------------------------
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("where", ["as the slot is taken", "before the write", "after the write"])
def test_an_interrupted_put_loses_no_slot(monkeypatch, case, where):
    keys = CASES[case]
    tier = tier_holding(keys)
    if where == "as the slot is taken":
        interrupt_after(monkeypatch, tier, "_take_slot")
    elif where == "before the write":
        interrupt_before(monkeypatch, tier, "write_slots")
    else:
        interrupt_after(monkeypatch, tier, "write_slots")
    with pytest.raises(KeyboardInterrupt):
        tier.put_many(["h/L0"], [block(7.0)])
    monkeypatch.undo()
    assert_consistent(tier)
    assert len(tier._free_slots) + len(tier._slot_of) == NUM_SLOTS
    assert_put_lands(tier, untouched(keys))


def test_an_interrupt_while_the_evicted_block_is_read_out_loses_no_slot(monkeypatch):
    keys = CASES["evict"]
    tier = tier_holding(keys)
    interrupt_before(monkeypatch, tier, "read_slots")
    with pytest.raises(KeyboardInterrupt):
        tier.put_many(["h/L0"], [block(7.0)])
    monkeypatch.undo()
    assert_consistent(tier)
    assert_put_lands(tier, untouched(keys))


def test_an_interrupt_part_way_through_a_batch_keeps_what_landed(monkeypatch):
    """The second key's write is interrupted: the first key stays stored and readable, the second's slot is free."""
    tier = tier_holding([])
    write = tier.write_slots
    calls = []

    def second_write_interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        write(*args, **kwargs)

    monkeypatch.setattr(tier, "write_slots", second_write_interrupted)
    with pytest.raises(KeyboardInterrupt):
        tier.put_many(["a/L0", "h/L0"], [block(1.0), block(7.0)])
    monkeypatch.undo()
    assert list(tier._slot_of) == ["a/L0"] and torch.equal(tier.get("a/L0"), block(1.0))
    assert_consistent(tier)
    assert_put_lands(tier, {"a/L0": 1.0})


# -- the per-block index (index_blocks) ----------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES)
def test_an_interrupt_before_the_block_index_counts_the_put(monkeypatch, case):
    """The key is visible but not yet counted per block: a block index that counts less than is held (a miss) is
    safe, and the put run again (a rewrite: the drop of an uncounted key) leaves the counts exact."""
    keys = CASES[case]
    tier = tier_holding(keys, num_layers=1)
    interrupt_before(monkeypatch, tier._blocks, "add_many")
    with pytest.raises(KeyboardInterrupt):
        tier.put_many(["h/L0"], [block(7.0)])
    monkeypatch.undo()
    assert_every_slot_accounted(tier)
    assert tier.held_prefix(["h"]) == 0  # not counted: a miss, never a slot that is not h's
    assert_put_lands(tier, untouched(keys))
    assert tier.held_prefix(["h"]) == 1


@pytest.mark.parametrize("name", ["remove", "_drop"])
def test_an_interrupt_inside_a_drop_loses_no_slot_and_keeps_the_block_index(monkeypatch, name):
    """Ctrl-C as the per-block index forgets a rewritten key (or as the whole drop returns): its slot stays in
    a list, and the block index never counts a key that is not visible, nor twice."""
    tier = tier_holding(["h/L1", "h/L0"], num_layers=2)
    assert tier.held_prefix(["h"]) == 1
    interrupt_after(monkeypatch, *((tier._blocks, "remove") if name == "remove" else (tier, "_drop")))
    with pytest.raises(KeyboardInterrupt):
        tier.put_many(["h/L0"], [block(7.0)])
    monkeypatch.undo()
    assert_every_slot_accounted(tier)
    assert tier.held_prefix(["h"]) == 0
    assert_put_lands(tier, {"h/L1": 0.0})
    assert tier.held_prefix(["h"]) == 1
    assert torch.equal(tier.get("h/L1"), block(0.0))


@pytest.mark.parametrize("name", ["remove", "_drop"])
def test_an_interrupted_remove_loses_no_slot(monkeypatch, name):
    tier = tier_holding(["h/L1", "h/L0"], num_layers=2)
    interrupt_after(monkeypatch, *((tier._blocks, "remove") if name == "remove" else (tier, "_drop")))
    with pytest.raises(KeyboardInterrupt):
        tier.remove("h/L0")
    monkeypatch.undo()
    assert_every_slot_accounted(tier)
    assert tier.held_prefix(["h"]) == 0
    tier.remove("h/L0")  # still visible (interrupted before it left the index) or gone: either way absent now
    assert not tier.contains("h/L0")
    assert_consistent(tier)
    assert_put_lands(tier, {"h/L1": 0.0})
