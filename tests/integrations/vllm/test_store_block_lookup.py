"""present_prefix answers per block from the CPU tier's per-block layer counts, then key by key
for the rest: the same prefix length as a lookup of every layer's key in every tier, on random
placements of blocks held for some layers only, in the CPU tier, on disk or nowhere, with
evictions, removes and pins in between, for one rank and for tensor-parallel ranks."""
from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from tierkv.blocks import BlockLayout
from tierkv.config import load_config
from tierkv.integrations.vllm.store import VllmKVStore

BS, H, D, LAYERS = 4, 1, 2, 3
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
LAYOUT = BlockLayout(H, BS, D, torch.float32)
HASHES = [f"{i:02x}ab" for i in range(5)]
ODD = ["x/L0", "x/L1", "x/L2"]  # hashes with "/": the keys of one look like another's in block-key form
ALL = HASHES + ODD


def make_store(root: Path, cpu_blocks: int, tp_rank: int, tp_size: int) -> VllmKVStore:
    block_bytes = LAYOUT.num_bytes
    (root / "tierkv.yaml").write_text("\n".join([
        "cache:", f"  block_tokens: {BS}",
        "tiers:", "  - kind: cpu", f"    capacity_bytes: {cpu_blocks * block_bytes}",
        "  - kind: disk", f"    path: {root / 'disk'}", f"    capacity_bytes: {4096 * block_bytes}",
        "    trusted: true",
        "scheduler:", "  lookahead_layers: 1", f"  staging_bytes: {64 * block_bytes}"]) + "\n")
    return VllmKVStore(load_config(str(root / "tierkv.yaml"), env={}), LAYOUT, NAMES, "m", "cpu",
                       tp_rank=tp_rank, tp_size=tp_size)


def per_key_prefix(store: VllmKVStore, hashes: list[str]) -> int:
    """The reference: a block counts when every layer's key is in some tier."""
    for i, h in enumerate(hashes):
        keys = [store.keys([h], layer)[0] for layer in range(LAYERS)]
        if any(where is None for where in store.chain.locate_many(keys)):
            return i
    return len(hashes)


FOREIGN = ["/L0{}", "/L{}0", "/L+{}", "/L-{}", f"/L{LAYERS}"]  # keys no store builds (put in the CPU tier)
cell = st.tuples(st.integers(0, len(ALL) - 1), st.integers(0, LAYERS - 1))
ops_st = st.lists(st.one_of(
    st.tuples(st.just("cpu"), st.lists(cell, min_size=1, max_size=8)),    # put in the CPU tier (evicts to disk)
    st.tuples(st.just("disk"), st.lists(cell, min_size=1, max_size=8)),   # put on disk only
    st.tuples(st.just("foreign"), st.lists(st.tuples(cell, st.sampled_from(FOREIGN)), min_size=1, max_size=4)),
    st.tuples(st.just("remove_cpu"), cell),
    st.tuples(st.just("remove_all"), cell),
    st.tuples(st.just("pin"), st.lists(cell, max_size=8)),
    st.tuples(st.just("unpin"), st.lists(cell, max_size=8)),
), min_size=1, max_size=25)


def apply(store: VllmKVStore, op: tuple) -> None:
    kind, arg = op
    if kind == "foreign":
        keys = list(dict.fromkeys(ALL[b] + form.format(layer) for (b, layer), form in arg))
        store.chain.put_many(keys, [torch.zeros(LAYOUT.shape) for _ in keys])
        store.chain.flush()
        return
    cells = [arg] if kind.startswith("remove") else arg
    keys = list(dict.fromkeys(store.keys([ALL[b]], layer)[0] for b, layer in cells))
    if kind in ("cpu", "disk"):
        blocks = [torch.zeros(LAYOUT.shape) for _ in keys]
        store.chain.put_many(keys, blocks, start=0 if kind == "cpu" else 1)
    elif kind == "remove_cpu":
        store.cpu.remove(keys[0])
    elif kind == "remove_all":
        store.chain.remove_many(keys)
    elif kind == "pin":
        store.cpu.acquire(keys)
    else:
        store.cpu.release(keys)
    store.chain.flush()


@settings(max_examples=150, deadline=None)
@given(ops=ops_st, cpu_blocks=st.integers(2, 16), tp=st.sampled_from([(0, 1), (1, 2)]))
def test_present_prefix_matches_a_lookup_of_every_key(ops, cpu_blocks, tp):
    with tempfile.TemporaryDirectory() as tmp:
        store = make_store(Path(tmp), cpu_blocks, *tp)
        try:
            hashes = ALL
            for op in ops:
                apply(store, op)
                for start in range(len(hashes)):
                    assert store.present_prefix(hashes[start:]) == per_key_prefix(store, hashes[start:]), (op, start)
            # the per-block counts are what the visible keys say, for every block a lookup asks about
            counts, visible = store.cpu._blocks.counts, store.cpu._slot_of
            suffix = "" if tp[1] == 1 else f"/R{tp[0]}of{tp[1]}"
            for h in hashes:
                held = sum(store.keys([h], layer)[0] in visible for layer in range(LAYERS))
                assert "/" in h or counts.get(h + suffix, 0) == held, h
            assert all(count > 0 for count in counts.values())
        finally:
            store.close()


