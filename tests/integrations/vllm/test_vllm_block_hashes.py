"""vLLM hashes every prompt block of every request when a KV connector is configured (sha256 of pickled tokens,
5-6 ms of add_request at 100k tokens on an H100 host). tierkv's connector addresses blocks by its own hashes, so an
engine running it with vLLM's prefix cache off keeps no hasher; with the prefix cache on, or another connector,
vLLM's hashing stays as it is. Checked through vLLM's own EngineCore.preprocess_add_request and Scheduler."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

vllm = pytest.importorskip("vllm", reason="pip install --no-deps vllm==0.26.0 (see .ci/run) to run the vLLM tests")

from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, VllmConfig  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.engine import EngineCoreRequest  # noqa: E402
from vllm.v1.engine import core as engine_core  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402

from tierkv.integrations.vllm import hot_window, kv_transfer_config  # noqa: E402


def engine_config(tmp_path, connector: str | None, prefix_caching: bool) -> VllmConfig:
    (tmp_path / "t.yaml").write_text(json.dumps({"cache": {"block_tokens": 16}, "metrics": {"enabled": False},
                                                  "tiers": [{"kind": "cpu", "capacity_bytes": 1 << 20}]}))
    transfer = None
    if connector == "tierkv":
        transfer = KVTransferConfig(**kv_transfer_config(str(tmp_path / "t.yaml"), model_id="m"))
    elif connector is not None:
        transfer = KVTransferConfig(kv_connector=connector, kv_role="kv_both")
    return VllmConfig(kv_transfer_config=transfer, device_config=DeviceConfig(device="cpu"),
                      cache_config=CacheConfig(block_size=16, enable_prefix_caching=prefix_caching))


@pytest.mark.parametrize("connector, prefix_caching, needed", [
    ("tierkv", False, False), ("tierkv", True, True), ("OffloadingConnector", False, True), (None, True, True),
])
def test_needs_vllm_block_hashes(tmp_path, connector, prefix_caching, needed):
    assert hot_window.needs_vllm_block_hashes(engine_config(tmp_path, connector, prefix_caching)) is needed


@pytest.mark.parametrize("connector, prefix_caching", [("tierkv", False), ("tierkv", True), ("OffloadingConnector", False)])
def test_an_engine_core_hashes_only_where_the_hashes_are_read(tmp_path, connector, prefix_caching):
    """vLLM's own EngineCore.preprocess_add_request (patched by the plugin) on a core made before the plugin was
    loaded (vLLM loads plugins inside the first EngineCore.__init__ of an engine process): the first request drops
    the unread hasher, and the request carries no hashes; elsewhere they are vLLM's as before."""
    hot_window.register()
    assert getattr(engine_core.EngineCore.preprocess_add_request, "_tierkv_hot_window", False)
    config = engine_config(tmp_path, connector, prefix_caching)
    init_none_hash(sha256)
    hasher = get_request_block_hasher(16, sha256)
    core = SimpleNamespace(request_block_hasher=hasher, vllm_config=config, mm_receiver_cache=None)
    request = EngineCoreRequest(request_id="r", prompt_token_ids=list(range(100)), mm_features=None,
                                sampling_params=SamplingParams(max_tokens=1), pooling_params=None, arrival_time=0.0,
                                lora_request=None, cache_salt=None, data_parallel_rank=None)
    for _ in range(2):
        req, _wave = engine_core.EngineCore.preprocess_add_request(core, request)
        dropped = connector == "tierkv" and not prefix_caching
        assert core.request_block_hasher is (None if dropped else hasher)
        assert len(req.block_hashes) == (0 if dropped else 100 // 16)


def test_requests_without_vllm_hashes_get_tierkv_prefix_hits_through_vllms_scheduler(tmp_path):
    """vLLM's own Scheduler, prefix caching off, tierkv's connector configured, requests made with no hasher (as
    the engine core makes them once the hasher is dropped; `Request.block_hashes` stays empty): a second request
    with the first one's prompt is served from the tiers and both finish."""
    from tests.integrations.vllm.test_loaded_window_pins import Engine

    engine = Engine(tmp_path, cpu_keys=256)
    prompt = list(range(100, 125))
    for req_id in ("A", "B"):
        engine.sched.add_request(Request(req_id, prompt, SamplingParams(max_tokens=3, ignore_eos=True), None,
                                         block_hasher=None))
        engine.run_out()
        assert engine.sched.requests == {}
    assert engine.worker.store.counts["lookup_hit_blocks"] > 0 and engine.worker.store.counts["blocks_loaded"] > 0
