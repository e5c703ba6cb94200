"""A model that attends its own sliding window (Mistral-7B-v0.1's sliding_window 4096, Qwen2 with
use_sliding_window) gives vLLM a SlidingWindowSpec without tierkv's hot window: the connector runs its plain
path (no FarKV, no far staging, no hot-window checks), skips vLLM's null blocks in loads and saves, and tierkv's
hot window (attention backend CUSTOM) keeps its window; the hot window over a model's own window is refused."""
from __future__ import annotations

import os

import pytest

if os.environ.get("CI"):
    import vllm  # noqa: F401  CI installs vLLM (.ci/run): a missing vLLM fails here, never skips
else:
    pytest.importorskip("vllm", reason="pip install --no-deps vllm==0.26.0 (see .ci/run) to run the connector tests")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

from tierkv.config import ConfigError  # noqa: E402
from tierkv.integrations.vllm.connector import TierKVConnector  # noqa: E402

from tests.integrations.vllm.lifecycle_engine import BS as LBS, Engine, Shape  # noqa: E402
from tests.integrations.vllm.test_connector import BS, paged_caches, vllm_config  # noqa: E402
from tests.integrations.vllm.test_hot_window import hot_kv_cache_config, write_config  # noqa: E402

PROMPT = list(range(100, 124))   # 6 blocks of the lifecycle engine


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_a_models_own_window_without_the_hot_window_runs_the_plain_path(tmp_path, role):
    """window_tokens 0 is refused under the hot window only: a model's own window of 2 blocks takes no check,
    and the worker builds no far-path reader (FarKV, its staging) for it."""
    engine = vllm_config(write_config(tmp_path, window=0, staging_blocks=8))
    connector = TierKVConnector(engine, role, hot_kv_cache_config(2 * BS))
    try:
        assert connector.hot_window is None and connector.own_window == 2 * BS
        if role == KVConnectorRole.WORKER:
            connector.register_kv_caches(paged_caches())
            assert connector._far is None and connector.store.hot_window is None  # no far reader, no staging
            assert connector.prepare_staging(1 << 20) is None
    finally:
        connector.shutdown()


def test_the_hot_window_keeps_its_window(tmp_path):
    engine = vllm_config(write_config(tmp_path, window=2 * BS, staging_blocks=8), hot_window=True)
    connector = TierKVConnector(engine, KVConnectorRole.SCHEDULER, hot_kv_cache_config(2 * BS))
    try:
        assert connector.hot_window == 2 * BS and connector.own_window is None
    finally:
        connector.shutdown()


def test_the_hot_window_over_a_models_own_window_is_refused_naming_both(tmp_path):
    """Under the hot window vLLM's spec is the plugin's (cache.window_tokens) unless the model declared its own
    window: another window there is the model's, which the hot window's far part would attend past."""
    engine = vllm_config(write_config(tmp_path, window=2 * BS, staging_blocks=8), hot_window=True)
    with pytest.raises(ConfigError, match=r"sliding window of 64 tokens.*cache.window_tokens 32.*hot_window=False"):
        TierKVConnector(engine, KVConnectorRole.SCHEDULER, hot_kv_cache_config(4 * BS))


def test_check_own_window_points_at_the_plain_connector(tmp_path):
    import json

    from tierkv.integrations.vllm.engine_args import check_own_window

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32768,
        "sliding_window": 4096, "torch_dtype": "bfloat16"}))
    with pytest.raises(ValueError, match=r"sliding window of 4096 tokens.*hot_window=False.*its own window"):
        check_own_window(tmp_path)


def own_window_engine(tmp_path, **shape) -> Engine:
    return Engine(tmp_path, Shape(**{"cpu_blocks": 800, "layers": 2, "pool": 24, "window": 8, "max_seqs": 4,
                                     "batched": 16, "hot_window": False, **shape}))


def test_a_prefix_hit_loads_only_the_models_window_and_runs_plain(tmp_path, one_torch_thread):
    """B hits A's saved prompt in the tiers: vLLM gives the blocks before the model's window the null block, the
    connector loads the window's blocks only, and every block the request computes lands in the tiers."""
    engine = own_window_engine(tmp_path)
    try:
        assert engine.worker.hot_window is None and engine.sched.connector.hot_window is None
        engine.add("A", PROMPT, 1)
        engine.run_out()
        loads = []
        engine.before_forward = lambda e, meta: loads.extend(meta.loads)
        engine.add("B", PROMPT + list(range(200, 212)), 8)
        engine.run_out()
        assert loads and all(0 not in span.block_ids for span in loads)  # never vLLM's null block
        assert sum(len(span.block_ids) for span in loads) < len(PROMPT) // LBS  # the window's, not all 5 blocks
        assert engine.store.hot_window is None and not engine.problems, engine.problems
        assert engine.check_tiers() and not engine.problems, engine.problems
        assert not engine.leftovers()
    finally:
        engine.close()


def test_a_vllm_prefix_hit_past_the_window_saves_no_null_block(tmp_path, one_torch_thread):
    """vLLM's own prefix cache hits A's prompt while the tiers lost it: the blocks before the model's window are
    vLLM's null block in B's table, and the connector saves none of them (NaN in this pool) under A's hashes."""
    engine = own_window_engine(tmp_path, prefix_caching=True)
    try:
        engine.add("A", PROMPT, 1)
        engine.run_out()
        store = engine.store
        hashes = store.extend_hashes([], PROMPT, len(PROMPT) // LBS)
        store.chain.remove_many([k for layer in range(engine.shape.layers) for k in store.keys(hashes, layer)])
        saves = []
        engine.before_forward = lambda e, meta: saves.extend(meta.saves)
        engine.add("B", PROMPT + list(range(200, 212)), 4)
        engine.run_out()
        assert saves and all(0 not in span.block_ids for span in saves)
        assert engine.check_tiers() and not engine.problems, engine.problems
    finally:
        engine.close()

