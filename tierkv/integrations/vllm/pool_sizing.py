"""How much of the GPU budget each part of a vLLM hot-window engine takes, worked out before the
engine exists from the checkpoint's config.json and the engine's arguments: vLLM's pool need (its
start-up check), the sparse policy's key summaries, and the full decode graph's codes and scales.

Primitives: `checkpoint_shape`, `hot_window_pool_need`, `check_hot_window_pool`, `sparse_summary_bytes`,
`sparse_max_model_len`, `full_decode_capture_sizes`, `full_graph_rows`, `check_full_graph_rows`,
`full_graph_packed_bytes`, `quantized_block_bytes`, `rank_kv_heads`, `engine_dtype_bytes`, `check_admission`. No vLLM import (the connector's
`graph_rows` is read after the engine starts).
"""
from __future__ import annotations

from tierkv import model_shape
from tierkv.config import ConfigError, TierKVConfig
from tierkv.units import format_bytes
from tierkv.integrations.vllm.engine_config import graph_rows
from tierkv.integrations.vllm.full_graph_rows import full_graphs_configured
from tierkv.integrations.vllm.config import check_hot_window_config
from tierkv.integrations.vllm.resize_plan import admission_floor_blocks, window_blocks
from tierkv.sparse.request_summaries import summary_bytes_per_request


