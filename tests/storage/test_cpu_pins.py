"""Whole-block pins of the CPU tier (`CpuTier.acquire_blocks` / `release_blocks`, `cpu_pins`) on random
sequences of puts, evictions, removes, per-key pins and whole-block pins: a pinned block keeps every layer
in the slots it was given until released, the slots are the ones the keys hold, a block not held in every
layer is refused whole, and nothing stays pinned after the releases."""
from __future__ import annotations

import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from tierkv.blocks import BlockLayout
from tierkv.storage import CpuTier

LAYOUT = BlockLayout(num_kv_heads=1, block_tokens=2, head_dim=2, dtype=torch.float32)
LAYERS = 3
GROUPS = [f"h{b}" for b in range(5)]
KEYS = [f"{g}/L{layer}" for g in GROUPS for layer in range(LAYERS)]
SLOTS = 10

groups_st = st.lists(st.sampled_from(GROUPS), min_size=1, max_size=2)
keys_st = st.lists(st.sampled_from(KEYS), max_size=6)
blocks_put_st = groups_st.map(lambda groups: [f"{g}/L{layer}" for g in groups for layer in range(LAYERS)])
ops_st = st.lists(st.one_of(
    st.tuples(st.just("put"), keys_st),
    st.tuples(st.just("put"), blocks_put_st),  # whole blocks, every layer
    st.tuples(st.just("put"), blocks_put_st),
    st.tuples(st.just("pin_blocks"), groups_st),
    st.tuples(st.just("pin_blocks"), groups_st),
    st.tuples(st.just("unpin_blocks"), groups_st),
    st.tuples(st.just("acquire"), keys_st),
    st.tuples(st.just("release"), keys_st),
    st.tuples(st.just("remove"), st.sampled_from(KEYS)),
), max_size=40)


def _tier() -> CpuTier:
    tier = CpuTier("cpu", LAYOUT, SLOTS * LAYOUT.num_bytes, pin_memory=False)
    tier.index_blocks(LAYERS)
    return tier


def _block(value: float) -> torch.Tensor:
    return torch.full(LAYOUT.shape, value)


@settings(max_examples=1000, deadline=None)
@given(ops_st)
def test_whole_block_pins_keep_their_blocks_until_released(ops):
    tier = _tier()
    held: dict[str, int] = {}        # group -> whole pins the test holds
    given_slots: dict[str, list[int]] = {}  # group -> the slots acquire_blocks gave
    key_pins: list[str] = []         # per-key pins the test holds
    values: dict[str, float] = {}    # key -> the value last put
    for step, op in enumerate(ops):
        kind, arg = op
        if kind == "put":
            keys = list(dict.fromkeys(arg))
            results = tier.put_many(keys, [_block(step + i / 10) for i in range(len(keys))])
            for key, result in zip(keys, results):
                if result.evicted and any(held.values()):
                    event("an eviction beside a block pinned whole")
                for victim, _ in result.evicted:
                    assert held.get(victim.split("/")[0], 0) == 0, f"{victim} evicted while its block was pinned"
                    values.pop(victim, None)
                if result.ok:
                    values[key] = step + keys.index(key) / 10
                else:  # refused: the key itself is pinned, or every slot is
                    assert key in key_pins or held.get(key.split("/")[0], 0) or "pinned" in result.error
                    if "slots are pinned" in result.error:  # and then no visible key was free to evict
                        assert all(tier._pin_state.pinned(k) for k in tier._slot_of), result.error
        elif kind == "pin_blocks":
            whole = all(tier.contains(f"{g}/L{layer}") for g in arg for layer in range(LAYERS))
            rows = tier.acquire_blocks(arg)
            assert (rows is not None) == whole  # a block missing a layer is refused whole, nothing pinned
            event("a block pinned whole" if rows is not None else "a pin refused: a layer missing")
            if rows is not None:
                assert rows.shape == (len(arg), LAYERS)
                for g, row in zip(arg, rows.tolist()):
                    slots = tier.acquire([f"{g}/L{layer}" for layer in range(LAYERS)])
                    tier.release([f"{g}/L{layer}" for layer in range(LAYERS)])
                    assert row == slots  # the slots the keys hold
                    held[g] = held.get(g, 0) + 1
                    given_slots[g] = row
        elif kind == "unpin_blocks":
            tier.release_blocks(arg)  # a block without a pin is left alone
            for g in arg:
                if held.get(g, 0):
                    held[g] -= 1
        elif kind == "acquire":
            slots = tier.acquire(arg)
            key_pins.extend(k for k, s in zip(arg, slots) if s is not None)
        elif kind == "release":
            tier.release(arg)
            for k in arg:
                if k in key_pins:
                    key_pins.remove(k)
        else:
            removed = tier.remove(arg)
            if held.get(arg.split("/")[0], 0) or arg in key_pins:
                assert not removed
            elif removed:
                values.pop(arg, None)
        # every block pinned whole is still there, in the slots it was given, with its bytes
        for g, count in held.items():
            if count:
                slots = tier.acquire([f"{g}/L{layer}" for layer in range(LAYERS)])
                tier.release([f"{g}/L{layer}" for layer in range(LAYERS)])
                assert slots == given_slots[g]
                for layer in range(LAYERS):
                    key = f"{g}/L{layer}"
                    assert torch.equal(tier.get(key), _block(values[key]))
    # everything given back: the whole tier takes new blocks again
    tier.release_blocks([g for g, count in held.items() for _ in range(count)])
    tier.release(key_pins)
    fresh = [f"new{i}/L0" for i in range(SLOTS)]
    assert all(r.ok for r in tier.put_many(fresh, [_block(1.0)] * SLOTS))