def test_a_block_held_for_some_layers_ends_the_prefix_wherever_the_rest_is():
    with tempfile.TemporaryDirectory() as tmp:
        store = make_store(Path(tmp), 64, 0, 1)
        try:
            keys = [store.keys(HASHES[:3], layer) for layer in range(LAYERS)]
            store.chain.put_many([k for layer_keys in keys for k in layer_keys], [torch.zeros(LAYOUT.shape)] * 9)
            assert store.present_prefix(HASHES) == 3 and store.cpu.held_prefix(HASHES) == 3
            store.cpu.remove(keys[2][1])  # block 1 lacks its last layer
            assert store.present_prefix(HASHES) == 1 and store.cpu.held_prefix(HASHES) == 1
            store.chain.put_many([keys[2][1]], [torch.zeros(LAYOUT.shape)], start=1)  # on disk: held again
            assert store.present_prefix(HASHES) == 3 and store.cpu.held_prefix(HASHES) == 1
        finally:
            store.close()


def old_pin_for_reader(saves, keys):
    """LayerSaves.pin_for_reader and take_pins as they were: key by key."""
    with saves._lock:
        slots = [saves._pins.pop(k, None) for k in keys]
    rest = [i for i, s in enumerate(slots) if s is None]
    if not rest:
        return slots
    with saves._lock:
        acquired = saves.store.chain.acquire_many([keys[i] for i in rest])
        if acquired is None:
            saves._pins.update((k, s) for k, s in zip(keys, slots) if s is not None)
            return None
    for i, slot in zip(rest, acquired):
        slots[i] = slot
    return slots


pin_cell = st.tuples(st.integers(0, 2), st.integers(0, 1))  # few keys: the ops meet on the same ones
pin_ops = st.lists(st.one_of(
    st.tuples(st.just("cpu"), st.lists(pin_cell, min_size=1, max_size=8)),
    st.tuples(st.just("disk"), st.lists(pin_cell, min_size=1, max_size=8)),
    st.tuples(st.just("land"), st.lists(pin_cell, max_size=8)),      # saves landed and kept pinned
    st.tuples(st.just("read"), st.lists(pin_cell, max_size=8)),      # the far reader pins
    st.tuples(st.just("unpin"), st.lists(pin_cell, max_size=8)),
    st.tuples(st.just("release_saves"), st.lists(pin_cell, max_size=8)),
), min_size=1, max_size=25)


def apply_pin(store: VllmKVStore, op: tuple, new: bool):
    kind, cells = op
    keys = list(dict.fromkeys(store.keys([ALL[b]], layer)[0] for b, layer in cells))
    if kind in ("cpu", "disk"):
        store.chain.put_many(keys, [torch.zeros(LAYOUT.shape) for _ in keys], start=0 if kind == "cpu" else 1)
        store.chain.flush()
        return None
    if kind == "land":
        keys = [k for k in keys if k not in store.saves._pins]
        slots = store.cpu.acquire(keys)
        store.saves._pins.update((k, s) for k, s in zip(keys, slots) if s is not None)
        return slots
    if kind == "read":
        return store.saves.pin_for_reader(keys) if new else old_pin_for_reader(store.saves, keys)
    if kind == "unpin":
        return store.saves.unpin(keys)
    return store.saves.release_pins(keys)


@settings(max_examples=200, deadline=None)
@given(ops=pin_ops, cpu_blocks=st.integers(2, 16))
def test_far_pins_match_the_per_key_logic_and_balance_to_zero(ops, cpu_blocks):
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        stores = [make_store(Path(a), cpu_blocks, 0, 1), make_store(Path(b), cpu_blocks, 0, 1)]
        try:
            for op in ops:
                assert apply_pin(stores[0], op, True) == apply_pin(stores[1], op, False), op
                new, old = (s.cpu for s in stores)
                assert list(new._slot_of.items()) == list(old._slot_of.items()), op
                assert dict(new._pins) == dict(old._pins) and stores[0].saves._pins == stores[1].saves._pins, op
            for store in stores:  # every pin given back: nothing stays pinned
                store.saves.release_pins(list(store.saves._pins))
                for key, count in list(store.cpu._pins.items()):
                    store.cpu.release([key] * count)
                assert not store.cpu._pins and not store.saves._pins
        finally:
            for store in stores:
                store.close()


def _recount(saves) -> dict[str, int]:
    from tierkv.storage.cpu_blocks import block_group

    counts: dict[str, int] = {}
    for key in saves._pins:
        counts[block_group(key)] = counts.get(block_group(key), 0) + 1
    return counts


