"""The vLLM configs shipped in configs/, sized as TieredLLM sizes them for Llama-3.1-8B's shape: they
load, fit their budget (vLLM's pool check, the summaries, the full decode graph's buffers) and keep
their far-block caches, so a user starting from them meets no config error."""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tierkv.config import load_config  # noqa: E402
from tests.integrations.vllm.test_hot_window import _checkpoint  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def test_the_fast_sparse_config_fits_its_two_gib_with_the_prefetch(tmp_path):
    """configs/vllm-128k-sparse-fast.yaml (the measured batch-1 settings): one 128k request of the 8B
    shape, compiled, async scheduling. vLLM's pool holds the window and two prefill chunks in
    flight; the caches keep two selections per layer with room for the margin."""
    from tierkv.sparse.row_caches import cache_rows
    from tierkv.sparse.prefetch_margin import check_margin
    from tierkv.integrations.vllm.engine_args import tiered_engine_args
    from tierkv.integrations.vllm.pool_sizing import hot_window_pool_need

    config = load_config(CONFIGS / "vllm-128k-sparse-fast.yaml", env={})
    sched = config.scheduler
    assert sched.sparse_full_graphs and sched.vllm_async_scheduling and sched.sparse_prefetch_margin == 16
    model = _checkpoint(tmp_path)
    args = tiered_engine_args(model, config, str(CONFIGS / "vllm-128k-sparse-fast.yaml"),
                              {"max_num_seqs": 1, "enforce_eager": False}, hot_window=True, max_model_len=131072,
                              gpu_memory_utilization=0.9, enable_prefix_caching=False)
    kwargs = args.kwargs
    pool = kwargs["kv_cache_memory_bytes"]
    assert pool >= hot_window_pool_need(model, config, kwargs)
    assert pool + args.summary_reserved_bytes + args.full_graph_reserved_bytes + sched.staging_bytes \
        <= config.cache.gpu_budget_bytes
    k = sched.sparse_token_budget // config.cache.block_tokens
    block_bytes = 2 * 8 * config.cache.block_tokens * 128 * 2
    rows, per_layer, warning = cache_rows(1, sched.sparse_cache_selections, sched.staging_bytes, 2 * k * block_bytes,
                                          32, k, block_bytes, 0)
    assert (rows, per_layer, warning) == (1, True, None)
    check_margin(sched.sparse_prefetch_margin, k, sched.sparse_cache_selections * k, per_layer)
