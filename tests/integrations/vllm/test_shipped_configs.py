"""The vLLM configs shipped in configs/, sized as TieredLLM sizes them for Llama-3.1-8B's shape: they
load, fit their budget (vLLM's pool check, the summaries, the full decode graph's buffers) and keep
their far-block caches, for one request and, sized by `vllm_rows_from_batch`, for a batch, so a user
starting from them meets no config error and no copy-every-block warning."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tierkv.config import ConfigError, load_config  # noqa: E402
from tierkv.integrations.vllm.batch_sizing import graphed_staging_need, size_rows_for_batch  # noqa: E402
from tierkv.integrations.vllm.engine_args import tiered_engine_args  # noqa: E402
from tierkv.integrations.vllm.pool_sizing import hot_window_pool_need  # noqa: E402
from tierkv.sparse.prefetch_margin import check_margin  # noqa: E402
from tierkv.sparse.row_caches import cache_rows  # noqa: E402
from tests.integrations.vllm.test_hot_window import _checkpoint  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
SPARSE = CONFIGS / "vllm-128k-sparse.yaml"
BLOCK_BYTES = 2 * 8 * 64 * 128 * 2  # one 64-token block of one layer, 8 KV heads of 128, bf16


def _fits(model, config, kwargs_in: dict, rows: int, codes_per_row: int = 0):
    """Start TieredLLM's sizing as the front end does; check the budget's parts and every row's caches."""
    config = size_rows_for_batch(model, config, kwargs_in)
    sched = config.scheduler
    args = tiered_engine_args(model, config, str(SPARSE), dict(kwargs_in), hot_window=True, max_model_len=131072,
                              gpu_memory_utilization=0.9, enable_prefix_caching=False)
    kwargs = args.kwargs
    pool = kwargs["kv_cache_memory_bytes"]
    assert pool >= hot_window_pool_need(model, config, kwargs)
    assert pool + args.summary_reserved_bytes + args.full_graph_reserved_bytes + sched.staging_bytes \
        <= config.cache.gpu_budget_bytes
    k = sched.sparse_token_budget // config.cache.block_tokens
    got = cache_rows(min(rows, sched.sparse_graph_rows), sched.sparse_cache_selections, sched.staging_bytes,
                     2 * k * BLOCK_BYTES, 32, k, BLOCK_BYTES, codes_per_row)
    assert got == (rows, True, None)
    check_margin(sched.sparse_prefetch_margin, k, sched.sparse_cache_selections * k, True)
    return config, kwargs


def test_the_sparse_config_runs_one_request_compiled_in_its_budget_with_the_prefetch(tmp_path):
    """configs/vllm-128k-sparse.yaml: one 128k request of the 8B shape. TieredLLM starts vLLM compiled
    (the full decode graph) without being told; vLLM's pool holds the window and two 8192-token prefill
    chunks in flight (async scheduling); the caches keep two selections per layer with room for the margin,
    and the staging as written already suffices (the sizing changes nothing)."""
    config = load_config(SPARSE, env={})
    sched = config.scheduler
    assert sched.sparse_full_graphs and sched.vllm_async_scheduling and sched.vllm_rows_from_batch
    assert sched.sparse_cache_selections == 2 and sched.sparse_prefetch_margin == 8
    model = _checkpoint(tmp_path)
    assert size_rows_for_batch(model, config, {"max_num_seqs": 1}) is config
    _, kwargs = _fits(model, config, {"max_num_seqs": 1}, rows=1)
    assert kwargs["enforce_eager"] is False and kwargs["async_scheduling"] is True
    assert kwargs["compilation_config"]["cudagraph_capture_sizes"][-1] >= 1