block_ops = st.lists(st.one_of(
    st.tuples(st.just("cpu"), st.lists(pin_cell, min_size=1, max_size=8)),
    st.tuples(st.just("cpu_blocks"), st.lists(st.integers(0, len(HASHES) - 1), min_size=1, max_size=3)),
    st.tuples(st.just("disk"), st.lists(pin_cell, min_size=1, max_size=8)),
    st.tuples(st.just("land"), st.lists(pin_cell, max_size=8)),
    st.tuples(st.just("read"), st.lists(pin_cell, max_size=8)),
    st.tuples(st.just("cpu_blocks"), st.lists(st.integers(0, 2), min_size=1, max_size=2)),
    st.tuples(st.just("read_blocks"), st.lists(st.integers(0, 2), min_size=1, max_size=2)),
    st.tuples(st.just("read_blocks"), st.lists(st.integers(0, 2), min_size=1, max_size=2)),
    st.tuples(st.just("read_blocks"), st.lists(st.integers(0, len(ALL) - 1), min_size=1, max_size=3)),
    st.tuples(st.just("release_saves"), st.lists(pin_cell, max_size=8)),
), min_size=1, max_size=25)


@settings(max_examples=500, deadline=None)
@given(ops=block_ops, cpu_blocks=st.integers(4, 24), tp=st.sampled_from([(0, 1), (1, 2)]))
def test_whole_block_reads_take_over_landed_saves_and_balance_to_zero(ops, cpu_blocks, tp):
    """Far blocks pinned whole (`pin_blocks_for_reader`) beside landed saves' pins and per-key reads: a block
    in the CPU tier in every layer is pinned whole, and its landed saves' per-key pins are given back then
    (none of its keys is left in the saves' pins, or it would stay pinned after the request: release_pins
    covers the blocks that never became far); a block not in every layer is refused, a hash with "/" is
    never named as a whole block; the slots given are the keys' own; the per-block count of landed pins
    stays exact; and once every reader and save gives its pins back nothing stays pinned."""
    with tempfile.TemporaryDirectory() as root:
        store = make_store(Path(root), cpu_blocks, *tp)
        readers: list[list[str]] = []  # per-key reads to give back
        whole: list[str] = []          # blocks pinned whole to give back
        try:
            for kind, arg in ops:
                if kind == "cpu_blocks":  # every layer of a few blocks, as a save of a whole block would
                    keys = [store.keys([HASHES[b]], layer)[0] for b in arg for layer in range(LAYERS)]
                    store.chain.put_many(keys, [torch.zeros(LAYOUT.shape)] * len(keys))
                    store.chain.flush()
                elif kind == "land":
                    keys = list(dict.fromkeys(store.keys([ALL[b]], layer)[0] for b, layer in arg))
                    keys = [k for k in keys if k not in store.saves._pins]
                    slots = store.cpu.acquire(keys)
                    landed = [(k, s) for k, s in zip(keys, slots) if s is not None]
                    store.saves._pins.update(landed)
                    store.saves._count_blocks([k for k, _ in landed], 1)
                elif kind == "read":
                    keys = list(dict.fromkeys(store.keys([ALL[b]], layer)[0] for b, layer in arg))
                    if store.saves.pin_for_reader(keys) is not None:
                        readers.append(keys)
                elif kind == "read_blocks":
                    hashes = [ALL[b] for b in arg]
                    groups = store.block_groups(hashes)
                    if any("/" in h for h in hashes):
                        assert groups is None
                        continue
                    keys = [[store.keys([h], layer)[0] for layer in range(LAYERS)] for h in hashes]
                    saved = any(k in store.saves._pins for row in keys for k in row)
                    in_cpu = all(store.cpu.contains(k) for row in keys for k in row)
                    rows = store.saves.pin_blocks_for_reader(groups, hashes)
                    event("pinned whole, landed saves taken over" if rows is not None and saved
                          else "pinned whole" if rows is not None else "refused")
                    assert (rows is not None) == in_cpu
                    if rows is not None:
                        assert not any(k in store.saves._pins for row in keys for k in row)
                        whole.extend(groups)
                        for row, row_keys in zip(rows.tolist(), keys):
                            slots = store.cpu.acquire(row_keys)
                            store.cpu.release(row_keys)
                            assert row == slots
                elif kind == "release_saves":
                    keys = list(dict.fromkeys(store.keys([ALL[b]], layer)[0] for b, layer in arg))
                    store.saves.release_pins(keys)
                else:
                    apply_pin(store, (kind, arg), True)
                assert store.saves._pin_blocks == _recount(store.saves)
            store.saves.release_pins(list(store.saves._pins))
            for keys in readers:
                store.saves.unpin(keys)
            store.saves.unpin_blocks(whole)
            assert not store.cpu._pins and not store.cpu._pin_state.blocks.pins and not store.saves._pin_blocks
        finally:
            store.close()
