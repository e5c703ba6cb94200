"""The step that completes blocks saves and summarizes every layer at once: a full decode graph's
replay runs no per-layer hook, so wait_for_save saves the step's blocks of all layers from vLLM's
pool. One read per layer, then one quantization, one D2H and one summary copy per request run for
all layers (per request and layer, 10 requests of 32 layers took 60-100 ms of host time on the
GPU machine). What lands in the tiers and in the summaries equals the per-layer saves."""
from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("vllm")

from tierkv.blocks import BlockLayout  # noqa: E402
from tierkv.config import load_config  # noqa: E402
from tierkv.integrations.vllm.far_rows import FarKV  # noqa: E402
from tierkv.integrations.vllm.store import BlockSpan, VllmKVStore  # noqa: E402
from tests.integrations.vllm.test_connector import BS, D, H, LAYERS, NAMES, NUM_BLOCKS  # noqa: E402
from tests.integrations.vllm.test_hot_window import assert_six_blocks_summarized, sparse_connectors, step_one_request  # noqa: E402
from tests.integrations.vllm.test_hot_window import write_config  # noqa: E402


def _store_and_far(path, storage_dtype: str, caches):
    path.mkdir()
    config = load_config(write_config(path, window=2 * BS, staging_blocks=6, sparse_tokens=4 * BS,
                                      storage_dtype=storage_dtype), env={})
    store = VllmKVStore(config, BlockLayout(H, BS, D, torch.float32), NAMES, "hot-model", "cpu")
    store.register(caches)
    return store, FarKV(store, 2 * BS)


def _spans(store, far):
    """Three requests' blocks of one save: runs of consecutive block indices, a gap, and a block whose
    hash the far side does not know (saved, never summarized)."""
    spans = []
    for req, count, block_ids in (("a", 5, [3, 4, 5, 6, 7]), ("b", 4, [20, 22, 21, 30]), ("c", 2, [40, 41])):
        hashes = store.extend_hashes([], [random.randrange(1000) for _ in range(count * BS)], count)
        known = hashes if req != "c" else hashes[:1]
        far.add_hashes(req, 0, known)
        if req == "b":  # blocks 0, 1, 3 of b in this save (a gap), block 2 in no save
            spans.append(BlockSpan(req, [block_ids[0], block_ids[1], block_ids[3]], [hashes[0], hashes[1], hashes[3]]))
        else:
            spans.append(BlockSpan(req, block_ids, hashes))
    return spans


