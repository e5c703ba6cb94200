"""The graphed sparse rows' far-block caches (tierkv.sparse.row_caches) on CPU: each selection
finds the blocks its set holds where they are and gives the others the slots whose blocks were not
selected again; counters and emptying a set for the next request; the Triton placement kernel
equals the PyTorch ops (interpreter on CPU, compiled on CUDA). The same code runs inside the CUDA
graphs (tests/gpu/test_far_graphs_gpu.py)."""
from __future__ import annotations

import os
import random

import pytest
import torch

from tests.interpreter import run_interpreter_tests
from tierkv.sparse.row_caches import RowCaches

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


@pytest.mark.parametrize("per_layer", [True, False])
def test_rows_placed_at_once_equal_rows_placed_one_by_one(per_layer):
    """RowCaches.place_rows (the graphed rows' form) gives what `place` gives row by row, in the same
    sets and counters; with sets that keep nothing, each row's own k slots, every id a miss."""
    rng = random.Random(random.SystemRandom().randrange(2**63))
    one, many = (RowCaches(3, LAYERS, K, (1,), torch.float32, torch.device("cpu"), per_layer=per_layer)
                 for _ in range(2))
    sets = [(one.take(), many.take()) for _ in range(3)]
    for step in range(5):
        rows, layer = rng.sample(sets, 2), rng.randrange(LAYERS)
        ids = torch.tensor([rng.sample(range(3 * K), K) for _ in rows])
        want = [one.place(a, layer, ids[r]) for r, (a, _) in enumerate(rows)]
        slots, miss = many.place_rows([b for _, b in rows], torch.tensor([b.index for _, b in rows]), layer, ids)
        assert slots.tolist() == [w[0].tolist() for w in want] and miss.tolist() == [w[1].tolist() for w in want]
        assert torch.equal(one.held, many.held) and torch.equal(one.counters, many.counters), f"step {step}"
    if not per_layer:
        assert miss.all() and slots.tolist() == [list(range(b.base(0), b.base(0) + K)) for _, b in rows]


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


def test_sets_that_keep_nothing_copy_every_block_into_slots_every_layer_shares():
    rc = RowCaches(2, LAYERS, K, (2, 1, 4, 2), torch.float32, torch.device("cpu"), per_layer=False)
    assert rc.blocks.shape[0] == 2 * K  # one selection per set
    first, second = rc.take(), rc.take()
    ids = torch.arange(K)
    for layer in range(LAYERS):
        for s, base in ((first, 0), (second, K)):
            for _ in range(2):  # the same selection again: still copied (the slots were overwritten)
                slots, miss = rc.place(s, layer, ids)
                assert slots.tolist() == list(range(base, base + K)) and miss.all()
    stats = rc.stats()
    assert (stats["cache_hits"], stats["cache_misses"], stats["cache_stalled_rows"]) == (0, 4 * LAYERS * K, 4 * LAYERS)
    assert not stats["cache_per_layer"]


def test_a_cache_of_several_selections_replaces_the_least_recently_used_block():
    """Past one selection per layer (C = 2k slots): a held id is read in place, the r-th missing id
    takes the r-th least recently used slot the selection does not read, as an LRU model says; a
    block selected two steps ago is still a hit."""
    rc = RowCaches(1, LAYERS, K, (1,), torch.float32, torch.device("cpu"), selections=2)
    assert rc.width == 2 * K and rc.blocks.shape[0] == LAYERS * 2 * K
    s = rc.take()
    rng = random.Random(11)
    model = {layer: {} for layer in range(LAYERS)}  # slot -> (block, last tick), per layer
    tick = 0
    selections = [rng.sample(range(60), K) for _ in range(2)]
    for step in range(30):
        ids = selections[step % 2] if step < 12 else rng.sample(range(60), K)  # alternating, then random
        for layer in range(LAYERS):
            slots, miss = rc.place(s, layer, torch.tensor(ids))
            held = model[layer]
            where = {block: slot for slot, (block, _) in held.items()}
            read = {where[b] for b in ids if b in where}
            unread = sorted((held.get(j, (None, -1))[1], j) for j in range(2 * K) if j not in read)
            victims = iter(j for _, j in unread)
            base = s.base(layer)
            for block, slot, missed in zip(ids, slots.tolist(), miss.tolist()):
                want = where[block] if block in where else next(victims)
                assert (slot - base, missed) == (want, block not in where), (step, layer)
                held[slot - base] = (block, tick)
            tick += 1
        if 2 <= step < 12:  # both alternating selections fit the 2k slots: nothing to copy
            assert not miss.any()
    rc.give_back(s)
    again = rc.take()
    assert rc.place(again, 0, torch.tensor(selections[0]))[1].all()  # emptied, clocks too


