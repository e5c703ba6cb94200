"""The sparse graphs' rows sized by the engine's batch (`scheduler.vllm_rows_from_batch`): before vLLM
starts, TieredLLM raises `scheduler.sparse_graph_rows` to `max_num_seqs` and `scheduler.staging_bytes` to
what every row's far-block caches need, so one shipped config serves one request or a batch.

Primitives: `size_rows_for_batch`, `graphed_staging_need`. No vLLM import; the model's shape comes from
the checkpoint's config.json (`pool_sizing.checkpoint_shape`).

    staging need = far-block caches of max_num_seqs rows (`row_caches.staging_for_caches`: each row keeps
                   sparse_cache_selections selections per layer, with a quantized tier's code buffers,
                   within three quarters of the staging beside the eager regions)
                 + STREAM_RESERVE for the streamed prefill chunks

The same arithmetic `far_staging.split_staging` carves the staging with at start-up, so a staging of this
size gives every row its caches; the sizes leave `cache.gpu_budget_bytes` as the user wrote it, and
`check_hot_window_pool` still refuses a budget whose rest cannot hold vLLM's pool.
"""
from __future__ import annotations

import dataclasses

from tierkv.config import TierKVConfig
from tierkv.integrations.vllm.pool_sizing import (checkpoint_shape, engine_dtype_bytes, quantized_block_bytes,
                                                  rank_kv_heads)
from tierkv.sparse.row_caches import staging_for_caches

STREAM_RESERVE = 64 << 20  # the main ring's regions for streamed chunks beside the caches (as measured on the GPU)


def graphed_staging_need(model_dir, config: TierKVConfig, rows: int, engine_kwargs: dict) -> int:
    """scheduler.staging_bytes in which `rows` graphed rows each keep far-block caches of
    `scheduler.sparse_cache_selections` selections per layer (at least one), plus STREAM_RESERVE."""
    shape = checkpoint_shape(model_dir)
    scheduler, tokens = config.scheduler, config.cache.block_tokens
    kv_heads = rank_kv_heads(shape, engine_kwargs)
    block_bytes = 2 * kv_heads * tokens * shape["head_dim"] * engine_dtype_bytes(engine_kwargs)
    k = max(1, scheduler.sparse_token_budget // tokens)
    codes = k * quantized_block_bytes(shape, config, engine_kwargs)  # a quantized tier's code buffers (0: none)
    eager = 2 * k * block_bytes  # the eager sparse fetches' two regions
    needed = staging_for_caches(rows, max(1, scheduler.sparse_cache_selections), eager, shape["num_hidden_layers"], k,
                                block_bytes, codes)
    return needed + STREAM_RESERVE


def size_rows_for_batch(model_dir, config: TierKVConfig, engine_kwargs: dict) -> TierKVConfig:
    """`config` with the graphed rows sized for the engine's `max_num_seqs` under
    `scheduler.vllm_rows_from_batch` (sparse policy with its CUDA graphs); otherwise `config` itself.
    Sizes only rise: a config already large enough comes back unchanged."""
    scheduler = config.scheduler
    if not (scheduler.vllm_rows_from_batch and scheduler.policy == "sparse" and scheduler.sparse_cuda_graphs):
        return config
    rows = engine_kwargs.get("max_num_seqs")
    if not isinstance(rows, int) or isinstance(rows, bool) or rows < 1:
        raise ValueError(f"max_num_seqs: got {rows!r}; scheduler.vllm_rows_from_batch sizes the sparse graphs' rows "
                         "and their far-block caches by it: pass a positive max_num_seqs")
    staging = max(scheduler.staging_bytes, graphed_staging_need(model_dir, config, rows, engine_kwargs))
    graph_rows = max(scheduler.sparse_graph_rows, rows)
    if (staging, graph_rows) == (scheduler.staging_bytes, scheduler.sparse_graph_rows):
        return config
    sized = dataclasses.replace(scheduler, staging_bytes=staging, sparse_graph_rows=graph_rows)
    return dataclasses.replace(config, scheduler=sized)