def rank_kv_heads(shape: dict, engine_kwargs: dict) -> int:
    """KV heads of the checkpoint `shape` on each GPU: split over the engine's tensor_parallel_size."""
    return max(1, shape["num_key_value_heads"] // int(engine_kwargs.get("tensor_parallel_size", 1) or 1))


def engine_dtype_bytes(engine_kwargs: dict) -> int:
    """Bytes per element of the engine's dtype: 4 for float32, else 2, 'auto' (or none given) included:
    vLLM's auto dtype keeps a 16-bit checkpoint's and runs a float32 one in 16 bits
    (`vllm.config.model._resolve_auto_dtype`)."""
    dtype = str(engine_kwargs.get("dtype", "auto"))
    return 4 if dtype in ("float32", "float", "torch.float32") else 2


def hot_window_pool_need(model_dir, config: TierKVConfig, engine_kwargs: dict) -> int:
    """Bytes of the hot-window pool vLLM needs to admit one request: every layer's window of
    `cache.window_tokens` (the model's own sliding window when smaller) plus the tokens in flight
    (max_num_batched_tokens, twice that under vLLM's async scheduling, which keeps two batches in flight),
    capped at max_model_len, in blocks of `cache.block_tokens`, plus one block (vLLM's sliding-window bound):
    what vLLM's admission asks free (`max_admission_blocks_per_request` with `scheduler_reserve_full_isl`);
    plus vLLM's null block, which the pool never frees. vLLM's own start-up check leaves the null block
    out: a pool of exactly the admission's blocks starts, then admits no request and steps idle forever.
    ConfigError: settings the hot window cannot run (`check_hot_window_config`), here where
    TieredLLM and `tierkv plan` read the window before vLLM starts."""
    check_hot_window_config(config)
    shape = checkpoint_shape(model_dir)
    tokens = config.cache.block_tokens
    in_flight = int(engine_kwargs.get("max_num_batched_tokens") or config.scheduler.prefill_chunk_tokens)
    if engine_kwargs.get("async_scheduling"):
        in_flight *= 2
    max_len = engine_kwargs.get("max_model_len") or shape["max_position_embeddings"] or (1 << 62)
    # a model with its own sliding window keeps those layers' spec: the smaller window, so the check
    # never asks more than vLLM does (TieredLLM and `tierkv plan` refuse such models under the hot window:
    # `engine_args.check_own_window`)
    window = min(config.cache.window_tokens, shape["sliding_window"] or config.cache.window_tokens)
    # the one floor every resize asks too (`resize_plan.plan_resize`): the window and vLLM's null block
    blocks = admission_floor_blocks(window_blocks(window, in_flight, max_len, tokens))
    element = (1 if str(engine_kwargs.get("kv_cache_dtype", "auto")).startswith("fp8") else
               engine_dtype_bytes(engine_kwargs))
    return (shape["num_hidden_layers"] * blocks * 2 * rank_kv_heads(shape, engine_kwargs) * tokens
            * shape["head_dim"] * element)


def check_hot_window_pool(model_dir, config: TierKVConfig, engine_kwargs: dict) -> None:
    """A config error naming the keys to change when the hot-window pool is smaller than vLLM's
    start-up check asks (`hot_window_pool_need`); vLLM's own error would speak of max_model_len,
    which the hot window does not keep on the GPU."""
    need = hot_window_pool_need(model_dir, config, engine_kwargs)
    pool = engine_kwargs["kv_cache_memory_bytes"]
    if pool < need:
        doubled = (" (twice max_num_batched_tokens in flight under scheduler.vllm_async_scheduling: halve "
                   "scheduler.prefill_chunk_tokens to keep the pool)" if engine_kwargs.get("async_scheduling") else "")
        raise ConfigError("cache.gpu_budget_bytes", config.cache.gpu_budget_bytes,
                          f"leaves vLLM a hot-window pool of {format_bytes(pool)}, and its window of "
                          f"{config.cache.window_tokens} tokens plus "
                          f"{engine_kwargs.get('max_num_batched_tokens')} prefill tokens in flight{doubled} "
                          f"needs {format_bytes(need)}: raise the budget, or lower cache.window_tokens or "
                          "scheduler.prefill_chunk_tokens")


def check_admission(vllm_config, kv_cache_config, budget_bytes: int) -> None:
    """At the engine's start, with vLLM's own numbers: a pool in which vLLM can never admit a request
    (its admission, `max_admission_blocks_per_request` summed over the groups' specs, more than the blocks
    it can free: all but the null block) is a ConfigError on cache.gpu_budget_bytes (`budget_bytes`) naming
    the sizes, where the engine would start and then step idle forever. Skipped when vLLM admits without
    reserving a request's whole admission, or where the config lacks what vLLM's admission reads (a config
    built without a model, in tests)."""
    scheduler = getattr(vllm_config, "scheduler_config", None)
    max_len = getattr(getattr(vllm_config, "model_config", None), "max_model_len", None)
    in_flight = getattr(vllm_config, "max_in_flight_tokens", None) if scheduler is not None else None
    if not getattr(scheduler, "scheduler_reserve_full_isl", True) or max_len is None or in_flight is None:
        return
    free = kv_cache_config.num_blocks - 1  # vLLM's null block is never handed out
    # the groups share the one pool: vLLM admits a request when the sum of their admissions is free
    specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
    need = sum(s.max_admission_blocks_per_request(in_flight, max_len) for s in specs
               if hasattr(s, "max_admission_blocks_per_request"))
    if need > free:
        raise ConfigError(
            "cache.gpu_budget_bytes", budget_bytes,
            f"leaves vLLM a pool of {kv_cache_config.num_blocks} blocks, {free} of them free to requests (one is "
            f"vLLM's null block), and vLLM admits a request only with {need} free (its window and "
            f"{in_flight} tokens in flight, in {specs[0].block_size}-token blocks): the engine "
            "would start and never run a request; raise the budget, or lower cache.window_tokens or "
            "scheduler.prefill_chunk_tokens")


def full_decode_capture_sizes(max_num_seqs) -> list[int]:
    """The batch sizes vLLM captures graphs for under `scheduler.sparse_full_graphs`: vLLM's default
    sizes (1, 2, 4, multiples of 8 below 256, of 16 from 256, up to twice max_num_seqs and 512) with
    max_num_seqs itself added. vLLM keeps a full decode graph only for the sizes up to max_num_seqs and
    pads a batch up to the next one, so without it a batch of, say, 10 of max_num_seqs 10 found no
    full graph (10 is not a default size, 16 is past 10) and every such step ran piecewise, the sparse
    step outside the graph."""
    if not isinstance(max_num_seqs, int) or isinstance(max_num_seqs, bool) or max_num_seqs < 1:
        raise ValueError(f"max_num_seqs: got {max_num_seqs!r}; scheduler.sparse_full_graphs captures vLLM's full "
                         "decode graphs up to it: pass a positive max_num_seqs")
    largest = min(2 * max_num_seqs, 512)
    default = [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]
    return sorted({size for size in default if size <= largest} | {min(max_num_seqs, 512)})


def full_graph_rows(engine_kwargs: dict) -> int:
    """The largest batch vLLM will capture a full decode graph for, worked out before the engine
    exists: the largest capture size of the engine's compilation_config when given, else of
    `full_decode_capture_sizes(max_num_seqs)`, and at least max_num_seqs (the connector sizes its
    rows from vLLM's resolved size, `connector.graph_rows`; `check_full_graph_rows` ties the two)."""
    max_num_seqs = engine_kwargs.get("max_num_seqs")
    sizes = full_decode_capture_sizes(max_num_seqs)
    own = engine_kwargs.get("compilation_config")
    if isinstance(own, dict) and own.get("cudagraph_capture_sizes"):
        sizes = list(own["cudagraph_capture_sizes"])
    return max(max_num_seqs, *sizes)


def check_full_graph_rows(reserved_rows: int, vllm_config) -> None:
    """After vLLM starts: the rows the full decode graph's codes were reserved for in the budget
    (`full_graph_rows`) must cover the batch the connector sizes them for (`engine_config.graph_rows`);
    otherwise the GPU would hold more than cache.gpu_budget_bytes. Nothing to check when nothing
    was reserved."""
    if not reserved_rows:
        return
    rows = graph_rows(vllm_config)
    if rows > reserved_rows:
        raise RuntimeError(f"the full decode graph's codes were reserved for {reserved_rows} rows, and vLLM resolved "
                           f"its largest captured batch to {rows}: pass compilation_config="
                           "{'cudagraph_capture_sizes': [...]} with the sizes to capture")


def full_graph_packed_bytes(model_dir, config: TierKVConfig, engine_kwargs: dict) -> int:
    """GPU bytes the sparse step inside vLLM's full decode graph keeps on each GPU beside the caches:
    over a quantized CPU tier, the codes and scales of a selection for each row of the largest
    captured batch (`full_graph_rows.FullDecodeRows`), and of the next-step prefetch's margin
    (`prefetch_margin.MarginPrefetch`, with its per-layer slot lists over any tier); 0 without
    `scheduler.sparse_full_graphs` or under an eager engine. The largest batch is the largest
    capture size: of the engine's compilation_config when given, else of
    `full_decode_capture_sizes(max_num_seqs)`."""
    if not full_graphs_configured(config) or engine_kwargs.get("enforce_eager", True):
        return 0
    rows = full_graph_rows(engine_kwargs)
    shape = checkpoint_shape(model_dir)
    tokens, margin = config.cache.block_tokens, config.scheduler.sparse_prefetch_margin
    lists = rows * margin * shape["num_hidden_layers"] * 2 * 8  # int64 sources and targets per layer
    per_block = quantized_block_bytes(shape, config, engine_kwargs)
    if not per_block:
        return lists
    return lists + rows * (max(1, config.scheduler.sparse_token_budget // tokens) + margin) * per_block


def quantized_block_bytes(shape: dict, config: TierKVConfig, engine_kwargs: dict) -> int:
    """Bytes of one block of one layer on each GPU in the CPU tier's quantized form (`storage_dtype` int8 or
    float8_e4m3fn: one-byte codes, a float32 scale per K/V and head), what the device keeps to dequantize it;
    0 when the CPU tier stores the KV dtype. shape: `checkpoint_shape`."""
    cpu = config.tiers[0] if config.tiers and config.tiers[0].kind == "cpu" else None
    if cpu is None or cpu.storage_dtype not in ("int8", "float8_e4m3fn"):
        return 0
    kv_heads = rank_kv_heads(shape, engine_kwargs)
    return 2 * kv_heads * config.cache.block_tokens * shape["head_dim"] + 2 * kv_heads * 4


def sparse_summary_bytes(model_dir, config: TierKVConfig, max_model_len: int | None, engine_kwargs: dict) -> int:
    """GPU bytes the sparse policy's key summaries take at most on each GPU: `max_num_seqs`
    requests of `max_model_len` tokens (default: the checkpoint's max_position_embeddings), the
    model's shape read from the checkpoint's config.json, its KV heads split over
    `tensor_parallel_size`."""
    max_num_seqs = engine_kwargs.get("max_num_seqs")
    if not isinstance(max_num_seqs, int) or isinstance(max_num_seqs, bool) or max_num_seqs < 1:
        raise ValueError(f"max_num_seqs: got {max_num_seqs!r}; scheduler.policy 'sparse' keeps the key summaries of "
                         "every running request on the GPU inside cache.gpu_budget_bytes, so the engine needs a "
                         "positive max_num_seqs (requests at once)")
    shape = checkpoint_shape(model_dir)
    max_len = sparse_max_model_len(model_dir, max_model_len, shape)
    per_request = summary_bytes_per_request(max_len, config.cache.block_tokens, shape["num_hidden_layers"],
                                            rank_kv_heads(shape, engine_kwargs), shape["head_dim"],
                                            engine_dtype_bytes(engine_kwargs))
    return max_num_seqs * per_request


def sparse_max_model_len(model_dir, max_model_len: int | None, shape: dict | None = None) -> int:
    """The length the sparse policy reserves summaries for: `max_model_len`, else the checkpoint's
    max_position_embeddings (what vLLM would take). shape: `checkpoint_shape(model_dir)` when the
    caller has read it."""
    max_len = max_model_len or (shape or checkpoint_shape(model_dir))["max_position_embeddings"]
    if not max_len:
        raise ValueError(f"max_model_len: not given and {model_dir}/config.json has no max_position_embeddings; "
                         "the sparse policy sizes its key summaries from it")
    return max_len


def checkpoint_shape(model_dir) -> dict:
    """num_hidden_layers, num_key_value_heads, head_dim, max_position_embeddings (None when
    absent), dtype_bytes (4 for float32, else 2) and sliding_window (the model's own, None when
    absent or turned off) of a checkpoint directory's config.json (`tierkv.model_shape`). A dict
    of these keys passes through: every function here takes a model directory or its shape
    (`tierkv plan` sizes an engine for a preset that has no directory)."""
    if isinstance(model_dir, dict):
        return model_dir
    try:
        shape = model_shape.checkpoint_shape(model_dir)
    except ValueError as e:
        raise ValueError(f"{e}; the sparse policy sizes its key summaries from the model's shape") from e
    return {"num_hidden_layers": shape.num_layers, "num_key_value_heads": shape.num_kv_heads,
            "head_dim": shape.head_dim, "max_position_embeddings": shape.max_position_embeddings,
            "dtype_bytes": shape.dtype_bytes, "sliding_window": shape.sliding_window}

