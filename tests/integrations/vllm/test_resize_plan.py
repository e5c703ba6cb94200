"""Run-time resize of the vLLM hot-window pool, bookkeeping: the split (the start-up one), the block
count (vLLM's own arithmetic), refusals with sizes before anything changes, and vLLM's own
BlockPool / KVCacheManager shrunk and grown on CPU."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

try:
    import vllm  # noqa: F401  CI installs vLLM: a missing vLLM fails here, never skips
except ImportError:
    pytest.importorskip("vllm", reason="pip install --no-deps vllm==0.26.0 (see .ci/run) to run the vLLM tests")

from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor, SlidingWindowSpec  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from tierkv.budget_change import BudgetRefused  # noqa: E402
from tierkv.config import ConfigError, load_config  # noqa: E402
from tierkv.integrations.vllm.engine_args import hot_window_engine_args  # noqa: E402
from tierkv.integrations.vllm.resize_blocks import (  # noqa: E402
    BlockPoolBusy, held_tail_block_ids, missing_block_pool_hooks, resize_block_pool)
from tierkv.integrations.vllm.resize_plan import RunningRequest, plan_resize, split_budget, window_blocks  # noqa: E402
from tests.integrations.vllm.test_connector import BS, D, H, NAMES, vllm_config  # noqa: E402
from tests.integrations.vllm.test_hot_window import write_config  # noqa: E402

WINDOW = 4 * BS
SPEC = SlidingWindowSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.float32, sliding_window=WINDOW)
BYTES_PER_BLOCK = SPEC.page_size_bytes * len(NAMES)
FIXED_STAGING = ("staging_follows_budget: false",)  # the pool's bookkeeping alone (the ring's share: test_resize_staging)
WINDOW_BLOCKS = window_blocks(WINDOW, 2 * BS, 4096, BS)


def groups():
    return [KVCacheGroupSpec(layer_names=list(NAMES), kv_cache_spec=SPEC)]


def manager_of(num_blocks: int) -> KVCacheManager:
    tensors = [KVCacheTensor(size=num_blocks * SPEC.page_size_bytes, shared_by=[n]) for n in NAMES]
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups())
    return KVCacheManager(config, max_model_len=4096, scheduler_block_size=BS, hash_block_size=BS,
                          max_in_flight_tokens=256, enable_caching=False)


def request(req_id: str, num_tokens: int) -> Request:
    return Request(req_id, list(range(num_tokens)), SamplingParams(max_tokens=4), None)


def pool_state(manager) -> tuple:
    pool = manager.block_pool
    return (pool.num_gpu_blocks, [b.block_id for b in pool.blocks], pool.get_num_free_blocks(),
            [b.block_id for b in pool.free_block_queue.get_all_free_blocks()], manager.kv_cache_config.num_blocks)


def plan(budget, config, running=(), old=64):
    return plan_resize(budget, lambda b: split_budget(config, b), bytes_per_block=BYTES_PER_BLOCK, old_num_blocks=old,
                       window_blocks_per_request=WINDOW_BLOCKS, running=running)


@pytest.fixture
def config(tmp_path):
    return load_config(write_config(tmp_path, window=WINDOW, staging_blocks=8, scheduler_lines=FIXED_STAGING))


@settings(max_examples=60, deadline=None)
@given(extra_blocks=st.integers(WINDOW_BLOCKS + 1, 4000), spare=st.integers(0, BYTES_PER_BLOCK - 1))
def test_the_resize_split_and_block_count_equal_the_start_up_ones(tmp_path_factory, extra_blocks, spare):
    """The budget's pool is what hot_window_engine_args gives vLLM at start-up, and its block count
    what vLLM's own get_kv_cache_config_from_groups makes of that pool."""
    config = load_config(write_config(tmp_path_factory.mktemp("c"), window=WINDOW, staging_blocks=8,
                                      scheduler_lines=FIXED_STAGING))
    budget = config.scheduler.staging_bytes + extra_blocks * BYTES_PER_BLOCK + spare
    config.cache.gpu_budget_bytes = budget
    start_pool = hot_window_engine_args(config)["kv_cache_memory_bytes"]
    assert split_budget(config, budget).pool_bytes == start_pool
    vllm_blocks = get_kv_cache_config_from_groups(vllm_config(write_config(tmp_path_factory.mktemp("v"), window=WINDOW,
                                                                            staging_blocks=8)), groups(), start_pool)
    assert plan(budget, config).new_num_blocks == vllm_blocks.num_blocks == extra_blocks


def test_a_budget_within_the_reservations_is_refused_with_the_sizes(config):
    staging = config.scheduler.staging_bytes
    with pytest.raises(BudgetRefused, match=rf"{staging} bytes.*the staging kept at this budget.*window needs"):
        plan(staging, config)
    with pytest.raises(ConfigError, match="must exceed scheduler.staging_bytes"):  # the same rule at start-up
        config.cache.gpu_budget_bytes = staging
        hot_window_engine_args(config)


def test_a_pool_below_one_window_is_refused_with_the_sizes(config):
    staging = config.scheduler.staging_bytes
    floor = WINDOW_BLOCKS + 1
    assert plan(staging + floor * BYTES_PER_BLOCK, config).new_num_blocks == floor
    with pytest.raises(BudgetRefused, match=rf"hold {floor - 1} blocks.*window needs {WINDOW_BLOCKS} blocks"):
        plan(staging + (floor - 1) * BYTES_PER_BLOCK, config)


