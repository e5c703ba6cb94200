"""vLLM's own `LLM(...)` running tierkv, without TieredLLM: the engine arguments in one call.

Primitives: `vllm_engine_args`.

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"   # scheduler and worker share the tiers
    llm = vllm.LLM(model=path, max_model_len=131072, **vllm_engine_args("vllm-128k"))

These are the arguments `TieredLLM(..., backend="vllm")` passes for the exact policy. The sparse
policy reserves GPU bytes for key summaries sized from the checkpoint and `max_num_seqs`: use
TieredLLM for it.
"""
from __future__ import annotations

import os

from tierkv.config import ConfigError, load_config
from tierkv.integrations.vllm.config import kv_transfer_config
from tierkv.integrations.vllm.llm import hot_window_engine_args


def vllm_engine_args(config_file: str | os.PathLike, *, hot_window: bool = True, **extra) -> dict:
    """Keyword arguments for `vllm.LLM` / `vllm.EngineArgs` that run tierkv with `config_file` (a
    path or a shipped config's name): the connector (`kv_transfer_config`, as vLLM's
    `KVTransferConfig`), `block_size` = `cache.block_tokens`, eager per-layer work, and with
    `hot_window` the hot-window pool (attention backend CUSTOM, `kv_cache_memory_bytes` =
    `cache.gpu_budget_bytes - scheduler.staging_bytes`, vLLM's prefix cache off). `extra`: more
    `kv_connector_extra_config` entries (`model_id`)."""
    from vllm.config import KVTransferConfig

    config = load_config(config_file)
    if hot_window and config.scheduler.policy == "sparse":
        raise ConfigError("scheduler.policy", "sparse", "the sparse policy's GPU reservations depend on the "
                          "checkpoint and max_num_seqs: use TieredLLM(..., backend='vllm') for it")
    kwargs = dict(kv_transfer_config=KVTransferConfig(**kv_transfer_config(config_file, **extra)),
                  block_size=config.cache.block_tokens, enforce_eager=True)
    if hot_window:
        kwargs.update(hot_window_engine_args(config))
    return kwargs
