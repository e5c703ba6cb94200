"""vLLM hashes every prompt block of every request when a KV connector is configured (sha256 of pickled tokens,
5-6 ms of add_request at 100k tokens on an H100 host). tierkv's connector addresses blocks by its own hashes, so an
engine running it with vLLM's prefix cache off keeps no hasher; with the prefix cache on, or another connector,
vLLM's hashing stays as it is. Checked on vLLM's own EngineCore.__init__ (its executor stubbed)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

vllm = pytest.importorskip("vllm", reason="pip install --no-deps vllm==0.26.0 (see .ci/run) to run the vLLM tests")

from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, VllmConfig  # noqa: E402
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
def test_the_engine_core_keeps_a_hasher_only_where_it_is_read(tmp_path, connector, prefix_caching):
    hot_window.register()
    patched = engine_core.EngineCore.__init__
    assert getattr(patched, "_tierkv_hot_window", False) and patched.__wrapped__ is not patched
    config = engine_config(tmp_path, connector, prefix_caching)
    hasher = object()
    core = SimpleNamespace(request_block_hasher=hasher)  # what vLLM's __init__ sets with a connector configured
    hot_window.drop_unread_block_hasher(core, config)
    assert core.request_block_hasher is (hasher if hot_window.needs_vllm_block_hashes(config) else None)
    # a request made with no hasher carries no hashes; vLLM's Request needs none
    req = Request("r", list(range(100)), SamplingParams(max_tokens=1), None, block_hasher=core.request_block_hasher
                  if core.request_block_hasher is None else None)
    assert req.block_hashes == []