def test_a_pool_below_the_running_requests_is_refused_with_the_sizes(config):
    staging = config.scheduler.staging_bytes
    running = [RunningRequest(f"r{i}", tuple(range(1 + 5 * i, 6 + 5 * i)), WINDOW_BLOCKS) for i in range(3)]
    need = 3 * WINDOW_BLOCKS + 1
    assert plan(staging + need * BYTES_PER_BLOCK, config, running).new_num_blocks == need
    with pytest.raises(BudgetRefused, match=rf"3 running requests can hold {need - 1} blocks"):
        plan(staging + (need - 1) * BYTES_PER_BLOCK, config, running)


@settings(max_examples=150, deadline=None)
@given(budget_blocks=st.integers(-2, 120),
       running=st.lists(st.tuples(st.integers(0, 12), st.integers(1, 30)), max_size=8))
def test_any_budget_is_planned_at_its_block_count_or_refused_for_a_stated_reason(tmp_path_factory, budget_blocks,
                                                                                running):
    config = load_config(write_config(tmp_path_factory.mktemp("c"), window=WINDOW, staging_blocks=8,
                                      scheduler_lines=FIXED_STAGING))
    reqs = [RunningRequest(str(i), tuple(range(100 * i + 1, 100 * i + 1 + held)), need)
            for i, (held, need) in enumerate(running)]
    budget = config.scheduler.staging_bytes + budget_blocks * BYTES_PER_BLOCK
    need = sum(max(len(r.block_ids), min(r.need_blocks, WINDOW_BLOCKS)) for r in reqs) + 1
    floor = WINDOW_BLOCKS + 1
    if budget_blocks >= max(floor, need if reqs else 0):
        result = plan(budget, config, reqs)
        assert result.new_num_blocks == budget_blocks and result.new_pool_bytes == budget_blocks * BYTES_PER_BLOCK
        assert result.held_tail_blocks(reqs) == sorted(b for r in reqs for b in r.block_ids if b >= budget_blocks)
    else:
        with pytest.raises(BudgetRefused) as refused:
            plan(budget, config, reqs)
        assert refused.value.budget_bytes == budget and str(budget) in str(refused.value)


@pytest.mark.parametrize("bad", [0, -1, "lots", True, float("nan")])
def test_a_value_that_is_not_a_size_is_refused(config, bad):
    with pytest.raises(ValueError, match="budget"):
        plan(bad, config)


def test_vllm_has_what_the_block_pool_resize_uses():
    assert missing_block_pool_hooks() == []


def test_a_moved_block_pool_method_is_named(monkeypatch):
    from vllm.v1.core.block_pool import BlockPool

    monkeypatch.delattr(BlockPool, "_maybe_evict_cached_block")
    assert missing_block_pool_hooks() == ["BlockPool._maybe_evict_cached_block"]


def test_vllms_block_pool_shrinks_among_free_tail_blocks_and_grows():
    manager = manager_of(64)
    req = request("a", 5 * BS)
    assert manager.allocate_slots(req, 5 * BS) is not None
    held = manager.get_block_ids("a")[0]
    assert max(held) < 16
    resize_block_pool(manager, 16)
    assert pool_state(manager)[:3] == (16, list(range(16)), 16 - 1 - len(held))
    more = request("b", 10 * BS)  # what is left: nothing past id 15 is handed out
    assert manager.allocate_slots(more, 10 * BS) is not None
    assert max(manager.get_block_ids("b")[0]) < 16 and manager.block_pool.get_num_free_blocks() == 0
    assert manager.allocate_slots(request("c", BS), BS) is None  # full: vLLM queues, nothing fails
    resize_block_pool(manager, 40)
    assert pool_state(manager)[0] == 40 and manager.block_pool.get_num_free_blocks() == 24
    assert manager.allocate_slots(request("c", BS), BS) is not None
    assert manager.block_pool.get_usage() == pytest.approx(1 - 23 / 39)


def test_a_shrink_over_held_blocks_is_refused_and_changes_nothing():
    manager = manager_of(64)
    filler = request("filler", 40 * BS)
    assert manager.allocate_slots(filler, 40 * BS) is not None
    tail = request("tail", 3 * BS)
    assert manager.allocate_slots(tail, 3 * BS) is not None  # ids 41..43
    manager.free(filler)
    before = pool_state(manager)
    assert held_tail_block_ids(manager.block_pool, 20) == manager.get_block_ids("tail")[0]
    with pytest.raises(BlockPoolBusy, match="3 block ids"):
        resize_block_pool(manager, 20)
    assert pool_state(manager) == before
    manager.free(tail)
    resize_block_pool(manager, 20)
    assert pool_state(manager)[:3] == (20, list(range(20)), 19)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), ops=st.lists(st.sampled_from(["alloc", "free", "resize"]), max_size=30))
def test_the_pool_stays_consistent_through_any_allocs_frees_and_resizes(seed, ops):
    rng = random.Random(seed)
    manager, live = manager_of(32), []
    for i, op in enumerate(ops):
        if op == "alloc":
            req = request(f"r{i}", rng.randrange(1, 6) * BS)
            if manager.allocate_slots(req, req.num_prompt_tokens) is not None:
                live.append(req)
        elif op == "free" and live:
            manager.free(live.pop(rng.randrange(len(live))))
        elif op == "resize":
            target = rng.randrange(2, 80)
            before = pool_state(manager)
            try:
                resize_block_pool(manager, target)
            except BlockPoolBusy:
                assert pool_state(manager) == before
        num, ids, free, free_ids, config_blocks = pool_state(manager)
        held = [b for r in live for b in manager.get_block_ids(r.request_id)[0]]
        assert ids == list(range(num)) and config_blocks == num and free == len(free_ids)
        assert all(b < num for b in free_ids + held) and len(set(held)) == len(held)
        assert sorted(free_ids + held) == list(range(1, num))  # every block but the null one: free or held
