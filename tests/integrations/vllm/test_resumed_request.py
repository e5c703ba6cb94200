"""A preempted request resumed with a prefix hit in the tiers: vLLM 0.26 schedules it among the cached
requests (resumed_req_ids), not the new ones, and counts the hit's tokens as computed; the load must go with
that step (it was emitted for new requests only, and the request attended whatever its new blocks held:
another request's KV; found by a connector probe)."""
from __future__ import annotations

import torch
import pytest

pytest.importorskip("vllm", reason="pip install --no-deps vllm==0.26.0 (see .ci/run) to run the vLLM tests")

from tests.integrations.vllm.test_connector import NAMES, engine, make_request, run_forward, schedule  # noqa: E402,F401
from tests.integrations.vllm.test_connector_failures import blocks_of, saved_prompt  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData  # noqa: E402


def test_a_resumed_request_gets_its_prefix_loaded(engine):
    scheduler, worker, caches = engine(disk=False)
    prompt = saved_prompt(scheduler, worker, caches, seed=0)  # its 4 full blocks in pool blocks 0..3 and the tiers
    truth = {n: caches[n][0:4].clone() for n in NAMES}
    for n in NAMES:  # the pool written over by other requests meanwhile
        caches[n][:] = torch.full_like(caches[n], 7.0)
    req = make_request("b", prompt)  # preempted, back from the waiting queue with nothing computed
    matched, _ = scheduler.get_num_new_matched_tokens(req, 0)
    assert matched == 64
    new_ids = list(range(10, 15))
    scheduler.update_state_after_alloc(req, blocks_of(new_ids), matched)
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