def test_a_tier_of_whole_pinned_blocks_refuses_puts_and_frees_them_on_release():
    """Two blocks of three layers pin six of six slots: a put is refused at once (no eviction of a pinned
    block), a remove is refused; once released the same put evicts the least recently used block's key."""
    tier = CpuTier("cpu", LAYOUT, 6 * LAYOUT.num_bytes, pin_memory=False)
    tier.index_blocks(LAYERS)
    keys = [f"{g}/L{layer}" for g in ("a", "b") for layer in range(LAYERS)]
    assert all(r.ok for r in tier.put_many(keys, [_block(float(i)) for i in range(6)]))
    rows = tier.acquire_blocks(["a", "b"])
    assert rows.tolist() == [tier.acquire(keys[:3]), tier.acquire(keys[3:])] and tier.release(keys) is None
    refused = tier.put_many(["c/L0"], [_block(9.0)])[0]
    assert not refused.ok and "pinned" in refused.error
    assert not tier.remove("a/L1")
    assert tier.acquire_blocks(["a", "missing"]) is None  # a block not held: nothing more pinned
    tier.release_blocks(["a"])
    evicted = tier.put_many(["c/L0"], [_block(9.0)])[0]
    assert evicted.ok and [k for k, _ in evicted.evicted][0].startswith("a/")  # b is still pinned
    tier.release_blocks(["b", "b"])  # one pin given back; the second finds none
    assert tier.remove("b/L0")


def test_released_blocks_are_evicted_after_older_unread_blocks():
    """A block read whole (pinned, then released) counts as recently used: the walk gives its keys a second
    chance and evicts an older block that was not read first, as a per-key acquire's LRU move would."""
    tier = CpuTier("cpu", LAYOUT, 6 * LAYOUT.num_bytes, pin_memory=False)
    tier.index_blocks(LAYERS)
    old = [f"old/L{layer}" for layer in range(LAYERS)]
    young = [f"young/L{layer}" for layer in range(LAYERS)]
    tier.put_many(old + young, [_block(1.0)] * 6)  # old is the least recently used
    assert tier.acquire_blocks(["old"]) is not None
    tier.release_blocks(["old"])  # read: now more recent than young
    results = tier.put_many(["new/L0", "new/L1", "new/L2"], [_block(2.0)] * 3)
    assert sorted(k for r in results for k, _ in r.evicted) == sorted(young)
    assert all(tier.contains(k) for k in old)


def test_a_block_released_then_partly_removed_does_not_make_the_walk_refuse_a_put():
    """A block read whole gets one second chance per layer; once some of its layers are removed, it keeps no
    more chances than layers it still holds, or an eviction walk among pinned keys spends its bound on the
    extra chances and refuses a put while an unpinned key was there to evict."""
    tier = CpuTier("cpu", LAYOUT, 3 * LAYOUT.num_bytes, pin_memory=False)
    tier.index_blocks(LAYERS)
    tier.put_many([f"g/L{layer}" for layer in range(LAYERS)], [_block(1.0)] * LAYERS)
    assert tier.acquire_blocks(["g"]) is not None
    tier.release_blocks(["g"])  # three chances, one per layer
    assert tier.remove("g/L0") and tier.remove("g/L1")  # one layer left
    assert all(r.ok for r in tier.put_many(["a/L0", "b/L0"], [_block(2.0)] * 2))
    assert tier.acquire(["a/L0", "b/L0"]) == [tier.acquire(["a/L0"])[0], tier.acquire(["b/L0"])[0]]
    put = tier.put_many(["c/L0"], [_block(3.0)])[0]
    assert put.ok and [k for k, _ in put.evicted] == ["g/L2"], put.error


def test_a_released_block_with_layers_pinned_key_by_key_gives_each_unpinned_key_one_chance():
    """Chances are per key, not a count per block: with two of three layers pinned by a per-key reader, the
    third key must not spend the block's three chances (one per walk over the tier) and make a put fail."""
    tier = CpuTier("cpu", LAYOUT, 3 * LAYOUT.num_bytes, pin_memory=False)
    tier.index_blocks(LAYERS)
    tier.put_many([f"g/L{layer}" for layer in range(LAYERS)], [_block(1.0)] * LAYERS)
    assert tier.acquire_blocks(["g"]) is not None
    tier.release_blocks(["g"])
    assert None not in tier.acquire(["g/L0", "g/L1"])
    put = tier.put_many(["c/L0"], [_block(3.0)])[0]
    assert put.ok and [k for k, _ in put.evicted] == ["g/L2"], put.error