def test_a_prefetched_block_counts_as_used_once_a_selection_reads_it_before_it_is_replaced():
    """A placement marked as a prefetch fills slots as a selection does but counts nothing used; a
    later selection that reads a block the prefetch copied in counts it once (`prefetch_used`), a
    block the prefetch found already held counts nothing, and a prefetched block replaced before
    any selection read it never counts. Checked against a model of the slots, per step."""
    rc = RowCaches(1, 1, K, (1,), torch.float32, torch.device("cpu"), selections=3)
    s = rc.take()
    rng = random.Random(5)
    fresh_blocks: set[int] = set()   # the model: blocks the prefetch copied in that no selection read yet
    held_blocks: set[int] = set()
    used = 0
    for step in range(40):
        prefetch = step % 2 == 1
        ids = rng.sample(range(3 * K), K)
        slots, miss = rc.place(s, 0, torch.tensor(ids), prefetch=prefetch)
        held_now = set(rc.held[0, 0].tolist())
        if prefetch:
            fresh_blocks |= {b for b, m in zip(ids, miss.tolist()) if m}
        else:
            used += len(fresh_blocks & set(ids) & held_blocks)
            fresh_blocks -= set(ids)
        fresh_blocks &= held_now  # replaced: gone, never read
        held_blocks = held_now
        assert int(rc.prefetch_used) == used, step
        assert {b for b, f in zip(rc.held[0, 0].tolist(), rc.fresh[0, 0].tolist()) if f} == fresh_blocks, step
    assert used > 0
    rc.give_back(s)
    assert not rc.fresh.any()


def test_snapshot_and_restore_undo_a_run():
    rc = caches(sets=1)
    s = rc.take()
    rc.place(s, 0, torch.arange(K))
    saved = rc.snapshot()
    rc.place(s, 0, torch.arange(K, 2 * K))
    rc.restore(saved)
    slots, miss = rc.place(s, 0, torch.arange(K))
    assert not miss.any() and rc.stats()["cache_hits"] == K


CHILD = os.environ.get("TIERKV_PLACE_CHILD") == "1"


def _blank_some(rng: random.Random, ids: list[int]) -> list[int]:
    """ids with, one time in three, some of them replaced by -1 (no block: a row with fewer far blocks
    than k), at random places."""
    if rng.randrange(3):
        return ids
    blank = set(rng.sample(range(len(ids)), rng.randrange(1, len(ids) + 1)))
    return [-1 if i in blank else b for i, b in enumerate(ids)]


def _kernel_cases(device: str) -> None:
    """The Triton placement (tierkv.cache_kernels.place_rows, one row) against RowCaches' PyTorch ops,
    step after step with overlapping random selections (k a power of two and not): the same slots,
    misses, held ids and counters. Fresh random draws each run."""
    from tierkv.cache_kernels import place_rows

    seed = random.SystemRandom().randrange(2**63)
    rng = random.Random(seed)
    for k in (32, 7, 1):
        torch_path = RowCaches(1, 1, k, (1,), torch.float32, torch.device("cpu"))
        s = torch_path.take()
        held = torch.full((1, 1, k), -1, dtype=torch.int64, device=device)
        one_set = torch.zeros(1, dtype=torch.int64, device=device)
        counters = torch.zeros(3, dtype=torch.int64, device=device)
        previous: list[int] = []
        for step in range(12):
            previous = [b for b in previous if b >= 0]
            kept = rng.sample(previous, rng.randrange(len(previous) + 1)) if previous else []
            ids = kept + rng.sample([b for b in range(4 * k + 8) if b not in kept], k - len(kept))
            rng.shuffle(ids)
            ids = previous = _blank_some(rng, ids)
            want_slots, want_miss = torch_path.place(s, 0, torch.tensor(ids))
            slots, miss = place_rows(held, one_set, 0, torch.tensor([ids], device=device), counters)
            msg = f"seed={seed} k={k} step={step}"
            assert slots[0].cpu().tolist() == want_slots.tolist(), msg
            assert miss[0].cpu().tolist() == want_miss.tolist(), msg
            assert held[0, 0].cpu().tolist() == torch_path.held[0, 0].tolist(), msg
            assert counters.cpu().tolist() == torch_path.counters.tolist(), msg


