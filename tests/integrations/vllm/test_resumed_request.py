"""A preempted request resumed with a prefix hit in the tiers: vLLM 0.26 schedules it among the cached
requests (resumed_req_ids), not the new ones, and counts the hit's tokens as computed; the load must go with
that step (it was emitted for new requests only, and the request attended whatever its new blocks held:
another request's KV; found by a connector probe)."""
from __future__ import annotations

import torch
import pytest

pytest.importorskip("vllm", reason="pip install --no-deps vllm==0.26.0 (see .ci/run) to run the vLLM tests")

from tests.integrations.vllm.test_connector import (  # noqa: E402
    NAMES, kv_cache_config, make_request, paged_caches, run_forward, schedule, vllm_config, write_config)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData  # noqa: E402

from tierkv.integrations.vllm.connector import TierKVConnector  # noqa: E402


def _blocks(ids):
    return KVCacheBlocks((tuple(KVCacheBlock(b) for b in ids),))


def test_a_resumed_request_gets_its_prefix_loaded(tmp_path):
    config = vllm_config(write_config(tmp_path, 1000, False))
    worker = TierKVConnector(config, KVConnectorRole.WORKER, kv_cache_config())
    caches = paged_caches()
    worker.register_kv_caches(caches)
    scheduler = TierKVConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config())
    try:
        prompt = torch.randint(0, 1000, (70,), generator=torch.Generator().manual_seed(0)).tolist()
        req = make_request("b", prompt)
        assert scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
        scheduler.update_state_after_alloc(req, _blocks(range(5)), 0)
        run_forward(worker, caches, scheduler.build_connector_meta(schedule(req, list(range(5)), 0)))
        worker.store.poll(wait=True)
        truth = {n: caches[n][0:4].clone() for n in NAMES}
        for n in NAMES:  # preempted: its blocks freed and written over by another request
            caches[n][:] = torch.full_like(caches[n], 7.0)
        req.num_computed_tokens = 0
        matched, _ = scheduler.get_num_new_matched_tokens(req, 0)
        assert matched == 64
        new_ids = list(range(10, 15))
        scheduler.update_state_after_alloc(req, _blocks(new_ids), matched)
        cached = CachedRequestData.make_empty()
        cached.req_ids, cached.resumed_req_ids = ["b"], {"b"}
        cached.num_computed_tokens, cached.new_block_ids = [matched], [(new_ids,)]
        out = schedule(req, [], 0)
        out.scheduled_new_reqs, out.scheduled_cached_reqs = [], cached
        out.num_scheduled_tokens, out.total_num_scheduled_tokens = {"b": 70 - matched}, 70 - matched
        meta = scheduler.build_connector_meta(out)
        assert len(meta.loads) == 1
        run_forward(worker, caches, meta)
        assert not worker.get_block_ids_with_load_errors()
        assert all(torch.equal(caches[n][10:14], truth[n]) for n in NAMES)
    finally:
        worker.shutdown()
        scheduler.shutdown()
