"""The exact hot window's staging ring follows a run-time GPU budget (`scheduler.staging_follows_budget`):
the split gives the staging its start-up share of a smaller budget, the resize re-makes it between steps
(`TierKVConnector.prepare_staging`, allocated before anything is bound), and the far part read through the
new ring equals dense attention over the same blocks. The sparse policy's staging (ring, eager regions,
far-block caches) is re-made too, except under the full decode graph; its outputs across re-made caches:
tests/integrations/vllm/test_far_graphed_caches.py."""
from __future__ import annotations

import dataclasses
import pickle
import random
import weakref

import pytest
import torch
from hypothesis import given, settings, strategies as st

pytest.importorskip("vllm", reason="pip install --no-deps vllm==0.26.0 (see .ci/run) to run the vLLM tests")

from tests.integrations.vllm.test_hot_window import (  # noqa: E402
    BS, HQ, NAMES, _Runner, dense, hot_connectors, hot_kv_cache_config, make_request, schedule, write_config)
from tests.integrations.vllm.test_connector import D  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402

from tierkv.config import ConfigError, load_config  # noqa: E402
from tierkv.integrations.vllm import hot_window  # noqa: E402
from tierkv.integrations.vllm.far_step import far_blocks  # noqa: E402
from tierkv.integrations.vllm.resize_plan import split_budget, staging_for_budget  # noqa: E402
from tierkv.integrations.vllm.store import BlockSpan  # noqa: E402

GIB = 1 << 30


def _config(policy: str = "exact", follows: bool = True, full_graphs: bool = False):
    config = load_config({"cache": {"gpu_budget_bytes": "2GiB"},
                          "scheduler": {"policy": policy, "staging_bytes": "512MiB", "staging_follows_budget": follows,
                                        "sparse_full_graphs": full_graphs}},
                         env={})
    return config


