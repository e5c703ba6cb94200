"""`stats()` reads and never counts: calling it again gives the same figures and leaves the transfer
engine's byte counter alone. The far-block caches' copies (counted on the device, inside CUDA graphs)
are added to the reported H2D bytes at read time, not written into the engine's counter."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from tierkv.config import load_config
from tierkv.integrations.vllm.far_rows import FarKV
from tierkv.integrations.vllm.store import VllmKVStore
from tierkv.engine.runtime import KVRuntime


def cached_runtime() -> KVRuntime:
    """One layer, predictor `cache` with a prefetch margin, 64 blocks of 4 tokens decoded twice."""
    kv_heads, dim, tokens = 2, 16, 256
    block_bytes = 2 * kv_heads * 4 * dim * 4
    config = load_config({
        "cache": {"block_tokens": 4, "gpu_budget_bytes": 8 * block_bytes, "sink_tokens": 4, "window_tokens": 16},
        "tiers": [{"kind": "cpu", "capacity_bytes": 80 * block_bytes}],
        "scheduler": {"cpu_far_reads": "staged", "policy": "sparse", "sparse_token_budget": 16, "lookahead_layers": 1,
                      "predictor": "cache",
                      "staging_bytes": 8 * block_bytes, "sparse_cache_selections": 2, "sparse_prefetch_margin": 4},
    }, env={})
    runtime = KVRuntime(config, num_layers=1, num_kv_heads=kv_heads, head_dim=dim, dtype=torch.float32,
                        device="cpu", model_id="stats-read-only")
    seq = runtime.new_sequence()
    seq.append(0, torch.randn(tokens, kv_heads, dim), torch.randn(tokens, kv_heads, dim))
    for _ in range(2):
        seq.append(0, torch.randn(1, kv_heads, dim), torch.randn(1, kv_heads, dim))
        seq.attend(0, torch.randn(1, 8, dim), dim**-0.5)
    seq.finish()
    return runtime


def test_the_runtimes_stats_read_only_and_report_the_caches_copies():
    runtime = cached_runtime()
    try:
        engine_h2d = runtime.engine.num_bytes_moved["h2d"]
        first, second = runtime.stats(), runtime.stats()
        assert runtime.engine.num_bytes_moved["h2d"] == engine_h2d  # stats() wrote nothing
        copied = first["scheduler"]["far_cache_copied_bytes"]
        assert copied > 0
        assert first["transfer"]["h2d_bytes"] == second["transfer"]["h2d_bytes"] == engine_h2d + copied
    finally:
        runtime.close()


def test_the_far_rows_cache_stats_read_only():
    far = object.__new__(FarKV)
    engine = SimpleNamespace(num_bytes_moved={"h2d": 100, "d2h": 0})
    far.row_caches = SimpleNamespace(stats=lambda: {"cache_hits": 5, "cache_misses": 3, "cache_stalled_rows": 1,
                                                    "cache_sets": 1, "cache_bytes": 64})
    far.store = SimpleNamespace(cpu=SimpleNamespace(slot_bytes=10), io=SimpleNamespace(engine=engine))
    assert far.cache_stats(2)["cache_copied_bytes"] == far.cache_stats(2)["cache_copied_bytes"] == (3 + 2) * 10
    assert engine.num_bytes_moved == {"h2d": 100, "d2h": 0}


def test_the_vllm_stores_bytes_moved_add_the_caches_copies_at_read_time():
    store = object.__new__(VllmKVStore)
    store.counts, store.step_connector_ms, store.save_step_ms, store.chain, store.lookup_only = {}, [], [], None, False
    store.identity = SimpleNamespace(stats=lambda: {})
    store.fingerprint = "f"
    store.engine = SimpleNamespace(num_bytes_moved={"h2d": 100, "d2h": 7})
    store.hot_window = SimpleNamespace(stats=lambda: {"cache_copied_bytes": 50})
    store.loads = SimpleNamespace(ring_bytes=0)
    assert store.stats()["bytes_moved"] == store.stats()["bytes_moved"] == {"h2d": 150, "d2h": 7}
    assert store.engine.num_bytes_moved == {"h2d": 100, "d2h": 7}
