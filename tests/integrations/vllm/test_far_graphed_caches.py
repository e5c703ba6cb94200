"""The graphed sparse rows' far-block caches and the full decode graph's body, on CPU with the graphs'
recording replaced (`tests.integrations.vllm.test_hot_window.fake_graphs`; real captures:
tests/gpu/test_far_graphs_gpu.py): outputs equal the eager path's, the staging bounds the caches,
two kept selections serve alternating queries, and the body vLLM would capture equals the eager step."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from tests.integrations.vllm.test_connector import BS, LAYERS, NAMES  # noqa: E402
from tests.integrations.vllm.test_hot_window import D, HQ, _Window, computed_far, fake_graphs  # noqa: E402


def decode_step_equals_eager(far, store, rows, q) -> None:
    """One decode step of `rows` (req_id, tokens before, 1) with queries q [n, HQ, D]: each layer's
    output through `attend_into` (the graphs, where they serve) equals the eager path's, merged with
    random near parts."""
    from tierkv.attention import merge_partials

    far.begin_step(rows)
    near = (torch.randn(len(rows), HQ, D), torch.randn(len(rows), HQ))
    for name in NAMES:
        layer = store.layer_index[name]
        saved, far.graphs = far.graphs, None  # the eager path
        want = merge_partials([near, far.attend(layer, q, 0.3)])[0]
        far.graphs = saved
        got = torch.full_like(want, float("nan"))
        far.attend_into(got, layer, q, *near, 0.3)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    far.end_step()


def test_the_staging_bounds_the_graphed_rows_by_their_far_block_caches(tmp_path, monkeypatch, caplog):
    """Each graphed row's request holds a far-block cache set out of scheduler.staging_bytes, within
    three quarters of it beside the eager regions: a selection per layer for every row when they all
    fit; else sets that keep nothing (one selection each, every block copied each step) for as many
    rows as fit, the rest eager, with a warning naming the staging that would keep selections; sets
    that keep nothing when sparse_cache_selections is 0, without a warning. Outputs equal the eager
    path's either way, and the engine's staging stays within the config's."""
    fake_graphs(monkeypatch)
    k = 4  # computed_far's budget: 4 blocks
    # (staging blocks, selections asked to keep, rows the graphs serve, kept per layer): room = 3/4 x staging
    # - 2k - 1 blocks; 0 selections: keep nothing, no warning when every row fits
    for staging_blocks, selections, want_rows, per_layer in ((128, 1, 5, True), (64, 1, 5, False), (24, 1, 2, False),
                                                             (128, 0, 5, False)):
        (tmp_path / f"{staging_blocks}-{selections}").mkdir()
        caplog.clear()
        with caplog.at_level("WARNING", logger="tierkv.integrations.vllm.far_rows"):
            store, _, far = computed_far(tmp_path / f"{staging_blocks}-{selections}", ("a", "b"), max_rows=5,
                                         staging_blocks=staging_blocks, cache_selections=selections)
        try:
            caches = far.row_caches
            assert far.graphs.max_rows == want_rows and caches.num_sets == want_rows and caches.per_layer == per_layer
            assert caches.blocks.shape[0] == want_rows * (LAYERS if per_layer else 1) * k
            warned = [r.getMessage() for r in caplog.records if "far-block caches" in r.getMessage()]
            if per_layer or selections == 0:
                assert not warned and not caplog.records
            else:
                assert len(warned) == 1 and f"{want_rows} rows copy every selected block" in warned[0]
                assert (f"{5 - want_rows} run eagerly" in warned[0]) == (want_rows < 5)
            assert far.stats()["staging_bytes"] <= store.config.scheduler.staging_bytes
            for step in range(3):  # the same queries every step: kept selections are read in place
                decode_step_equals_eager(far, store, [("a", 27 * BS + step, 1), ("b", 26 * BS + step, 1)],
                                         torch.randn(2, HQ, D, generator=torch.Generator().manual_seed(1)))
            stats = far.stats()
            graphed_reads = 3 * LAYERS * k * min(2, want_rows)
            assert stats["cache_hits"] + stats["cache_misses"] == graphed_reads
            # kept: the first step copies, the next two find the same selections (no far block added on the way)
            assert stats["cache_hits"] == (2 * graphed_reads // 3 if per_layer else 0)
        finally:
            far.close()
            store.close()


def test_caches_of_two_selections_keep_what_alternating_queries_select(tmp_path, monkeypatch):
    """scheduler.sparse_cache_selections: 2 keeps two selections per layer (least recently used
    replaced): queries that alternate between two directions find both selections on the GPU after
    two steps, where one kept selection copies every step; outputs equal the eager path's."""
    fake_graphs(monkeypatch)
    k, steps = 4, 8
    queries = [torch.randn(1, HQ, D, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    hits = {}
    for selections in (1, 2):
        (tmp_path / str(selections)).mkdir()
        store, _, far = computed_far(tmp_path / str(selections), ("a",), max_rows=1, staging_blocks=64,
                                     cache_selections=selections)
        try:
            assert far.row_caches.width == selections * k and far.row_caches.per_layer
            for step in range(steps):  # no far block added on the way
                decode_step_equals_eager(far, store, [("a", 27 * BS + step, 1)], queries[step % 2])
            stats = far.stats()
            assert stats["cache_hits"] + stats["cache_misses"] == steps * LAYERS * k
            hits[selections] = stats["cache_hits"]
        finally:
            far.close()
            store.close()
    # two kept selections: every block from the third step on; one: only what the two selections share
    assert hits[2] >= (steps - 2) * LAYERS * k and hits[1] < hits[2]


def test_a_staging_resize_remakes_the_far_block_caches_and_the_outputs_stay(tmp_path, monkeypatch):
    """A run-time staging resize between decode steps (`FarKV.make_staging` / `use_staging`): from 128
    blocks (a selection per layer kept for 5 rows) to the least it can be re-made from (the 5 graphed rows'
    sets keep nothing, beside one region of the start-up ring and the eager regions) and back. The requests'
    cache sets are emptied, the graphs captured again over the new caches, every step's output equals
    the eager path's and is bit for bit the one before the resize for the same queries, and the counters carry on."""
    fake_graphs(monkeypatch)
    k = 4
    block_bytes = None
    store, _, far = computed_far(tmp_path, ("a", "b"), max_rows=5, staging_blocks=128)
    try:
        block_bytes = store.layout.num_bytes
        rows = [("a", 27 * BS, 1), ("b", 26 * BS, 1)]
        q = torch.randn(2, HQ, D, generator=torch.Generator().manual_seed(3))

        def step() -> list[torch.Tensor]:
            far.begin_step(rows)
            near = (torch.ones(2, HQ, D), torch.zeros(2, HQ))
            outs = []
            for name in NAMES:
                got = torch.full((2, HQ, D), float("nan"))
                far.attend_into(got, store.layer_index[name], q, *near, 0.3)
                outs.append(got)
            far.end_step()
            return outs

        first = step()
        decode_step_equals_eager(far, store, rows, q)
        reads = 2 * LAYERS * k
        least = far.grid.least_staging_bytes(block_bytes) // block_bytes  # ring region, eager regions, 5 least sets
        assert far.grid.graph_rows == 5 and least < 128
        for staging_blocks, sets, per_layer in ((least, 5, False), (128, 5, True)):
            captured = far.stats()["cuda_graphs"]["graph_captures"]
            done = far.stats()["cache_hits"] + far.stats()["cache_misses"]
            new = far.make_staging(staging_blocks * block_bytes)
            assert far.row_caches is not new.row_caches and far.row_caches.per_layer != per_layer  # not yet used
            far.use_staging(new, staging_blocks * block_bytes)
            assert far.row_caches.num_sets == sets and far.row_caches.per_layer == per_layer
            assert all(req.cache is None for req in far.requests.values())
            assert far.stats()["staging_bytes"] <= staging_blocks * block_bytes
            for got, want in zip(step(), first):  # bit for bit: the same blocks in the same pieces
                assert torch.equal(got, want)
            decode_step_equals_eager(far, store, rows, q)
            stats = far.stats()
            assert stats["cache_hits"] + stats["cache_misses"] == done + 2 * reads  # counted on, not reset
            assert stats["cuda_graphs"]["graph_captures"] == captured + LAYERS  # captured again, once per layer
            assert stats["cuda_graphs"]["graph_replays"] >= 4 * LAYERS
        assert far.make_staging(128 * block_bytes) is None  # already that size
    finally:
        far.close()
        store.close()


def full_body_equals_eager(far, full, windows: dict, rows, q: torch.Tensor, shifted: torch.Tensor,
                           seqused: torch.Tensor, meta, window: int, msg: str) -> None:
    """Each layer's output of `FullDecodeRows.attend` for the m = len(rows) real rows (q [n, HQ, D], n
    padded) equals the eager step's: the window's near part over the block table `shifted` [m, width]
    merged with FarKV's eager far part."""
    from tierkv.attention import merge_partials

    m = len(rows)
    n = q.shape[0]
    for layer, win in windows.items():
        near = win(q[:m], shifted.to(torch.int32), seqused, meta.query_start_loc[: m + 1], window + BS)
        saved, far.graphs = far.graphs, None  # the eager path, same FarKV
        far_parts = far.attend(layer, q[:m], 0.3)
        far.graphs = saved
        want = merge_partials([near, far_parts])[0]
        got = torch.full((n, HQ, D), float("nan"))
        full.attend(got, layer, q, 0.3, win, meta)
        torch.testing.assert_close(got[:m], want, rtol=1e-5, atol=1e-6, msg=f"{msg} layer {layer}")


def test_the_full_decode_graph_body_equals_the_eager_step(tmp_path, monkeypatch):
    """What vLLM would capture for its full decode graph (`far_full.FullDecodeRows.attend`): per-row
    inputs written before the step (far counts, cache sets, the tables' and slot lists' addresses),
    the window's block table shifted on the device by the far counts, the rows' far parts and the
    merge. For a row with more far blocks than a selection, one with fewer, one with none and a padded
    row, it gives the eager step's output, step after step as positions grow; `write` refuses a step
    it cannot serve, and counts the read blocks of the steps it does."""
    from types import SimpleNamespace

    from tierkv.integrations.vllm.full_graph_rows import FullDecodeRows

    fake_graphs(monkeypatch)
    window, blocks = 2 * BS, 30
    store, caches, far = computed_far(tmp_path, ("a", "b", "c"), max_rows=4, window=window, blocks=blocks,
                                      max_model_len=blocks * BS)
    windows = {store.layer_index[n]: _Window(caches[n]) for n in NAMES}
    try:
        full = FullDecodeRows(far, 4, store.layer_index)
        k = far.sparse_blocks
        position = {"a": (blocks - 3) * BS - 4, "b": window + 2 * BS, "c": window - 5}  # far blocks: many, 3 < k, 0
        for step in range(BS + 2):
            rows = far.begin_step([(req, position[req], 1) for req in ("a", "b", "c")])
            assert [r.num_far_blocks > k for r in rows][0] and 0 < rows[1].num_far_blocks < k
            assert rows[2].num_far_blocks == 0
            before = far.counts["sparse_selected_reads"]
            assert full.write(rows)
            full.counted_step(rows)
            assert far.counts["sparse_selected_reads"] - before == LAYERS * (k + rows[1].num_far_blocks)
            n = 4  # vLLM pads the batch to a captured size: a fourth row with no keys, no far blocks
            seq_lens = torch.tensor([r.num_computed + 1 for r in rows] + [0], dtype=torch.int32)
            meta = SimpleNamespace(block_table=torch.arange(blocks, dtype=torch.int32).repeat(n, 1),
                                   seq_lens=seq_lens, query_start_loc=torch.arange(n + 1, dtype=torch.int32))
            q = torch.randn(n, HQ, D)
            shifted = torch.stack([torch.arange(r.num_far_blocks, r.num_far_blocks + 8) for r in rows])
            seqused = torch.tensor([r.num_computed + 1 - r.num_far_blocks * BS for r in rows], dtype=torch.int32)
            full_body_equals_eager(far, full, windows, rows, q, shifted, seqused, meta, window, f"step {step}")
            far.end_step()
            for req in position:
                position[req] += 1
        # steps it cannot serve: a prefill row, more rows than buffers
        rows = far.begin_step([("a", position["a"], 2)])
        assert not full.write(rows)
        far.end_step()
        rows = far.begin_step([(req, position["a"], 1) for req in ("a", "b", "c")] + [("a2", 5, 1), ("a3", 5, 1)])
        assert not full.write(rows)
        far.end_step()
        assert full.stats() == {"full_steps": BS + 2, "full_steps_refused": 2}
    finally:
        far.close()
        store.close()
