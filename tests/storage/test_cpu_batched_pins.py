"""The CPU tier's batched acquire and release against the per-key logic they replaced, on random
sequences of puts, two-phase puts, evictions, removes, reads, pins and unpins: the same slots,
the same LRU order, the same pin counts, the same evictions and refusals."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.blocks import BlockLayout
from tierkv.storage import CpuTier

LAYOUT = BlockLayout(num_kv_heads=1, block_tokens=2, head_dim=2, dtype=torch.float32)
NAMES = [f"h{b}/L{layer}" for b in range(4) for layer in range(3)] + ["other"]


class PerKeyCpuTier(CpuTier):
    """acquire and release as they were: one Python step per key."""

    def acquire(self, keys):
        with self._lock:
            slot_of = self._slot_of
            slots = [slot_of.get(k) for k in keys]
            num_hits = 0
            for key, slot in zip(keys, slots):
                if slot is not None:
                    slot_of.move_to_end(key)
                    self._pins[key] = self._pins.get(key, 0) + 1
                    num_hits += 1
        self.counters.record_lookups(num_hits, len(keys) - num_hits, num_hits * self.slot_bytes)
        return slots

    def release(self, keys):
        with self._lock:
            for key in keys:
                self._unpin(key)


keys_st = st.lists(st.sampled_from(NAMES), max_size=8)
ops_st = st.lists(st.one_of(
    st.tuples(st.just("put"), keys_st),
    st.tuples(st.just("two_phase"), keys_st, st.booleans(), st.booleans()),
    st.tuples(st.just("acquire"), keys_st),
    st.tuples(st.just("release"), keys_st),
    st.tuples(st.just("remove"), st.sampled_from(NAMES)),
    st.tuples(st.just("get"), keys_st),
), max_size=40)


def apply(tier: CpuTier, op: tuple) -> object:
    """One operation; returns what a caller sees of it."""
    kind, keys = op[0], op[1]
    if kind == "put":
        keys = list(dict.fromkeys(keys))
        results = tier.put_many(keys, [torch.full(LAYOUT.shape, float(i)) for i in range(len(keys))])
        return [(r.ok, [k for k, _ in r.evicted]) for r in results]
    if kind == "two_phase":
        keys = list(dict.fromkeys(keys))
        slots, evicted = tier.prepare_put(keys)
        ready = [k for k, s in zip(keys, slots) if s is not None]
        if ready:
            tier.write_slots([s for s in slots if s is not None], torch.full((len(ready), *LAYOUT.shape), -1.0))
        if op[2]:
            tier.complete_put(ready, keep_pinned=op[3])
        else:
            tier.abort_put(ready)
        return slots, [k for k, _ in evicted]
    if kind == "acquire":
        return tier.acquire(keys)
    if kind == "release":
        return tier.release(keys)
    if kind == "remove":
        return tier.remove(keys)
    return [None if b is None else b.tolist() for b in tier.get_many(keys)]


def state(tier: CpuTier) -> tuple:
    return list(tier._slot_of.items()), dict(tier._pins), dict(tier._pending), sorted(tier._free_slots)


@settings(max_examples=300, deadline=None)
@given(ops=ops_st, num_slots=st.integers(1, 6))
def test_batched_pins_match_the_per_key_logic(ops, num_slots):
    new, old = (cls("cpu", LAYOUT, num_slots * LAYOUT.num_bytes, pin_memory=False) for cls in (CpuTier, PerKeyCpuTier))
    for op in ops:
        assert apply(new, op) == apply(old, op), op
        assert state(new) == state(old), op
        assert all(count > 0 for count in new._pins.values())  # no zero or negative counts kept
    # every pin given back (as many releases as acquires) leaves only the pending writes' and kept saves' pins
    for key, count in list(old._pins.items()):
        new.release([key] * count)
        old.release([key] * count)
    assert dict(new._pins) == dict(old._pins) == {}
    assert state(new) == state(old)


def test_pins_of_a_batch_balance_to_zero_and_pinned_blocks_are_not_evicted():
    tier = CpuTier("cpu", LAYOUT, 3 * LAYOUT.num_bytes, pin_memory=False)
    tier.put_many(["a", "b", "c"], [torch.zeros(LAYOUT.shape)] * 3)
    slot_a, slot_b = tier._slot_of["a"], tier._slot_of["b"]
    assert tier.acquire(["a", "b", "a", "missing"]) == [slot_a, slot_b, slot_a, None]
    assert dict(tier._pins) == {"a": 2, "b": 1}
    assert list(tier._slot_of) == ["c", "b", "a"]  # bumped in key order
    result = tier.put("d", torch.ones(LAYOUT.shape))
    assert result.ok and [k for k, _ in result.evicted] == ["c"]  # the only unpinned block
    tier.release(["a", "b"])
    assert dict(tier._pins) == {"a": 1} and not tier.remove("a") and tier.remove("b")
    tier.release(["a", "a", "never-pinned"])
    assert dict(tier._pins) == {} and tier.remove("a")
