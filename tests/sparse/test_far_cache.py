"""The graphed sparse rows' far-block caches (tierkv.vllm_backend.far_cache) on CPU: each selection
finds the blocks its set holds where they are and gives the others the slots whose blocks were not
selected again; counters and emptying a set for the next request. The same code runs inside the
CUDA graphs (tests/gpu/test_far_graphs_gpu.py)."""
from __future__ import annotations

import random

import torch

from tierkv.vllm_backend.far_cache import RowCaches

LAYERS, K = 3, 8


def caches(sets: int = 2) -> RowCaches:
    return RowCaches(sets, LAYERS, K, (2, 1, 4, 2), torch.float32, torch.device("cpu"))


def test_a_selection_keeps_held_blocks_in_place_and_fills_the_slots_of_the_rest():
    rc = caches()
    first, second = rc.take(), rc.take()
    assert rc.take() is None  # two sets, both taken
    rng = random.Random(7)
    held = {(s.index, layer): {} for s in (first, second) for layer in range(LAYERS)}  # slot -> block, as modelled
    want = [0, 0, 0]
    for step in range(40):
        for s in (first, second):
            for layer in range(LAYERS):
                # consecutive selections overlap by a random amount, ids in a random order
                before = list(held[s.index, layer].values())
                kept = rng.sample(before, rng.randrange(len(before) + 1)) if before else []
                ids = kept + rng.sample([b for b in range(60) if b not in kept], K - len(kept))
                rng.shuffle(ids)
                slots, miss = rc.place(s, layer, torch.tensor(ids))
                model = held[s.index, layer]
                base = s.base(layer)
                assert sorted(slots.tolist()) == list(range(base, base + K))  # the set's own slots, each once
                for block, slot, missed in zip(ids, slots.tolist(), miss.tolist()):
                    if block in model.values():  # held: read where it is, not copied
                        assert not missed and model[slot] == block
                    else:  # copied into a slot whose block was not selected again
                        assert missed and model.get(slot) not in ids
                model.clear()
                model.update(zip(slots.tolist(), ids))
                assert rc.held[s.index, layer][torch.tensor(slots) - base].tolist() == ids
                hits = K - int(miss.sum())
                assert hits == len(set(ids) & set(before)) >= len(kept)
                want = [want[0] + hits, want[1] + K - hits, want[2] + (hits < K)]
    stats = rc.stats()
    assert [stats["cache_hits"], stats["cache_misses"], stats["cache_stalled_rows"]] == want
    assert 0 < want[0] and 0 < want[1]


def test_a_set_given_back_is_empty_for_the_next_request():
    rc = caches(sets=1)
    s = rc.take()
    ids = torch.arange(K)
    rc.place(s, 1, ids)
    assert not rc.place(s, 1, ids)[1].any()  # held: nothing to copy
    rc.give_back(s)
    again = rc.take()
    assert again == s  # the same slots (a graph baked them) ...
    assert rc.place(again, 1, ids)[1].all()  # ... holding nothing of the finished request's


def test_snapshot_and_restore_undo_a_run():
    rc = caches(sets=1)
    s = rc.take()
    rc.place(s, 0, torch.arange(K))
    saved = rc.snapshot()
    rc.place(s, 0, torch.arange(K, 2 * K))
    rc.restore(saved)
    slots, miss = rc.place(s, 0, torch.arange(K))
    assert not miss.any() and rc.stats()["cache_hits"] == K