def _lru_kernel_cases(device: str) -> None:
    """The Triton placement over several selections (place_rows_lru, one row) against RowCaches'
    PyTorch LRU ops, step after step with selections drawn from a few recent ones and fresh blocks:
    the same slots, misses, held ids, last uses, clock and counters. Fresh random draws each run."""
    from tierkv.cache_kernels import place_rows_lru

    seed = random.SystemRandom().randrange(2**63)
    rng = random.Random(seed)
    for k, selections in ((32, 2), (7, 3), (1, 2)):
        torch_path = RowCaches(1, 1, k, (1,), torch.float32, torch.device("cpu"), selections=selections)
        s = torch_path.take()
        c = k * selections
        held = torch.full((1, 1, c), -1, dtype=torch.int64, device=device)
        last_use = torch.full((1, 1, c), -1, dtype=torch.int64, device=device)
        clock = torch.zeros(1, dtype=torch.int64, device=device)
        one_set = torch.zeros(1, dtype=torch.int64, device=device)
        counters = torch.zeros(3, dtype=torch.int64, device=device)
        fresh = torch.zeros((1, 1, c), dtype=torch.int8, device=device)
        used = torch.zeros(1, dtype=torch.int64, device=device)
        recent: list[list[int]] = []
        for step in range(16):
            pool = sorted({b for sel in recent[-3:] for b in sel if b >= 0})
            kept = rng.sample(pool, rng.randrange(min(len(pool), k) + 1)) if pool else []
            ids = kept + rng.sample([b for b in range(6 * k + 8) if b not in kept], k - len(kept))
            rng.shuffle(ids)
            ids = _blank_some(rng, ids)
            recent.append(ids)
            prefetch = rng.random() < 0.4  # a next-step prefetch's placement, else a selection's
            want_slots, want_miss = torch_path.place(s, 0, torch.tensor(ids), prefetch=prefetch)
            slots, miss = place_rows_lru(held, last_use, clock, one_set, 0, torch.tensor([ids], device=device),
                                         counters, fresh=fresh, used=used, prefetch=prefetch)
            msg = f"seed={seed} k={k} selections={selections} step={step}"
            assert slots[0].cpu().tolist() == want_slots.tolist(), msg
            assert miss[0].cpu().tolist() == want_miss.tolist(), msg
            assert held[0, 0].cpu().tolist() == torch_path.held[0, 0].tolist(), msg
            assert last_use[0, 0].cpu().tolist() == torch_path.last_use[0, 0].tolist(), msg
            assert clock.cpu().tolist() == torch_path.clock.tolist(), msg
            assert counters.cpu().tolist() == torch_path.counters.tolist(), msg
            assert torch.equal(fresh.cpu(), torch_path.fresh), msg
            assert used.cpu().tolist() == torch_path.prefetch_used.tolist(), msg