ONE_REGION = -(-(512 << 20) // 3)  # _config's ring: lookahead 2, three regions


@pytest.mark.parametrize("budget,want", [(2 * GIB, 512 << 20), (GIB, 256 << 20), (GIB // 2, ONE_REGION),
                                         (4 * GIB, 512 << 20), (1, ONE_REGION)])
def test_the_ring_keeps_its_start_up_share_of_a_smaller_budget_and_one_region(budget, want):
    assert staging_for_budget(_config(), budget) == want
    assert split_budget(_config(), budget).staging_bytes == want
    assert staging_for_budget(_config("sparse"), budget) == want  # ring, eager regions and caches re-made
    # kept as written: the flag off, or the sparse step inside vLLM's full decode graph (which holds the caches)
    assert staging_for_budget(_config(follows=False), budget) == 512 << 20
    assert staging_for_budget(_config("sparse", full_graphs=True), budget) == 512 << 20


@given(budget=st.integers(1, 4 * GIB), rows_pool=st.integers(0, 3 * GIB), summaries=st.integers(0, GIB // 2))
@settings(max_examples=300, deadline=None)
def test_a_smaller_budget_cuts_the_ring_only_once_the_pool_is_down_to_every_rows_window(budget, rows_pool, summaries):
    config, start_ring = _config(), 512 << 20
    split = split_budget(config, budget, summaries, rows_pool_bytes=rows_pool)
    share = max(ONE_REGION, start_ring * budget // (2 * GIB))  # its share, and one region of the start-up ring
    if budget >= 2 * GIB:
        assert split.staging_bytes == start_ring
        return
    assert share <= split.staging_bytes <= start_ring  # never below its share or one region, never above the start
    if split.staging_bytes < start_ring:  # cut: the pool is no bigger than every row's window (or the share rules)
        assert split.pool_bytes <= rows_pool or split.staging_bytes == share
    if budget - summaries - rows_pool >= start_ring:  # room for every window and the whole ring: the ring stays
        assert split.staging_bytes == start_ring and split.pool_bytes >= rows_pool
    assert split_budget(_config(follows=False), budget, summaries, rows_pool_bytes=rows_pool).staging_bytes == start_ring


def test_the_pool_resizer_hands_the_workers_the_new_ring_and_restores_it_on_failure(tmp_path, monkeypatch):
    """A shrink sends the workers the ring of the new split, a grow back the start-up one; a failure in
    vLLM's block pool after the workers resized sends them the old pool and the old ring again."""
    from tests.integrations.vllm.test_resize_apply import engine_of
    from tierkv.integrations.vllm import resize_control
    from tierkv.budget_change import BudgetRefused

    resizer, core, _, _, staging = engine_of(tmp_path)
    config = load_config(write_config(tmp_path, window=4 * BS, staging_blocks=8))
    start = resizer.budget_bytes
    config = dataclasses.replace(config, cache=dataclasses.replace(config.cache, gpu_budget_bytes=start))
    resizer._split_fn = lambda b, rows_pool_bytes=None, **_: split_budget(config, b)  # the share alone: the ring moves
    sent = []
    rpc = core.collective_rpc
    core.collective_rpc = lambda fn, args=(): (sent.append(args), rpc(fn, args))[1]
    resizer.set_gpu_budget(start // 2).wait(0)
    small_ring = staging * (start // 2) // start
    assert sent[-1] == (resizer.num_blocks, small_ring)
    resizer.set_gpu_budget(start).wait(0)
    assert sent[-1] == (resizer.num_blocks, staging)

    def broken(manager, n):
        raise RuntimeError("block pool")
    monkeypatch.setattr(resize_control, "resize_block_pool", broken)
    with pytest.raises(BudgetRefused, match="block pool"):
        resizer.set_gpu_budget(start // 2).wait(0)
    assert sent[-2][1] == small_ring and sent[-1][1] == staging  # restored


def test_a_shrink_takes_the_pool_past_every_rows_window_before_it_cuts_the_ring(tmp_path):
    """The engine's own split (the resizer's rows_pool_bytes: max_num_seqs windows and the null block):
    a budget that still holds every window beside the whole ring keeps the ring and shrinks the pool; one
    that does not cuts the ring to what the windows leave."""
    from tests.integrations.vllm.test_resize_apply import engine_of

    resizer, core, _, _, staging = engine_of(tmp_path)
    config = load_config(write_config(tmp_path, window=4 * BS, staging_blocks=8))
    start = resizer.budget_bytes
    config = dataclasses.replace(config, cache=dataclasses.replace(config.cache, gpu_budget_bytes=start))
    resizer._split_fn = lambda b, rows_pool_bytes=None, **_: split_budget(config, b, rows_pool_bytes=rows_pool_bytes)
    sent = []
    rpc = core.collective_rpc
    core.collective_rpc = lambda fn, args=(): (sent.append(args), rpc(fn, args))[1]
    rows_pool = resizer.rows_pool_bytes
    keeps = rows_pool + staging + resizer.bytes_per_block  # every window, the whole ring, and a block to spare
    assert keeps < start // 2, "the test engine's budget must leave room past every window"
    resizer.set_gpu_budget(keeps).wait(0)
    assert sent[-1] == (resizer.num_blocks, staging)  # the ring as at start, the pool cut
    assert resizer.num_blocks * resizer.bytes_per_block >= rows_pool
    assert resizer.stats()["staging_bytes"] == staging
    tight = rows_pool + staging // 2
    resizer.set_gpu_budget(tight).wait(0)
    ring = max(staging // 2, staging * tight // start)
    assert sent[-1] == (resizer.num_blocks, ring) and ring < staging
    assert resizer.num_blocks * resizer.bytes_per_block + ring <= tight
    resizer.set_gpu_budget(start).wait(0)
    assert sent[-1][1] == staging and resizer.stats()["staging_bytes"] == staging


def _repeat_step_far_parts(worker, scheduler, prompt: list[int], req_id: str, q_seed: int, window: int):
    """One step of a request repeating a saved prompt (its prefix served by the tiers): per layer name, the
    far part (out, lse) of random queries over the blocks vLLM freed, and the far blocks it read."""
    kv_config = hot_kv_cache_config(window)
    req = make_request(req_id, prompt)
    matched, _ = scheduler.get_num_new_matched_tokens(req, 0)
    manager = KVCacheManager(kv_config, max_model_len=4096, scheduler_block_size=BS, hash_block_size=BS,
                             max_in_flight_tokens=256, enable_caching=False)
    assert manager.allocate_slots(req, len(prompt) - matched, num_external_computed_tokens=matched) is not None
    row = manager.get_blocks(req.request_id)
    scheduler.update_state_after_alloc(req, row, matched)
    meta = pickle.loads(pickle.dumps(scheduler.build_connector_meta(schedule(req, row.get_block_ids()[0], matched))))
    runner = _Runner([req_id])
    hot_window._STATE["runner"] = weakref.ref(runner)
    try:
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        step = hot_window.current_step()
        q = torch.randn(len(prompt) - matched, HQ, D, generator=torch.Generator().manual_seed(q_seed))
        parts = {}
        for name in NAMES:
            worker.wait_for_layer_load(name)
            parts[name] = step.far.attend(worker.store.layer_index[name], q, 0.3)
        worker.wait_for_save()
    finally:
        hot_window._STATE["runner"] = None
    return parts, q, far_blocks(matched, window, BS)


@pytest.mark.parametrize("ring_blocks", [2, 3, 4, 12])
def test_a_remade_ring_keeps_its_regions_and_the_far_part_bit_for_bit(tmp_path, ring_blocks):
    """An exact hot window started with a 5-block ring (two regions of 2 blocks), re-made from `ring_blocks`
    blocks before a repeated prefix's step: the ring keeps 2-block regions, as many as fit (at most two; a
    grow past the start-up size adds none), the far blocks stream through it in the same chunks, and the far
    part is bit for bit the start-up ring's (a ring cut into smaller chunks would merge other partial
    results), and equals dense attention over the saved blocks."""
    window = 4 * BS
    worker, scheduler, caches = hot_connectors(tmp_path, window=window, staging_blocks=5)
    store = worker.store
    block_bytes = store.layout.num_bytes
    prompt = [random.randrange(1000) for _ in range(10 * BS + 3)]
    hashes = store.extend_hashes([], prompt, 10)
    saved_ids = list(range(40, 50))
    try:
        for name in NAMES:
            store.save_layer(store.layer_index[name], caches[name], [BlockSpan("earlier", saved_ids, hashes)])
        store.poll(wait=True)
        original = {n: store.paged.read(caches[n], torch.tensor(saved_ids)) for n in NAMES}
        far = worker._far
        assert far.pool.staging_bytes == 4 * block_bytes and far.pool.region_blocks == 2  # 5 blocks in 2 regions
        before, q, first_resident = _repeat_step_far_parts(worker, scheduler, prompt, "first", 7, window)
        chunks_before = far.streamer.num_chunks_streamed
        bind = worker.prepare_staging(ring_blocks * block_bytes)
        assert bind is not None  # another byte count than the start-up 5 blocks: re-made
        bind()
        assert far.pool.region_blocks == 2 and far.pool.num_regions == min(2, ring_blocks // 2)
        assert worker.prepare_staging(ring_blocks * block_bytes) is None  # already that size
        after, _, _ = _repeat_step_far_parts(worker, scheduler, prompt, "again", 7, window)
        for name in NAMES:
            assert torch.equal(after[name][0], before[name][0]) and torch.equal(after[name][1], before[name][1])
            want_out, want_lse = dense(q, original[name][:first_resident], 0.3)
            torch.testing.assert_close(after[name][0].double(), want_out, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(after[name][1].double(), want_lse, rtol=1e-5, atol=1e-5)
        assert far.streamer.num_chunks_streamed - chunks_before == -(-first_resident // 2) * len(NAMES)
    finally:
        worker.shutdown()
        scheduler.shutdown()


def test_a_ring_too_small_for_one_start_up_region_is_refused_before_anything_changes(tmp_path):
    worker, scheduler, _ = hot_connectors(tmp_path, window=4 * BS, staging_blocks=5)
    try:
        before = worker._far.pool
        with pytest.raises(ConfigError, match="less than one region of its start-up size"):
            worker.prepare_staging(worker.store.layout.num_bytes)  # one block; the regions hold two
        assert worker._far.pool is before
    finally:
        worker.shutdown()
        scheduler.shutdown()


def test_the_sparse_staging_is_remade_but_not_under_the_full_decode_graph(tmp_path):
    """The sparse policy's workers re-make ring and eager regions at a new size (allocated first, bound by
    the returned callable); with the full decode graph's rows present a different size is refused
    before anything is allocated (vLLM's captured graphs hold the caches)."""
    from tests.integrations.vllm.test_hot_window import sparse_connectors

    worker, scheduler, _ = sparse_connectors(tmp_path)
    try:
        far, staging = worker._far, worker.store.config.scheduler.staging_bytes
        block_bytes = worker.store.layout.num_bytes
        assert worker.prepare_staging(staging) is None
        before = far.pool, far.sparse_streamer
        bind = worker.prepare_staging(staging * 2)
        assert (far.pool, far.sparse_streamer) == before  # allocated, not yet bound
        bind()
        assert far.staging_bytes == staging * 2 and far.pool is not before[0] and far.sparse_streamer is not before[1]
        assert far.stats()["staging_bytes"] <= staging * 2
        assert far.stats()["staging_bytes"] > staging - block_bytes  # it did grow: more than the old split held
        far.full = object()  # FullDecodeRows sets itself here
        with pytest.raises(RuntimeError, match="full decode graph"):
            worker.prepare_staging(staging)
        assert far.staging_bytes == staging * 2
        far.full = None
    finally:
        worker.shutdown()
        scheduler.shutdown()


@pytest.mark.parametrize("policy", ["exact", "sparse"])
def test_every_staging_the_split_gives_with_the_workers_least_the_worker_can_remake(tmp_path, policy):
    """With the least staging the worker reports (`worker_least_staging`: one ring region beside, under the
    sparse policy, the two eager regions), the staging the split gives any smaller budget is one the worker
    re-makes (no refusal after the plan accepted it); the exact policy's is whole ring regions, the ring
    takes all of it (nothing left idle between ring and pool)."""
    from tests.integrations.vllm.test_hot_window import sparse_connectors
    from tierkv.integrations.vllm.resize_worker import worker_least_staging

    worker, scheduler, _ = (sparse_connectors(tmp_path) if policy == "sparse"
                            else hot_connectors(tmp_path, window=4 * BS, staging_blocks=7))
    try:
        far, config = worker._far, worker.store.config
        block_bytes = worker.store.layout.num_bytes
        least = far.grid.least_staging_bytes(block_bytes)
        from unittest import mock
        with mock.patch("vllm.distributed.kv_transfer.has_kv_transfer_group", return_value=True), \
             mock.patch("vllm.distributed.kv_transfer.get_kv_transfer_group", return_value=worker):
            assert worker_least_staging(None) == least
        start = config.cache.gpu_budget_bytes
        seen = set()
        for budget in range(1, start, max(1, start // 97)):
            staging = split_budget(config, budget, least_staging_bytes=least).staging_bytes
            assert least <= staging <= config.scheduler.staging_bytes
            if staging in seen or staging == far.staging_bytes:
                continue
            seen.add(staging)
            bind = worker.prepare_staging(staging)  # never refused
            bind()
            if policy == "exact":
                assert staging % least == 0 and far.pool.staging_bytes == staging
        assert len(seen) >= 2
    finally:
        worker.shutdown()
        scheduler.shutdown()


def test_the_staging_takes_an_allocator_pool_of_its_own_except_under_vllms_sleep_mode(tmp_path, monkeypatch):
    """Under vLLM's sleep mode register_kv_caches runs inside vLLM's CuMem pool (freed by sleep()): the far path's
    staging stays there (own_pool False); otherwise it is made inside `own_segments`."""
    from tierkv.integrations.vllm import far_staging

    entered = []

    class Recorder:
        def __init__(self, device):
            entered.append(device)

        def __enter__(self):
            return "pool"

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(far_staging, "own_segments", Recorder)
    worker, scheduler, _ = hot_connectors(tmp_path, window=4 * BS, staging_blocks=5)
    try:
        store = worker.store
        assert len(entered) == 1 and worker._far.segments == "pool"  # the engine's start-up staging
        assert worker.sleep_mode is False and worker._far.own_pool is True
        assert far_staging.split_staging(store, 1).segments == "pool" and len(entered) == 2
        assert far_staging.split_staging(store, 1, own_pool=False).segments is None and len(entered) == 2
    finally:
        worker.shutdown()
        scheduler.shutdown()
