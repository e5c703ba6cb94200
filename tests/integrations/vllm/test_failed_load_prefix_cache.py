"""A prefix block that failed to load must leave vLLM's prefix cache: under the recompute policy vLLM kept it
cached, so when its request was aborted (or preempted) before the recompute, the next request with the prompt
got the block as a prefix hit, holding whatever the failed load left (found by a connector probe, with vLLM's
own Scheduler and prefix caching on, as `TieredLLM(hot_window=False)` runs it)."""
from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="pip install --no-deps vllm==0.26.0 (see .ci/run) to run the vLLM tests")

from tests.integrations.vllm.test_loaded_window_pins import BS, Engine  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402


def engine_forgetting(tmp_path, prompt: list[int]) -> Engine:
    """Full attention with vLLM's prefix cache on (as `TieredLLM(hot_window=False)` runs it): a first request
    computed `prompt` and its blocks reached the tiers; vLLM's own cache then forgot them."""
    engine = Engine(tmp_path, cpu_keys=2048, window=None, prefix_caching=True)
    engine.add("a", prompt, 3)
    for _ in range(4):
        engine.step()
    engine.worker.store.poll(wait=True)
    assert engine.sched.kv_cache_manager.reset_prefix_cache()
    return engine


def lose_at_next_load(engine: Engine, block: int) -> None:
    """Layer 1 of the next step's loaded block `block` leaves the tiers between the lookup and the load."""
    def lose(meta):
        store = engine.worker.store
        store.chain.remove_many(store.keys(meta.loads[0].hashes[block:block + 1], 1))
        engine.before_forward = None

    engine.before_forward = lose


@pytest.mark.parametrize("lost_block", [0, 1, 2])
def test_a_block_that_failed_to_load_is_no_prefix_hit_after_its_request_is_aborted(tmp_path, lost_block):
    prompt = list(range(100, 113))  # 3 full blocks and a token
    engine = engine_forgetting(tmp_path, prompt)
    try:
        lose_at_next_load(engine, lost_block)
        engine.add("b", prompt, 3)
        invalid = engine.step()
        assert len(invalid) == 1
        (bad,) = invalid
        assert engine.sched.kv_cache_manager.block_pool.blocks[bad].block_hash is None  # out of the cache
        engine.sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)  # gone before its recompute
        blocks, hit_tokens, _ = engine.sched.kv_cache_manager.get_computed_blocks(engine.request("c", prompt, 3))
        assert hit_tokens == lost_block * BS and bad not in blocks.get_block_ids()[0]
    finally:
        engine.close()


def test_every_request_holding_a_block_that_failed_to_load_recomputes_it(tmp_path):
    """A duplicate prompt in the step gets the loading request's blocks from vLLM's prefix cache. vLLM moved back
    only the first holder of a failed block: the second kept it counted computed, and when the first was aborted
    before its recompute, nobody recomputed it (the second sampled over it and saved its next blocks with it; its
    own blocks of that step stayed cached for later prompts). Found by a taint-propagating probe."""
    prompt = list(range(100, 117))  # 4 full blocks and a token
    engine = engine_forgetting(tmp_path, prompt)
    try:
        lose_at_next_load(engine, 0)
        engine.add("b", prompt, 3)
        engine.add("c", prompt, 3)  # a prefix hit on b's blocks, in the same step
        (bad,) = engine.step()
        manager = engine.sched.kv_cache_manager
        for req_id in ("b", "c"):
            assert engine.sched.requests[req_id].num_computed_tokens == 0, req_id  # both recompute from block 0
        c_blocks = manager.get_block_ids("c")[0]
        assert bad in c_blocks and all(manager.block_pool.blocks[b].block_hash is None for b in c_blocks)
        engine.sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)
        engine.step()  # c recomputes its blocks
        assert engine.sched.requests["c"].num_computed_tokens == len(prompt)
    finally:
        engine.close()
