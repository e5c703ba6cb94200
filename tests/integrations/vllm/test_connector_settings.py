"""What the vLLM connector does with its config's settings: `cache.window_tokens: 0` refused by name where the
engine runs the hot window (the connector and the plugin's sliding-window spec) and run where it does not (a plain
pool never reads the window); settings vLLM never reads named in one warning."""
from __future__ import annotations

import os

import pytest

if os.environ.get("CI"):
    import vllm  # noqa: F401  CI installs vLLM (.ci/run): a missing vLLM fails here, never skips
else:
    pytest.importorskip("vllm", reason="pip install --no-deps vllm==0.26.0 (see .ci/run) to run the vLLM tests")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

from tierkv.config import ConfigError  # noqa: E402
from tierkv.integrations.vllm import hot_window  # noqa: E402
from tierkv.integrations.vllm.connector import TierKVConnector  # noqa: E402

from tests.integrations.vllm.test_connector import BS, kv_cache_config, vllm_config  # noqa: E402
from tests.integrations.vllm.test_hot_window import hot_kv_cache_config, write_config  # noqa: E402

REFUSED = r"cache\.window_tokens'?: got 0; under vLLM it must be at least 1"


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_a_connector_without_the_hot_window_runs_a_window_of_0_tokens(tmp_path, role):
    connector = TierKVConnector(vllm_config(write_config(tmp_path, window=0, staging_blocks=8)), role,
                                kv_cache_config())
    try:
        assert connector.hot_window is None and connector.config.cache.window_tokens == 0
    finally:
        connector.shutdown()


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_a_connector_under_the_hot_window_refuses_a_window_of_0_tokens_naming_the_key(tmp_path, role):
    engine = vllm_config(write_config(tmp_path, window=0, staging_blocks=8), hot_window=True)
    with pytest.raises(ConfigError, match=REFUSED) as refused:
        TierKVConnector(engine, role, hot_kv_cache_config(2 * BS))
    assert refused.value.key == "cache.window_tokens" and refused.value.value == 0


def test_the_hot_window_spec_refuses_a_window_of_0_tokens_and_gives_others(tmp_path):
    with pytest.raises(ConfigError, match=REFUSED):
        hot_window.hot_window_tokens(vllm_config(write_config(tmp_path, window=0, staging_blocks=8)))
    other = tmp_path / "other"
    other.mkdir()
    assert hot_window.hot_window_tokens(vllm_config(write_config(other, window=2 * BS, staging_blocks=8))) == 2 * BS


def test_a_connector_names_the_settings_vllm_does_not_read_once(tmp_path, caplog):
    """Settings only the transformers engine reads (a prefetch predictor), and the sparse graphs' settings under
    the exact policy, are logged by the scheduler connector (once per engine); the shipped vLLM configs log none."""
    import logging

    from tierkv.config import load_config
    from tierkv.configs import resolve_config_path
    from tierkv.integrations.vllm.config import unused_under_vllm

    engine = vllm_config(write_config(tmp_path, window=2 * BS, staging_blocks=8,
                                      scheduler_lines=("predictor: query", "sparse_full_graphs: true")),
                         hot_window=True)
    with caplog.at_level(logging.WARNING, logger="tierkv.integrations.vllm.connector"):
        worker = TierKVConnector(engine, KVConnectorRole.WORKER, hot_kv_cache_config(2 * BS))
        scheduler = TierKVConnector(engine, KVConnectorRole.SCHEDULER, hot_kv_cache_config(2 * BS))
    worker.shutdown()
    scheduler.shutdown()
    said = [r.getMessage() for r in caplog.records if "does not read" in r.getMessage()]
    assert len(said) == 1, said
    assert "scheduler.predictor: 'query'" in said[0] and "scheduler.sparse_full_graphs: True" in said[0]
    for name in ("vllm-128k", "vllm-128k-sparse"):
        assert unused_under_vllm(load_config(resolve_config_path(name), env={})) == []
    sparse = load_config(resolve_config_path("vllm-128k-sparse"), env={})
    assert "scheduler.policy: 'sparse'" in "; ".join(unused_under_vllm(sparse, hot_window=False))
    shaped = load_config({"model": {"num_layers": 99, "num_kv_heads": 7, "kv_dtype": "float16"},
                          "cache": {"sink_tokens": 4096}}, env={})
    said = "; ".join(unused_under_vllm(shaped))
    for part in ("model.num_layers: 99", "model.num_kv_heads: 7", "model.kv_dtype: 'float16'", "cache.sink_tokens: 4096"):
        assert part in said, said
    assert "model.head_dim" not in said and "model.name" not in said  # left at the default / read (block addresses)


@pytest.mark.parametrize("kv_role", ["kv_producer", "kv_consumer"])
def test_a_producer_or_consumer_role_is_refused_naming_it_not_run_as_kv_both(tmp_path, kv_role):
    """vLLM's scheduler calls the connector's loads and saves whatever kv_role says: tierkv's connector would
    run a producer or a consumer as kv_both without a word, so either is refused by name."""
    engine = vllm_config(write_config(tmp_path, window=32, staging_blocks=8))
    engine.kv_transfer_config.kv_role = kv_role
    with pytest.raises(ConfigError, match=rf"kv_role'?: got '?{kv_role}'?.*kv_both") as refused:
        TierKVConnector(engine, KVConnectorRole.SCHEDULER, kv_cache_config())
    assert refused.value.key == "kv_transfer_config.kv_role"
    engine.kv_transfer_config.kv_role = "kv_both"
    TierKVConnector(engine, KVConnectorRole.SCHEDULER, kv_cache_config()).shutdown()
