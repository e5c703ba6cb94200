"""The CPU tier's prepare_put of new blocks into free slots (C-level passes) and complete_put against the
per-key loop: on random sequences of two-phase puts (keys listed twice, already pending or visible, more
keys than free slots), puts, evictions, reads and removes, the same slots in the same order, the same free
list, pins, pending writes, LRU order and per-block index."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.blocks import BlockLayout
from tierkv.storage import CpuTier

LAYOUT = BlockLayout(num_kv_heads=1, block_tokens=2, head_dim=2, dtype=torch.float32)
NAMES = [f"h{b}/L{layer}" for b in range(5) for layer in range(2)] + ["other"]


class OneByOneCpuTier(CpuTier):
    """prepare_put always through its per-key loop."""

    def _fresh_with_room(self, keys):
        return False


keys_st = st.lists(st.sampled_from(NAMES), max_size=10)
ops_st = st.lists(st.one_of(
    st.tuples(st.just("two_phase"), keys_st, st.sampled_from(["complete", "keep", "abort", "later"])),
    st.tuples(st.just("complete_later"), st.booleans()),
    st.tuples(st.just("put"), keys_st),
    st.tuples(st.just("acquire"), keys_st),
    st.tuples(st.just("release"), keys_st),
    st.tuples(st.just("remove"), st.sampled_from(NAMES)),
), max_size=40)


def apply(tier: CpuTier, op: tuple, later: list) -> object:
    kind = op[0]
    if kind == "two_phase":
        keys, then = op[1], op[2]
        slots, evicted = tier.prepare_put(keys)  # keys as given: repeats and pending keys included
        ready = [k for k, s in zip(keys, slots) if s is not None]
        if ready:
            tier.write_slots([s for s in slots if s is not None], torch.full((len(ready), *LAYOUT.shape), -1.0))
        if then == "later":
            later.append(ready)
        elif then == "abort":
            tier.abort_put(ready)
        else:
            tier.complete_put(ready, keep_pinned=then == "keep")
        return slots, [k for k, _ in evicted]
    if kind == "complete_later":
        if later:
            tier.complete_put(later.pop(0), keep_pinned=op[1])
        return None
    if kind == "put":
        keys = list(dict.fromkeys(op[1]))
        return [(r.ok, [k for k, _ in r.evicted]) for r in tier.put_many(keys, [torch.zeros(LAYOUT.shape)] * len(keys))]
    if kind == "acquire":
        return tier.acquire(op[1])
    if kind == "release":
        return tier.release(op[1])
    return tier.remove(op[1])


def state(tier: CpuTier) -> tuple:
    blocks = tier._blocks
    return (list(tier._slot_of.items()), dict(tier._pins), dict(tier._pending), list(tier._free_slots),
            sorted(tier._prepare_s), dict(blocks.counts), {g: r.tolist() for g, r in blocks.rows.items()})


@settings(max_examples=400, deadline=None)
@given(ops=ops_st, num_slots=st.integers(1, 12))
def test_the_fast_put_matches_the_per_key_loop(ops, num_slots):
    tiers = [cls("cpu", LAYOUT, num_slots * LAYOUT.num_bytes, pin_memory=False) for cls in (CpuTier, OneByOneCpuTier)]
    laters: list[list] = [[], []]
    for tier in tiers:
        tier.index_blocks(2)
    for op in ops:
        assert apply(tiers[0], op, laters[0]) == apply(tiers[1], op, laters[1]), op
        assert state(tiers[0]) == state(tiers[1]), op
    for tier, later in zip(tiers, laters):  # the writes left pending land; every slot is accounted for
        for ready in later:
            tier.complete_put(ready)
        assert len(tier._free_slots) + len(tier._slot_of) == num_slots and not tier._pending
    assert state(tiers[0]) == state(tiers[1])


def test_a_batch_of_new_keys_takes_the_free_slots_in_order():
    tier = CpuTier("cpu", LAYOUT, 4 * LAYOUT.num_bytes, pin_memory=False)
    slots, evicted = tier.prepare_put(["a/L0", "b/L0", "c/L0", "d/L0"])  # exactly as many keys as free slots
    assert slots == [0, 1, 2, 3] and not evicted and not tier._free_slots
    tier.complete_put(["a/L0", "b/L0", "c/L0", "d/L0"])
    assert list(tier._slot_of.items()) == [("a/L0", 0), ("b/L0", 1), ("c/L0", 2), ("d/L0", 3)] and not tier._pins