@pytest.mark.parametrize("storage_dtype", ["auto", "float8_e4m3fn", "int8"])
def test_every_layer_saved_at_once_equals_the_saves_layer_by_layer(tmp_path, storage_dtype):
    """store.save_layers over every layer, then far.summarize(range(layers), ...) over its [layers, n, ...]
    copy, leaves the same blocks in the CPU tier (quantized per block alike) and the same key
    summaries, flags and summarized prefixes as save_layer and summarize one layer at a time."""
    caches = {n: torch.randn(NUM_BLOCKS, H, BS, 2 * D) for n in NAMES}
    random.seed(7)
    store_one, far_one = _store_and_far(tmp_path / "one", storage_dtype, caches)
    random.seed(7)
    store_all, far_all = _store_and_far(tmp_path / "all", storage_dtype, caches)
    try:
        random.seed(8)
        spans = _spans(store_one, far_one)
        random.seed(8)
        assert _spans(store_all, far_all) == spans
        per_layer = []
        for name in NAMES:
            layer = store_one.layer_index[name]
            blocks = store_one.save_layer(layer, caches[name], spans)
            far_one.summarize(layer, spans, blocks)
            per_layer.append(blocks)
        layers = [store_all.layer_index[n] for n in NAMES]
        at_once = store_all.save_layers(layers, [caches[n] for n in NAMES], spans)
        far_all.summarize(range(LAYERS), spans, at_once)
        assert at_once.shape == (LAYERS, 10, 2, H, BS, D)
        with pytest.raises(ValueError, match="3 layers but 2 KV caches"):
            store_all.save_layers(layers, [caches[n] for n in NAMES[:2]], spans)
        torch.testing.assert_close(at_once, torch.stack(per_layer), rtol=0, atol=0)
        store_one.poll(wait=True)
        store_all.poll(wait=True)
        assert store_all.counts["blocks_saved"] == store_one.counts["blocks_saved"] == LAYERS * 10
        hashes = [h for s in spans for h in s.hashes]
        for layer in range(LAYERS):
            keys = store_one.keys(hashes, layer)
            got, want = store_all.chain.get_many(keys, promote=False), store_one.chain.get_many(keys, promote=False)
            assert all(g is not None for g in got)
            torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=0, atol=0)
        for req in ("a", "b", "c"):
            one, every = far_one.requests[req].summaries, far_all.requests[req].summaries
            assert one.prefix == every.prefix
            for layer in range(LAYERS):
                torch.testing.assert_close(every.summaries.tables[layer], one.summaries.tables[layer], rtol=0, atol=0)
                assert (every.is_summarized[layer] == one.is_summarized[layer]).all()
                assert torch.equal(every.is_summarized_dev[layer], one.is_summarized_dev[layer])
        b = far_all.requests["b"].summaries
        assert b.prefix == [2] * LAYERS and b.unsummarized(0, 4).tolist() == [2]  # the gap stays unsummarized
        assert far_all.requests["c"].summaries.prefix == [1] * LAYERS  # its unknown block: saved, not summarized
    finally:
        for far, store in ((far_one, store_one), (far_all, store_all)):
            far.close()
            store.close()


@pytest.mark.parametrize("run_layers", [None, 2])
def test_a_full_graph_step_saves_and_summarizes_every_layer_in_one_pass(tmp_path, monkeypatch, run_layers):
    """No per-layer hook ran (a full decode graph's replay): wait_for_save saves the step's blocks of
    every layer in one D2H and summarizes them with one bound computation for all layers and
    requests, and the summaries equal the blocks' key min/max. With SAVE_RUN_BYTES holding two
    layers' blocks, in runs of two layers and one."""
    import tierkv.integrations.vllm.connector as connector

    if run_layers is not None:
        monkeypatch.setattr(connector, "SAVE_RUN_BYTES", run_layers * 6 * 2 * H * BS * D * 4)
    worker, scheduler, caches = sparse_connectors(tmp_path)
    scatters, bounds = [], []
    scatter = worker.store.io.scatter
    monkeypatch.setattr(worker.store.io, "scatter", lambda blocks, slots: scatters.append(len(slots)) or
                        scatter(blocks, slots))
    import tierkv.sparse.request_summaries as far_summaries

    key_bounds = far_summaries.key_bounds
    monkeypatch.setattr(far_summaries, "key_bounds", lambda blocks: bounds.append(tuple(blocks.shape)) or
                        key_bounds(blocks))
    try:
        step_one_request(worker, scheduler, caches, hooks=False)
        if run_layers is None:
            assert scatters == [LAYERS * 6] and bounds == [(LAYERS, 6, 2, H, BS, D)]
        else:
            assert LAYERS == 3 and scatters == [2 * 6, 6] and bounds == [(2, 6, 2, H, BS, D), (1, 6, 2, H, BS, D)]
        assert worker.store.counts["blocks_saved"] == LAYERS * 6
        assert_six_blocks_summarized(worker, caches)
        # the step's wait_for_save recorded where its host time went: reads, tier, summaries, poll (ms); all
        # within the hook's own time
        (parts,) = worker.store.stats()["save_step_ms"]
        assert len(parts) == 5 and all(p >= 0 for p in parts) and parts[0] > 0 and parts[1] > 0 and parts[2] > 0
        assert sum(parts[:4]) <= parts[4] + 0.01 and parts[4] <= worker.store.step_connector_ms[-1][2] + 0.01
    finally:
        worker.shutdown()
        scheduler.shutdown()


