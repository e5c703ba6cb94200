"""A window block lost between the lookup and the load of a repeated prefix under the hot window: the worker
reports it, vLLM's recompute policy moves the request's tokens back to that block, and the blocks before the
loaded window are vLLM's null block (never allocated). The recompute step's far part reads every block up to the
first one vLLM holds (`TierKVMetadata.far_floors`), equal to dense attention over the saved KV; its near part never
reads the null block (it read it as the request's KV for those positions; found by a connector probe)."""
from __future__ import annotations

import pickle
import random
import weakref
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="pip install --no-deps vllm==0.26.0 (see .ci/run) to run the vLLM tests")

from tests.integrations.vllm.test_connector import BS, LAYERS, NAMES, make_request, schedule  # noqa: E402
from tests.integrations.vllm.test_hot_window import HQ, D, _Runner, dense, hot_connectors, hot_kv_cache_config  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402

from tierkv.integrations.vllm import hot_window  # noqa: E402
from tierkv.integrations.vllm.store import BlockSpan  # noqa: E402


@pytest.mark.parametrize("lost", [0, 2])  # the window's first block, or one inside it
def test_a_recompute_after_a_lost_window_block_reads_its_far_part_from_the_tiers(tmp_path, lost):
    window = 4 * BS
    worker, scheduler, caches = hot_connectors(tmp_path, window=window, staging_blocks=5)
    store = worker.store
    rng = random.Random(lost)
    prompt = [rng.randrange(1000) for _ in range(10 * BS + 3)]
    hashes = store.extend_hashes([], prompt, 10)
    try:
        for name in NAMES:  # an earlier request computed the prompt's 10 full blocks
            store.save_layer(store.layer_index[name], caches[name], [BlockSpan("earlier", list(range(40, 50)), hashes)])
        store.poll(wait=True)
        store.saves.release_pins([k for layer in range(LAYERS) for k in store.keys(hashes, layer)])
        original = {n: store.paged.read(caches[n], torch.tensor(list(range(40, 50)))) for n in NAMES}
        req = make_request("again", prompt)
        matched, _ = scheduler.get_num_new_matched_tokens(req, 0)
        manager = KVCacheManager(hot_kv_cache_config(window), max_model_len=4096, scheduler_block_size=BS,
                                 hash_block_size=BS, max_in_flight_tokens=256, enable_caching=False)
        manager.allocate_slots(req, len(prompt) - matched, num_external_computed_tokens=matched)
        row = manager.get_blocks(req.request_id)
        scheduler.update_state_after_alloc(req, row, matched)
        meta = scheduler.build_connector_meta(schedule(req, row.get_block_ids()[0], matched))
        (load,) = meta.loads
        store.chain.remove_many(store.keys(load.hashes[lost:lost + 1], 1))  # gone between lookup and load

        def forward(meta):
            runner = _Runner(["again"])
            hot_window._STATE["runner"] = weakref.ref(runner)
            worker.bind_connector_metadata(pickle.loads(pickle.dumps(meta)))
            worker.start_load_kv(None)
            step = hot_window.current_step()
            outputs = {}
            for name in NAMES:
                worker.wait_for_layer_load(name)
                q = torch.randn(step.rows[0].q_end, HQ, D, generator=torch.Generator().manual_seed(7))
                outputs[name] = (q, step.far.attend(store.layer_index[name], q, 0.3)) if step.rows[0].num_far_blocks else None
                worker.save_kv_layer(name, caches[name], None)
            worker.wait_for_save()
            worker.clear_connector_metadata()
            return list(step.rows), outputs

        req.num_computed_tokens = matched
        forward(meta)
        req.num_computed_tokens = len(prompt)
        errors = worker.get_block_ids_with_load_errors()
        assert errors == {load.block_ids[lost]}
        fake = SimpleNamespace(kv_cache_manager=manager, block_size=BS)  # vLLM's own recompute path
        Scheduler._update_requests_with_invalid_blocks(fake, [req], errors, {"again": len(prompt) - matched})
        assert req.num_computed_tokens < matched
        num_new = len(prompt) - req.num_computed_tokens
        new_blocks = manager.allocate_slots(req, num_new)
        table = manager.get_blocks(req.request_id).get_block_ids()[0]
        cached = CachedRequestData.make_empty()
        cached.req_ids, cached.num_computed_tokens = ["again"], [req.num_computed_tokens]
        cached.new_block_ids = [new_blocks.get_block_ids(allow_none=True)]
        out = schedule(req, [], 0)
        out.scheduled_new_reqs, out.scheduled_cached_reqs = [], cached
        out.num_scheduled_tokens, out.total_num_scheduled_tokens = {"again": num_new}, num_new
        rows, outputs = forward(scheduler.build_connector_meta(out))
        far = rows[0].num_far_blocks
        assert 0 not in table[far:]  # the near part reads only blocks vLLM holds
        for name in NAMES:
            q, (out_far, lse_far) = outputs[name]
            want_out, want_lse = dense(q, original[name][:far], 0.3)
            torch.testing.assert_close(out_far.double(), want_out, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(lse_far.double(), want_lse, rtol=1e-5, atol=1e-5)
    finally:
        hot_window._STATE["runner"] = None
        worker.shutdown()
        scheduler.shutdown()
