"""The run-time resize asks the pool floor the start-up check asks: one request's window plus vLLM's null
block, whatever max_num_seqs is.

The floor once counted one block per max_num_seqs row as well. Nothing in vLLM 0.26 asks that (its scheduler
runs as many requests as their windows fit and queues the rest), and it refused `vllm-128k` at
max_num_seqs 256 (vLLM's default on CPU; 1024 on an H100) every budget below about 8.5 GiB, the 2 GiB it
started at included. Here: vLLM's own Scheduler runs a pool of one window at max_num_seqs 256; the start-up
check and `plan_resize` accept and refuse the same budgets, for the same reason.
"""
from __future__ import annotations

import re
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm", reason="pip install --no-deps vllm==0.26.0 (see .ci/run) to run the vLLM tests")

import torch  # noqa: E402
from vllm.config import CacheConfig, DeviceConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor, SlidingWindowSpec  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from tierkv.budget_change import BudgetRefused  # noqa: E402
from tierkv.cli.plan import PRESETS, make_plan  # noqa: E402
from tierkv.config import ConfigError, load_config  # noqa: E402
from tierkv.integrations.vllm.pool_sizing import check_hot_window_pool  # noqa: E402
from tierkv.integrations.vllm.resize_plan import (  # noqa: E402
    admission_floor_blocks, plan_resize, split_budget, window_blocks)

ASKS_TO_CHANGE = r"raise the budget.*cache\.window_tokens or scheduler\.prefill_chunk_tokens"


def _scheduler(num_blocks: int, spec: SlidingWindowSpec, max_num_seqs: int, chunk: int, max_model_len: int):
    """vLLM's own Scheduler over a pool of `num_blocks`; the model config and structured outputs stubbed
    (no checkpoint on CPU), the prefix cache off (the requests carry no block hashes)."""
    config = VllmConfig(scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=chunk,
                                                         max_model_len=max_model_len, is_encoder_decoder=False),
                        cache_config=CacheConfig(block_size=spec.block_size, enable_prefix_caching=False),
                        device_config=DeviceConfig(device="cpu"))
    object.__setattr__(config, "model_config", mock.MagicMock(
        max_model_len=max_model_len, is_encoder_decoder=False, is_multimodal_model=False,
        enable_return_routed_experts=False))
    config.cache_config.num_gpu_blocks = num_blocks
    kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[KVCacheTensor(num_blocks * spec.page_size_bytes, ["l0"])],
                       kv_cache_groups=[KVCacheGroupSpec(layer_names=["l0"], kv_cache_spec=spec)])
    structured = mock.MagicMock()
    structured.should_advance.return_value = False
    return Scheduler(config, kv, structured, block_size=spec.block_size), config.max_in_flight_tokens


def test_vllm_runs_requests_in_a_pool_of_one_window_far_below_max_num_seqs():
    """What the floor stands on: vLLM's scheduler at max_num_seqs 256 in a pool of the floor's blocks (tens)
    admits, runs and finishes every request, queueing those whose windows do not fit."""
    spec = SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float32, sliding_window=64)
    _, in_flight = _scheduler(64, spec, 256, 256, 4096)  # vLLM's own in-flight tokens (doubled: async)
    floor = admission_floor_blocks(window_blocks(64, in_flight, 4096, 16))
    scheduler, _ = _scheduler(floor, spec, 256, 256, 4096)
    assert floor < 256 == scheduler.max_num_running_reqs
    for i in range(12):
        scheduler.add_request(Request(f"r{i}", list(range(100 + 37 * i)), SamplingParams(max_tokens=20, ignore_eos=True),
                                      None))
    most, steps = 0, 0
    while scheduler.has_unfinished_requests():
        steps += 1
        assert steps < 1000, "vLLM stopped making progress in a pool of the floor's blocks"
        out = scheduler.schedule()
        ids = list(out.num_scheduled_tokens)
        most = max(most, len(ids))
        done = [[1] if scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_tokens else [] for r in ids]
        scheduler.update_from_output(out, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: k for k, r in enumerate(ids)},
                                                            sampled_token_ids=done))
    assert 1 <= most < 12  # some ran together, the rest waited for free windows
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == floor - 1


