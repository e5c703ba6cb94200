"""The connector when a step goes wrong: a forward that raised after `start_load_kv` leaves no load
behind for the next step to write into block ids vLLM has given to another request since."""
from __future__ import annotations

import pickle

import pytest
import torch

pytest.importorskip("vllm", reason="pip install --no-deps vllm==0.26.0 (see .ci/run) to run the vLLM tests")

from tests.integrations.vllm.test_connector import NAMES, engine, make_request, run_forward, schedule  # noqa: E402,F401
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData  # noqa: E402


def blocks_of(ids) -> KVCacheBlocks:
    return KVCacheBlocks((tuple(KVCacheBlock(b) for b in ids),))


def cached_step(scheduler, template, steps, finished=()):
    """The connector's metadata of a vLLM step over running requests: `steps` of (request, its
    num_computed_tokens, tokens scheduled), `finished` request ids; `template` only shapes the output."""
    cached = CachedRequestData.make_empty()
    cached.req_ids = [req.request_id for req, _, _ in steps]
    cached.num_computed_tokens = [computed for _, computed, _ in steps]
    cached.new_block_ids = [None for _ in steps]
    out = schedule(template, [], 0)
    out.scheduled_new_reqs, out.scheduled_cached_reqs = [], cached
    out.num_scheduled_tokens = {req.request_id: new for req, _, new in steps}
    out.total_num_scheduled_tokens = sum(new for _, _, new in steps)
    out.finished_req_ids = set(finished)
    return scheduler.build_connector_meta(out)


def saved_prompt(scheduler, worker, caches, seed: int) -> list[int]:
    """A 70-token prompt a first request computed in blocks 0..4 and saved to the tiers (4 full blocks)."""
    prompt = torch.randint(0, 1000, (70,), generator=torch.Generator().manual_seed(seed)).tolist()
    first = make_request("a", prompt)
    scheduler.get_num_new_matched_tokens(first, 0)
    scheduler.update_state_after_alloc(first, blocks_of(range(5)), 0)
    run_forward(worker, caches, scheduler.build_connector_meta(schedule(first, list(range(5)), 0)))
    scheduler.request_finished(first, list(range(5)))
    worker.store.poll(wait=True)
    return prompt


def test_loads_of_a_step_whose_forward_raised_never_reach_a_later_step(engine):
    scheduler, worker, caches = engine(disk=False)
    prompt = saved_prompt(scheduler, worker, caches, seed=0)
    repeat = make_request("b", prompt)
    assert scheduler.get_num_new_matched_tokens(repeat, 0) == (64, False)
    scheduler.update_state_after_alloc(repeat, blocks_of(range(20, 25)), 64)
    meta = scheduler.build_connector_meta(schedule(repeat, list(range(20, 25)), 64))
    worker.bind_connector_metadata(pickle.loads(pickle.dumps(meta)))
    worker.start_load_kv(None)          # the loads planned, the first layers' copies issued
    worker.clear_connector_metadata()   # ... and the forward raised before its layers ran: b is dropped
    scheduler.request_finished(repeat, [])
    kept = {n: torch.full_like(caches[n][20:24], 7.0) for n in NAMES}  # blocks 20..23 now hold c's KV
    for n in NAMES:
        caches[n][20:24] = kept[n]
    other = make_request("d", torch.randint(0, 1000, (20,), generator=torch.Generator().manual_seed(1)).tolist())
    scheduler.get_num_new_matched_tokens(other, 0)
    scheduler.update_state_after_alloc(other, blocks_of([50, 51]), 0)
    run_forward(worker, caches, scheduler.build_connector_meta(schedule(other, [50, 51], 0)))
    assert [n for n in NAMES if not torch.equal(caches[n][20:24], kept[n])] == []
    assert worker.store.counts["blocks_loaded"] == 0  # the dropped step's planned blocks never landed


def _hot_forward(worker, meta, order) -> None:
    """One engine step of the hot-window worker over requests `order` (as vLLM's runner calls it)."""
    import weakref

    from tests.integrations.vllm.test_hot_window import _Runner
    from tierkv.integrations.vllm import hot_window

    runner = _Runner(order)
    hot_window._STATE["runner"] = weakref.ref(runner)
    try:
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        for name in NAMES:
            worker.wait_for_layer_load(name)
            worker.save_kv_layer(name, worker._kv_caches[name], None)
        worker.wait_for_save()
    finally:
        worker.clear_connector_metadata()
        hot_window._STATE["runner"] = None
        hot_window.set_step(None)


