"""`tierkv plan --backend vllm`: the GPU budget of a vLLM hot-window engine as the engine splits it
at start-up (`resize_plan.split_budget`, the sizes of `pool_sizing`), not the transformers engine's
layout. Under vLLM the budget holds everything: the staging ring, the sparse policy's key summaries
and the full decode graph's codes come out of it, and vLLM's pool takes the rest, shared by the
running requests (each holds its window of `cache.window_tokens` plus the prefill tokens in flight).

Primitives: `vllm_gpu_plan`, `vllm_streamed_blocks`, `vllm_tier_rows` (`tierkv.cli.plan` reaches them by
name). No vLLM import.
"""
from __future__ import annotations

from tierkv.integrations.vllm.batch_sizing import size_rows_for_batch
from tierkv.integrations.vllm.engine_args import default_enforce_eager
from tierkv.integrations.vllm.pool_sizing import (engine_dtype_bytes, full_graph_packed_bytes, hot_window_pool_need,
                                                  sparse_summary_bytes)
from tierkv.integrations.vllm.resize_plan import split_budget
from tierkv.units import format_bytes as fb


def vllm_gpu_plan(shape, context: int, config, max_num_seqs: int) -> dict:
    """The GPU part of `make_plan` for a vLLM engine of `max_num_seqs` requests of `context` tokens
    (max_model_len), compiled or eager and with the staging sized for the batch as TieredLLM starts it."""
    dtype_bytes = 4 if shape.kv_dtype == "float32" else 2
    dims = {"num_hidden_layers": shape.num_layers, "num_key_value_heads": shape.num_kv_heads,
            "head_dim": shape.head_dim, "max_position_embeddings": shape.max_context, "dtype_bytes": dtype_bytes,
            "sliding_window": shape.sliding_window}
    sched = config.scheduler
    # the engine's arguments as TieredLLM passes them (vLLM's dtype left to 'auto': the checkpoint's)
    engine = {"max_num_seqs": max_num_seqs, "max_model_len": context,
              "max_num_batched_tokens": sched.prefill_chunk_tokens, "async_scheduling": sched.vllm_async_scheduling,
              "enforce_eager": default_enforce_eager(config, hot_window=True)}
    config = size_rows_for_batch(dims, config, {"max_num_seqs": max_num_seqs})  # as TieredLLM sizes it
    sparse = sched.policy == "sparse"
    summaries = sparse_summary_bytes(dims, config, context, engine) if sparse else 0
    codes = full_graph_packed_bytes(dims, config, engine) if sparse else 0
    split = split_budget(config, config.cache.gpu_budget_bytes, summaries, codes)
    element = engine_dtype_bytes(engine)  # vLLM's KV element: 16 bits under its auto dtype, float32 models too
    block_bytes = shape.num_layers * 2 * shape.num_kv_heads * config.cache.block_tokens * shape.head_dim * element
    window_bytes = hot_window_pool_need(dims, config, engine)
    pool = max(0, split.pool_bytes)
    if shape.sliding_window:
        refusal = (f"the model's layers attend their own sliding window of {shape.sliding_window} tokens: vLLM keeps "
                   "only that window already, and the hot window's far part would add the blocks before it")
    elif split.pool_bytes <= 0:
        refusal = f"the budget must exceed {split.reserved_text()}: the rest is vLLM's pool"
    elif pool < window_bytes:
        refusal = ("the pool cannot hold one request's window and prefill tokens in flight: raise the budget, or "
                   "lower cache.window_tokens or scheduler.prefill_chunk_tokens")
    elif short := _ring_too_small(shape, config, split.staging_bytes, element, max_num_seqs, dims, engine):
        refusal = short
    elif max_num_seqs > sched.prefill_chunk_tokens:
        refusal = (f"max_num_seqs {max_num_seqs} is above scheduler.prefill_chunk_tokens ({sched.prefill_chunk_tokens}, "
                   "vLLM's max_num_batched_tokens): vLLM needs a token a step for each running request")
    elif shape.max_context and context > (getattr(shape, "scaled_context", None) or shape.max_context):
        refusal = (f"vLLM refuses a max_model_len past the model's max_position_embeddings ({shape.max_context}) "
                   "and its rope scaling unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1")
    else:
        refusal = None
    return {"backend": "vllm", "budget_bytes": split.budget_bytes, "staging_bytes": split.staging_bytes,
            "summary_bytes": summaries, "full_graph_bytes": codes, "pool_bytes": split.pool_bytes,
            "pool_blocks": pool // block_bytes, "pool_block_bytes": block_bytes, "max_num_seqs": max_num_seqs,
            "window_bytes_per_request": window_bytes,
            # the pool's null block counted once: each request past the first needs its window's blocks alone
            "windows_at_once": max(0, pool // block_bytes - 1) // max(1, window_bytes // block_bytes - 1),
            "fits": refusal is None, "refusal": refusal, "held_bytes": split.budget_bytes,
            "compiled": not engine["enforce_eager"],
            "resident_blocks_per_layer_at_decode": -(-context // config.cache.block_tokens) - _far_blocks(config, context)}


def _ring_too_small(shape, config, staging_bytes: int, element: int, max_num_seqs: int, dims: dict,
                    engine: dict) -> str | None:
    """Why the staging's main ring cannot be made at start (`far_staging.main_ring`: one block per region
    at least, in what the sparse policy's eager regions, far-block caches and codes leave of the staging,
    `far_staging.carve_staging`), or None. The sparse step graphs are taken to be usable (a GPU)."""
    import torch

    from tierkv.blocks import BlockLayout
    from tierkv.config import ConfigError
    from tierkv.integrations.vllm.far_staging import carve_staging
    from tierkv.integrations.vllm.pool_sizing import quantized_block_bytes
    from tierkv.storage.gpu import staging_region_blocks

    sched = config.scheduler
    layout = BlockLayout(shape.num_kv_heads, config.cache.block_tokens, shape.head_dim,
                         torch.float32 if element == 4 else torch.bfloat16)
    sparse_blocks = max(1, sched.sparse_token_budget // layout.block_tokens) if sched.policy == "sparse" else None
    graphed = max(1, min(max_num_seqs, sched.sparse_graph_rows)) if sched.sparse_cuda_graphs else 0
    shares = carve_staging(staging_bytes, layout.num_bytes, shape.num_layers, sparse_blocks, graphed,
                           sched.sparse_cache_selections, quantized_block_bytes(dims, config, engine))
    try:
        staging_region_blocks(layout, shares.ring_bytes, max(2, sched.lookahead_layers + 1))
    except ConfigError as exc:
        if shares.ring_bytes == staging_bytes:
            return f"{exc.key} {staging_bytes}: {exc.allowed}"
        return (f"{exc.key} {staging_bytes}: the main ring gets {shares.ring_bytes} bytes beside the eager sparse "
                f"regions ({shares.eager_bytes}), far-block caches ({shares.cache_bytes}) and codes "
                f"({shares.packed_bytes}); it {exc.allowed}")
    return None


def _far_blocks(config, context: int) -> int:
    """Blocks per layer before the window at decode after `context` tokens: what vLLM's pool does not hold."""
    T = config.cache.block_tokens
    return max(0, -(-context // T) - -(-config.cache.window_tokens // T))


def vllm_streamed_blocks(config, context: int) -> int:
    """Far blocks per layer one decode step reads over PCIe at most: every block before the window
    (exact), or the sparse selection of `scheduler.sparse_token_budget` tokens (before the far-block
    caches' hits)."""
    far = _far_blocks(config, context)
    if config.scheduler.policy == "sparse":
        return min(far, config.scheduler.sparse_token_budget // config.cache.block_tokens)
    return far


def vllm_tier_rows(plan: dict) -> list[str]:
    """The GPU lines of `format_plan` for a vLLM engine."""
    g = plan["gpu"]
    pool = (f"  vLLM's pool   {fb(g['pool_bytes']):>12}   {g['pool_blocks']} blocks of {plan['block_tokens']} tokens"
            f" (every layer, {fb(g['pool_block_bytes'])} each), shared by the running requests" if g["pool_bytes"] > 0
            else f"  vLLM's pool   {'none':>12}   the parts below take the whole budget and more")
    rows = [f"GPU under vLLM (the whole budget {fb(g['budget_bytes'])}, {'compiled' if g['compiled'] else 'eager'})",
            pool,
            f"  staging       {fb(g['staging_bytes']):>12}   ring the streamed blocks pass through"
            + (" (and the far-block caches)" if plan["policy"] == "sparse" else "")]
    if g["summary_bytes"]:
        rows.append(f"  key summaries {fb(g['summary_bytes']):>12}   max_num_seqs {g['max_num_seqs']} requests of"
                    f" {plan['context_tokens']} tokens")
    if g["full_graph_bytes"]:
        rows.append(f"  graph buffers {fb(g['full_graph_bytes']):>12}   the full decode graph's prefetch lists (and quantized"
                    " blocks over a quantized CPU tier)")
    verdict = f"the pool holds {g['windows_at_once']} at once" if g["fits"] else f"DOES NOT FIT: {g['refusal']}"
    rows.append(f"  one request's window and prefill in flight needs {fb(g['window_bytes_per_request'])}: {verdict}")
    if g["fits"] and g["windows_at_once"] < g["max_num_seqs"]:
        rows.append(f"  (max_num_seqs {g['max_num_seqs']}: past {g['windows_at_once']} such requests at once,"
                    " vLLM queues the rest)")
    return rows