@settings(max_examples=60, deadline=None)
@given(layers=st.integers(1, 32), kv_heads=st.sampled_from([1, 8]), block=st.sampled_from([16, 64]),
       window=st.sampled_from([1, 64, 2048]), chunk=st.sampled_from([256, 8192]), use_async=st.booleans(),
       max_model_len=st.sampled_from([4096, 131072]), max_num_seqs=st.sampled_from([1, 256, 1024]),
       pool_blocks=st.integers(1, 400), spare=st.integers(0, 1000))
def test_the_resize_accepts_and_refuses_what_the_start_up_check_does(layers, kv_heads, block, window, chunk, use_async,
                                                                     max_model_len, max_num_seqs, pool_blocks, spare):
    """At the budget an engine starts at (so the staging is the start-up one), for any max_num_seqs."""
    shape = {"num_hidden_layers": layers, "num_key_value_heads": kv_heads, "head_dim": 128,
             "max_position_embeddings": max_model_len, "dtype_bytes": 2, "sliding_window": None}
    config = load_config({"cache": {"block_tokens": block, "window_tokens": window},
                          "scheduler": {"prefill_chunk_tokens": chunk, "staging_bytes": "64MiB"}}, env={})
    block_bytes = layers * 2 * kv_heads * block * 128 * 2
    budget = config.scheduler.staging_bytes + pool_blocks * block_bytes + spare
    config.cache.gpu_budget_bytes = budget
    split = split_budget(config, budget)
    engine = {"max_num_batched_tokens": chunk, "max_model_len": max_model_len, "async_scheduling": use_async,
              "max_num_seqs": max_num_seqs, "kv_cache_memory_bytes": split.pool_bytes}
    per_request = window_blocks(window, chunk * (2 if use_async else 1), max_model_len, block)
    try:
        check_hot_window_pool(shape, config, engine)
        start_refusal = None
    except ConfigError as e:
        start_refusal = e
    try:
        resized = plan_resize(budget, lambda b: split_budget(config, b), bytes_per_block=block_bytes, old_num_blocks=1,
                              window_blocks_per_request=per_request)
        resize_refusal = None
    except BudgetRefused as e:
        resize_refusal = e
    assert (start_refusal is None) == (resize_refusal is None), (start_refusal, resize_refusal)
    if resize_refusal is None:
        assert resized.new_num_blocks == pool_blocks
        return
    for refusal in (start_refusal, resize_refusal):  # the same reason, and what to change
        assert "window" in str(refusal) and "max_num_seqs" not in str(refusal)
        assert re.search(ASKS_TO_CHANGE, str(refusal))


@pytest.mark.parametrize("max_num_seqs", [256, 1024])
def test_vllm_128k_resizes_at_the_budget_it_starts_at_and_below_what_start_up_accepts(max_num_seqs):
    """The shipped config as TieredLLM starts it: the plan fits at 2 GiB; set_gpu_budget then keeps
    2 GiB, shrinks to the least budget start-up accepts, and refuses one block less with the start-up's reason."""
    config = load_config("vllm-128k", env={})
    gpu = make_plan(PRESETS["llama-3.1-8b"], 131072, config, backend="vllm", max_num_seqs=max_num_seqs)["gpu"]
    assert gpu["fits"] and gpu["pool_blocks"] < max_num_seqs
    block_bytes = gpu["pool_block_bytes"]
    per_request = window_blocks(config.cache.window_tokens, config.scheduler.prefill_chunk_tokens, 131072,
                                config.cache.block_tokens)
    rows_pool = (max_num_seqs * per_request + 1) * block_bytes  # as PoolResizer passes it

    def plan(budget):
        return plan_resize(budget, lambda b: split_budget(config, b, rows_pool_bytes=rows_pool),
                           bytes_per_block=block_bytes, old_num_blocks=gpu["pool_blocks"],
                           window_blocks_per_request=per_request)

    assert plan("2GiB").new_num_blocks == gpu["pool_blocks"]
    assert gpu["window_bytes_per_request"] == admission_floor_blocks(per_request) * block_bytes
    least = config.scheduler.staging_bytes + gpu["window_bytes_per_request"]  # start-up's floor at a fixed staging
    config.scheduler.staging_follows_budget = False
    assert plan(least).new_num_blocks == admission_floor_blocks(per_request)
    with pytest.raises(BudgetRefused, match=rf"window needs {per_request} blocks.*{ASKS_TO_CHANGE}"):
        plan(least - 1)