def _rows_kernel_cases(device: str) -> None:
    """The placement of several rows in one launch (place_rows, place_rows_lru: each row in a cache set
    of its own, at one layer of several) against RowCaches' PyTorch ops row by row: the same slots and
    misses, and every set's held ids, last uses, clocks and the counters after each step, so no row
    touches another's set or layer. Fresh random draws each run."""
    from tierkv.cache_kernels import place_rows, place_rows_lru

    seed = random.SystemRandom().randrange(2**63)
    rng = random.Random(seed)
    for k, selections in ((16, 1), (5, 1), (16, 2), (3, 3)):
        torch_path = RowCaches(4, 3, k, (1,), torch.float32, torch.device("cpu"), selections=selections)
        sets = [torch_path.take() for _ in range(4)]
        held = torch_path.held.clone().to(device)
        last_use = torch_path.last_use.clone().to(device) if selections > 1 else None
        clock = torch_path.clock.clone().to(device)
        counters = torch.zeros(3, dtype=torch.int64, device=device)
        fresh = torch_path.fresh.clone().to(device) if selections > 1 else None
        used = torch.zeros(1, dtype=torch.int64, device=device)
        previous: dict[tuple[int, int], list[int]] = {}
        for step in range(12):
            rows, layer = rng.sample(sets, rng.randrange(1, 4)), rng.randrange(3)
            selections_now = []
            for s in rows:
                before = [b for b in previous.get((s.index, layer), []) if b >= 0]
                kept = rng.sample(before, rng.randrange(len(before) + 1)) if before else []
                ids = kept + rng.sample([b for b in range(5 * k + 8) if b not in kept], k - len(kept))
                rng.shuffle(ids)
                ids = previous[(s.index, layer)] = _blank_some(rng, ids)
                selections_now.append(ids)
            prefetch = selections > 1 and rng.random() < 0.4  # a next-step prefetch's placement
            want = [torch_path.place(s, layer, torch.tensor(ids), prefetch=prefetch)
                    for s, ids in zip(rows, selections_now)]
            index = torch.tensor([s.index for s in rows], device=device)
            ids = torch.tensor(selections_now, device=device)
            slots, miss = (place_rows_lru(held, last_use, clock, index, layer, ids, counters, fresh=fresh, used=used,
                                          prefetch=prefetch) if selections > 1
                           else place_rows(held, index, layer, ids, counters))
            msg = f"seed={seed} k={k} selections={selections} step={step}"
            assert slots.cpu().tolist() == [w[0].tolist() for w in want], msg
            assert miss.cpu().tolist() == [w[1].tolist() for w in want], msg
            assert torch.equal(held.cpu(), torch_path.held), msg
            if last_use is not None:
                assert torch.equal(last_use.cpu(), torch_path.last_use), msg
                assert torch.equal(clock.cpu(), torch_path.clock), msg
                assert torch.equal(fresh.cpu(), torch_path.fresh), msg
                assert used.cpu().tolist() == torch_path.prefetch_used.tolist(), msg
            assert counters.cpu().tolist() == torch_path.counters.tolist(), msg


def _sources_cases(device: str) -> None:
    """copy_sources: each row's missing blocks' slots from its own slot list (lists of different
    lengths, passed by address), -1 where held, against indexing row by row. Fresh random draws."""
    from tierkv.cache_kernels import copy_sources

    seed = random.SystemRandom().randrange(2**63)
    gen = torch.Generator().manual_seed(seed)
    for m, k in ((1, 8), (3, 5), (4, 16)):
        lists = [torch.randint(0, 1 << 40, (int(torch.randint(k, 4 * k, (1,), generator=gen)),), generator=gen).to(device)
                 for _ in range(m)]
        ids = torch.stack([torch.randperm(t.numel(), generator=gen)[:k] for t in lists])
        ids[0, -1] = -1  # no block (a row with fewer far blocks than k): never a miss
        miss = (torch.rand(m, k, generator=gen) < 0.5) & (ids >= 0)
        ids, miss = ids.to(device), miss.to(device)
        at = torch.tensor([t.data_ptr() for t in lists], dtype=torch.int64, device=device)
        got = copy_sources(at, ids, miss).cpu()
        want = torch.where(miss.cpu(), torch.stack([t.cpu()[i.cpu().clamp(min=0)] for t, i in zip(lists, ids)]), -1)
        assert torch.equal(got, want), f"seed={seed} m={m} k={k}"


@pytest.mark.skipif(not CHILD, reason="runs in the child process of test_placement_kernel_in_the_interpreter")
def test_interp_copy_sources_equal_row_by_row_indexing():
    _sources_cases("cpu")


@pytest.mark.skipif(not CHILD, reason="runs in the child process of test_placement_kernel_in_the_interpreter")
def test_interp_rows_placement_kernels_equal_the_pytorch_placement():
    _rows_kernel_cases("cpu")


@pytest.mark.skipif(not CHILD, reason="runs in the child process of test_placement_kernel_in_the_interpreter")
def test_interp_placement_kernel_equals_the_pytorch_placement():
    _kernel_cases("cpu")


@pytest.mark.skipif(not CHILD, reason="runs in the child process of test_placement_kernel_in_the_interpreter")
def test_interp_lru_placement_kernel_equals_the_pytorch_lru():
    _lru_kernel_cases("cpu")


def test_placement_kernel_in_the_interpreter():
    pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
    assert "4 passed" in run_interpreter_tests(__file__, "TIERKV_PLACE_CHILD", timeout=600)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_placement_kernel_on_the_gpu_equals_the_pytorch_placement():
    _kernel_cases("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_lru_placement_kernel_on_the_gpu_equals_the_pytorch_lru():
    _lru_kernel_cases("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_rows_placement_kernels_on_the_gpu_equal_the_pytorch_placement():
    _rows_kernel_cases("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_copy_sources_on_the_gpu_equal_row_by_row_indexing():
    _sources_cases("cuda")