def test_blocks_the_cpu_tier_cannot_take_go_to_the_disk_tier_unchanged(tmp_path):
    """A CPU tier of 4 blocks, 2 of them pinned by a reader: of the 6 blocks a save of 3 layers
    brings, the 2 the tier can take land there and the 4 others on the disk tier, each block under
    its own layer's key and equal to vLLM's copy."""
    config = load_config(write_config(tmp_path, window=2 * BS, staging_blocks=6, cpu_blocks=4), env={})
    store = VllmKVStore(config, BlockLayout(H, BS, D, torch.float32), NAMES, "hot-model", "cpu")
    caches = {n: torch.randn(NUM_BLOCKS, H, BS, 2 * D) for n in NAMES}
    store.register(caches)
    try:
        held = store.extend_hashes([], list(range(2 * BS)), 2)
        store.save_layer(0, caches[NAMES[0]], [BlockSpan("held", [0, 1], held)])
        store.poll(wait=True)
        assert store.saves.pin_for_reader(store.keys(held, 0)) is not None  # a reader holds them
        hashes = store.extend_hashes([], [random.randrange(1000) for _ in range(2 * BS)], 2)
        spans = [BlockSpan("new", [5, 9], hashes)]
        blocks = store.save_layers(list(range(LAYERS)), [caches[n] for n in NAMES], spans)
        store.poll(wait=True)
        assert store.counts["save_fallbacks"] == 2 * LAYERS - 2 and store.counts["blocks_saved"] == 2 + 2
        for layer, name in enumerate(NAMES):
            keys = store.keys(hashes, layer)
            got = store.chain.get_many(keys, promote=False)
            want = store.paged.read(caches[name], torch.tensor([5, 9]))
            torch.testing.assert_close(torch.stack(got), want, rtol=0, atol=0)
            torch.testing.assert_close(blocks[layer], want, rtol=0, atol=0)
        on_disk = [store.chain.locate_many(store.keys(hashes, layer)) for layer in range(LAYERS)]
        assert sum(1 for tiers in on_disk for tier in tiers if tier == 1) == 2 * LAYERS - 2
    finally:
        store.close()


def test_blocks_no_tier_takes_are_counted_dropped(tmp_path, monkeypatch):
    """As above with the disk tier refusing every put (full, or a Redis tier down): the 4 blocks the CPU tier
    could not take are lost, and counted (they read as save fallbacks only: "went lower")."""
    from tierkv.storage.base import PutResult

    config = load_config(write_config(tmp_path, window=2 * BS, staging_blocks=6, cpu_blocks=4), env={})
    store = VllmKVStore(config, BlockLayout(H, BS, D, torch.float32), NAMES, "hot-model", "cpu")
    caches = {n: torch.randn(NUM_BLOCKS, H, BS, 2 * D) for n in NAMES}
    store.register(caches)
    monkeypatch.setattr(store.chain.tiers[1], "put_many", lambda keys, blocks: [PutResult(ok=False, error="full")] * len(keys))
    try:
        held = store.extend_hashes([], list(range(2 * BS)), 2)
        store.save_layer(0, caches[NAMES[0]], [BlockSpan("held", [0, 1], held)])
        store.poll(wait=True)
        assert store.saves.pin_for_reader(store.keys(held, 0)) is not None
        hashes = store.extend_hashes([], [random.randrange(1000) for _ in range(2 * BS)], 2)
        store.save_layers(list(range(LAYERS)), [caches[n] for n in NAMES], [BlockSpan("new", [5, 9], hashes)])
        store.poll(wait=True)
        assert store.counts["save_fallbacks"] == 2 * LAYERS - 2 and store.counts["saves_dropped"] == 2 * LAYERS - 2
        assert store.stats()["counts"]["saves_dropped"] == 2 * LAYERS - 2
    finally:
        store.close()