def test_a_cpu_tier_too_small_for_the_running_far_kv_names_its_key_and_leaks_no_pin(tmp_path):
    """Two requests whose far KV together passes the CPU tier: the step that cannot pin the second one's far
    blocks says the tier must hold them (capacity named, not a loss), and the first request decodes on alone
    after the second is dropped, with every pin back once both finish."""
    import random

    from tests.integrations.vllm.test_connector import BS
    from tests.integrations.vllm.test_hot_window import hot_connectors

    rng = random.Random(0)
    worker, scheduler, _ = hot_connectors(tmp_path, window=2 * BS, staging_blocks=8, cpu_blocks=36)

    def prefill(req_id: str, block_ids: list[int]):
        req = make_request(req_id, [rng.randrange(1000) for _ in range(10 * BS + 3)])
        assert scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
        _hot_forward(worker, scheduler.build_connector_meta(schedule(req, block_ids, 0)), [req_id])
        req.num_computed_tokens = 10 * BS + 3
        req.append_output_token_ids(7)
        return req

    def decode(reqs, finished=()):  # one token for each of `reqs`
        meta = cached_step(scheduler, a, [(r, r.num_computed_tokens, 1) for r in reqs], finished)
        _hot_forward(worker, meta, [r.request_id for r in reqs])

    try:
        a, b = prefill("A", list(range(0, 11))), prefill("B", list(range(20, 31)))
        with pytest.raises(RuntimeError, match=r"cannot be pinned in the CPU tier \(all \d+ found in the tiers\).*"
                                               r"raise tiers\[0\]\.capacity_bytes"):
            decode([a, b])
        scheduler.request_finished(b, [])
        a.num_computed_tokens += 1
        a.append_output_token_ids(8)
        decode([a], finished=["B"])  # the first request goes on
        scheduler.request_finished(a, [])
        decode([], finished=["A"])
        worker.store.poll(wait=True)
        assert sum(worker.store.cpu._pin_state.keys.values()) == 0
    finally:
        worker.shutdown()
        scheduler.shutdown()


@pytest.mark.parametrize("lost", ["blocks 2 and 3, every layer", "block 2, layer 1 only"])
def test_blocks_recomputed_after_a_failed_load_are_saved_again(engine, lost):
    """Prefix blocks vanish between the lookup and the load: the worker reports them as load errors, vLLM
    (recompute policy) schedules the request again from the first of them, and the connector saves what it
    recomputes, so the next request with the prompt finds the whole prefix again. One layer of one block lost
    is saved again too (the save check read the first and last layer only, and every later request recomputed
    from that block; found by a connector probe)."""
    from tests.integrations.vllm.test_connector import LAYERS

    scheduler, worker, caches = engine(disk=False)
    prompt = saved_prompt(scheduler, worker, caches, seed=2)
    repeat = make_request("b", prompt)
    assert scheduler.get_num_new_matched_tokens(repeat, 0) == (64, False)
    ids = list(range(20, 25))
    scheduler.update_state_after_alloc(repeat, blocks_of(ids), 64)
    meta = scheduler.build_connector_meta(schedule(repeat, ids, 64))
    store = scheduler.store
    hashes = meta.loads[0].hashes
    if lost == "block 2, layer 1 only":
        store.chain.remove_many(store.keys(hashes[2:3], 1))
        failed = [22]
    else:
        store.chain.remove_many([k for layer in range(LAYERS) for k in store.keys(hashes[2:], layer)])
        failed = [22, 23]
    run_forward(worker, caches, meta)
    assert worker.get_block_ids_with_load_errors() == set(failed)
    if lost == "blocks 2 and 3, every layer":
        assert worker.store.counts["blocks_loaded"] == 2  # of the four planned, the two that landed
    again = cached_step(scheduler, repeat, [(repeat, 32, 70 - 32)])  # vLLM's next step: from the first failed block
    assert [s.block_ids for s in again.saves] == [failed]
    run_forward(worker, caches, again)
    scheduler.request_finished(repeat, ids)
    worker.store.poll(wait=True)
    assert scheduler.get_num_new_matched_tokens(make_request("c", prompt), 0) == (64, False)


def test_blocks_computed_over_a_failed_load_are_not_saved_until_their_recompute(engine):
    """A step whose prefix load fails still computes the rest of its prompt, attending the block that did not
    load: that KV is wrong. It was saved under the right hashes, and the recompute vLLM schedules next found
    those blocks held and saved nothing, so every later request with the prompt loaded the wrong KV (found
    by a connector probe). The step's saves of requests that read a failed block are dropped; the recompute
    saves them."""
    from tests.integrations.vllm.test_connector import LAYERS

    scheduler, worker, caches = engine(disk=False)
    prompt = saved_prompt(scheduler, worker, caches, seed=3)[:64] + list(range(500, 540))  # 4 held + 2 new blocks
    b = make_request("b", prompt)
    assert scheduler.get_num_new_matched_tokens(b, 0) == (64, False)
    ids = list(range(20, 27))
    scheduler.update_state_after_alloc(b, blocks_of(ids), 64)
    meta = scheduler.build_connector_meta(schedule(b, ids, 64))
    assert [s.block_ids for s in meta.saves] == [[24, 25]] and meta.saves[0].reads == [20, 21, 22, 23]
    store = scheduler.store
    store.chain.remove_many(store.keys(meta.loads[0].hashes[2:3], 1))  # block 2, layer 1: gone after the lookup
    for n in NAMES:  # what this step computes for blocks 4 and 5 attended block 2's garbage
        caches[n][[24, 25]] = torch.full_like(caches[n][[24, 25]], -7.0)
    run_forward(worker, caches, meta)
    assert worker.get_block_ids_with_load_errors() == {22}
    again = cached_step(scheduler, b, [(b, 32, len(prompt) - 32)])  # vLLM's recompute from block 2
    assert [s.block_ids for s in again.saves] == [[22, 24, 25]]
    right = {n: torch.randn_like(caches[n][[24, 25]]) for n in NAMES}
    for n in NAMES:
        caches[n][[24, 25]] = right[n]
    run_forward(worker, caches, again)
    scheduler.request_finished(b, ids)
    worker.store.poll(wait=True)
    c = make_request("c", prompt)
    assert scheduler.get_num_new_matched_tokens(c, 0) == (96, False)
    c_ids = list(range(40, 47))
    scheduler.update_state_after_alloc(c, blocks_of(c_ids), 96)
    run_forward(worker, caches, scheduler.build_connector_meta(schedule(c, c_ids, 96)))
    assert worker.get_block_ids_with_load_errors() == set()
    for n in NAMES[:LAYERS]:
        assert torch.equal(caches[n][[44, 45]], right[n])