@pytest.mark.parametrize("rows,budget_gib,dtype", [(4, 6.5, "auto"), (10, 60, "float8_e4m3fn"), (3, 8, "int8")])
def test_the_sparse_config_sizes_its_rows_and_staging_for_a_batch(tmp_path, rows, budget_gib, dtype):
    """The same file with max_num_seqs=N and a larger budget (what its comment says to change: about 1 GiB
    more per request past the first): the
    graphs serve N rows and every row keeps two selections per layer (a quantized tier's code
    buffers included), where the file as written would copy every block each step."""
    raw = load_config(SPARSE, env={})
    cpu = dataclasses.replace(raw.tiers[0], storage_dtype=dtype)
    config = dataclasses.replace(raw, cache=dataclasses.replace(raw.cache, gpu_budget_bytes=int(budget_gib * (1 << 30))),
                                 tiers=[cpu, *raw.tiers[1:]])
    k = config.scheduler.sparse_token_budget // config.cache.block_tokens
    codes = k * (BLOCK_BYTES // 2 + 2 * 8 * 4) if dtype != "auto" else 0
    as_written = cache_rows(rows, 2, config.scheduler.staging_bytes, 2 * k * BLOCK_BYTES, 32, k, BLOCK_BYTES, codes)
    assert as_written[1] is False and "raise it to" in as_written[2]
    model = _checkpoint(tmp_path)
    sized, kwargs = _fits(model, config, {"max_num_seqs": rows}, rows=rows, codes_per_row=codes)
    assert sized.scheduler.sparse_graph_rows >= rows
    assert sized.scheduler.staging_bytes == graphed_staging_need(model, config, rows, {"max_num_seqs": rows})
    assert kwargs["max_num_seqs"] == rows and kwargs["enforce_eager"] is False
    # the sizing is a fixed point: sizing the sized config again changes nothing
    assert size_rows_for_batch(model, sized, {"max_num_seqs": rows}) is sized


def test_a_batch_too_large_for_the_budget_is_refused_before_vllm_starts(tmp_path):
    """Ten requests in the file's 3.5 GiB: the sized staging and summaries leave vLLM's pool nothing;
    the error names the budget and the parts that took it."""
    config = load_config(SPARSE, env={})
    model = _checkpoint(tmp_path)
    sized = size_rows_for_batch(model, config, {"max_num_seqs": 10})
    with pytest.raises(ConfigError, match="cache.gpu_budget_bytes.*scheduler.staging_bytes"):
        tiered_engine_args(model, sized, str(SPARSE), {"max_num_seqs": 10}, hot_window=True, max_model_len=131072,
                           gpu_memory_utilization=0.9, enable_prefix_caching=False)


def test_batch_sizing_is_off_unless_asked_and_needs_max_num_seqs(tmp_path):
    """Without vllm_rows_from_batch (or outside the sparse graphs) the config is used as written;
    with it, max_num_seqs must be a positive int; enforce_eager given by the caller wins."""
    model = _checkpoint(tmp_path)
    config = load_config(SPARSE, env={})
    off = dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, vllm_rows_from_batch=False))
    assert size_rows_for_batch(model, off, {"max_num_seqs": 10}) is off
    exact = load_config(CONFIGS / "vllm-128k.yaml", env={})
    assert size_rows_for_batch(model, exact, {"max_num_seqs": 10}) is exact
    for bad in (None, 0, True, "4"):
        with pytest.raises(ValueError, match="max_num_seqs: got"):
            size_rows_for_batch(model, config, {"max_num_seqs": bad})
    args = tiered_engine_args(model, config, str(SPARSE), {"max_num_seqs": 1, "enforce_eager": True}, hot_window=True,
                              max_model_len=131072, gpu_memory_utilization=0.9, enable_prefix_caching=False)
    assert args.kwargs["enforce_eager"] is True and "compilation_config" not in args.kwargs
    args = tiered_engine_args(model, exact, str(CONFIGS / "vllm-128k.yaml"), {}, hot_window=True,
                              max_model_len=131072, gpu_memory_utilization=0.9, enable_prefix_caching=False)
    assert args.kwargs["enforce_eager"] is True


def test_tieredllm_hands_the_connector_the_sized_config_and_removes_it_at_close(tmp_path, monkeypatch):
    """TieredLLM(path, backend="vllm", max_num_seqs=4): the connector's config file is a written copy
    with the sized staging and rows (the user's file untouched), vLLM's pool is the budget less that
    staging and the summaries, and close removes the copy."""
    import os

    from tests.integrations.vllm.test_hot_window import fake_vllm_llm
    from tierkv.integrations.vllm.llm import VllmTieredLLM

    given = fake_vllm_llm(monkeypatch)
    monkeypatch.setattr("tierkv.integrations.vllm.llm.check_full_graph_rows", lambda rows, vllm_config: None)
    monkeypatch.setenv("TIERKV_CACHE__GPU_BUDGET_BYTES", "6.5GiB")
    monkeypatch.setenv("HOME", str(tmp_path))  # the disk tier and the secret file of the shipped config
    model = _checkpoint(tmp_path)
    llm = VllmTieredLLM(model, SPARSE, max_model_len=131072, max_num_seqs=4)
    try:
        written = given["kv_transfer_config"]["kv_connector_extra_config"]["config_file"]
        assert written != str(SPARSE) and os.path.isfile(written)
        loaded = load_config(written, env={})
        need = graphed_staging_need(model, llm.config, 4, {"max_num_seqs": 4})
        assert loaded.scheduler.staging_bytes == llm.config.scheduler.staging_bytes == need
        assert loaded.scheduler.sparse_graph_rows >= 4 and given["enforce_eager"] is False
        assert given["kv_cache_memory_bytes"] == (13 << 29) - need - llm.summary_reserved_bytes \
            - llm.full_graph_reserved_bytes
    finally:
        llm.close()
    assert not os.path.exists(written) and SPARSE.is_file()