def test_a_duplicate_prompt_sharing_a_block_that_failed_to_load_does_not_save_over_it(engine):
    """Two requests with one prompt in one step: vLLM caches the blocks the first loads and gives them to the
    second, which computes its own tokens over them. When the load fails, neither request's computed blocks
    are saved (the second has no load of its own: its save names the shared blocks it read)."""
    from vllm.v1.core.sched.output import NewRequestData

    scheduler, worker, caches = engine(disk=False)
    prompt = saved_prompt(scheduler, worker, caches, seed=4)[:64] + list(range(600, 640))
    b, c = make_request("b", prompt), make_request("c", prompt[:64] + list(range(700, 740)))
    assert scheduler.get_num_new_matched_tokens(b, 0) == (64, False)
    b_ids, c_ids = list(range(20, 27)), [20, 21, 22, 23, 34, 35, 36]  # c: vLLM's prefix-cache hit on b's blocks
    scheduler.update_state_after_alloc(b, blocks_of(b_ids), 64)
    assert scheduler.get_num_new_matched_tokens(c, 64) == (0, False)
    scheduler.update_state_after_alloc(c, blocks_of(c_ids), 0)
    out = schedule(b, b_ids, 64)
    second = NewRequestData.from_request(c, (c_ids,))
    second.num_computed_tokens = 64
    out.scheduled_new_reqs.append(second)
    out.num_scheduled_tokens["c"] = 40
    out.total_num_scheduled_tokens += 40
    meta = scheduler.build_connector_meta(out)
    assert {s.req_id: s.block_ids for s in meta.saves} == {"b": [24, 25], "c": [34, 35]}
    assert all(s.reads == [20, 21, 22, 23] for s in meta.saves)
    store = scheduler.store
    store.chain.remove_many(store.keys(meta.loads[0].hashes[1:2], 2))  # block 1, last layer
    run_forward(worker, caches, meta)
    assert worker.get_block_ids_with_load_errors() == {21}
    worker.store.poll(wait=True)
    hashes = [h for s in meta.saves for h in s.hashes]
    for layer in range(1, 3):  # the layers after the first the failed load fed (layer 0's saves went before it)
        assert not any(worker.store.num_held(store.keys([h], layer)) for h in hashes)


@pytest.mark.parametrize("layer", [1, 0])
def test_a_block_missing_one_layer_before_any_load_is_saved_whole_again(engine, layer):
    """A lower tier dropped one key of a prefix block (an LRU or TTL eviction of Redis, a corrupt disk
    record): the lookup stops there, the request computes it, and the save checked only the first and last
    layer, found it held, and saved nothing, so every later request stopped at that block too (found by a
    connector probe)."""
    scheduler, worker, caches = engine(disk=False)
    prompt = saved_prompt(scheduler, worker, caches, seed=5)
    store = scheduler.store
    probe = make_request("probe", prompt)
    scheduler.get_num_new_matched_tokens(probe, 0)
    hashes = scheduler._scheduler._requests["probe"].hashes
    store.chain.remove_many(store.keys(hashes[2:3], layer))  # block 2 loses one layer
    b = make_request("b", prompt)
    assert scheduler.get_num_new_matched_tokens(b, 0) == (32, False)
    ids = list(range(20, 25))
    scheduler.update_state_after_alloc(b, blocks_of(ids), 32)
    meta = scheduler.build_connector_meta(schedule(b, ids, 32))
    assert [s.block_ids for s in meta.saves] == [[22]]  # block 3 is whole: only the block with the hole
    run_forward(worker, caches, meta)
    scheduler.request_finished(b, ids)
    worker.store.poll(wait=True)
    assert scheduler.get_num_new_matched_tokens(make_request("c", prompt), 0) == (64, False)
