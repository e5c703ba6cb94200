"""What the tierkv connector reads of the vLLM engine it serves: whether it runs tierkv's hot window, the tierkv
block layout of its one KV cache group (and its sliding window: the hot window's or the model's own), the model's
identity in block addresses, its batch sizes, and this worker's tensor-parallel rank.

Primitives: `runs_hot_window`, `layout_of` (-> `KVGroupLayout`), `model_identity_of`, `max_num_seqs_of`,
`sleep_mode_of`, `query_heads_of`, `graph_rows`, `tensor_parallel_rank`.
vLLM is imported only inside the functions that read its types.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tierkv.blocks import BlockLayout
from tierkv.config import ConfigError
from tierkv.model_identity import ModelIdentity, checkpoint_identity

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig


def model_identity_of(config, extra: dict | None, model_config, download_dir: str | None = None) -> ModelIdentity:
    """What names the engine's model in every block address: the configured `model.name`, the
    checkpoint (vLLM's model path and revision, and `model_id` of the extra config), and a
    digest of its weight files (`checkpoint_identity`; a hub id is looked up where vLLM downloads,
    `download_dir`, or in the hub cache). The scheduler and every worker compute the same one from the
    same files."""
    model_id = (extra or {}).get("model_id")
    path = getattr(model_config, "model", None) or model_id or config.model.name
    revision = getattr(model_config, "revision", None)
    return checkpoint_identity(config.model.name, path, None if revision is None else str(revision),
                               model_id=None if model_id is None else str(model_id), cache_dir=download_dir)


def max_num_seqs_of(vllm_config) -> int:
    """vLLM's max_num_seqs (1 when its config does not say)."""
    return int(getattr(getattr(vllm_config, "scheduler_config", None), "max_num_seqs", 1) or 1)


def sleep_mode_of(vllm_config) -> bool:
    """Whether the engine runs with vLLM's sleep mode (its KV pool in the CuMem allocator, which sleep() frees)."""
    return bool(getattr(getattr(vllm_config, "model_config", None), "enable_sleep_mode", False))


def query_heads_of(vllm_config) -> int | None:
    """This rank's query heads (vLLM's model config under its tensor parallelism; None when its config
    does not say, as in CPU tests)."""
    model_config = getattr(vllm_config, "model_config", None)
    parallel_config = getattr(vllm_config, "parallel_config", None)
    if model_config is None or parallel_config is None or not hasattr(model_config, "get_num_attention_heads"):
        return None
    return int(model_config.get_num_attention_heads(parallel_config))


def graph_rows(vllm_config) -> int:
    """The largest batch vLLM captures or warms up a graph for: its resolved max_cudagraph_capture_size
    (twice max_num_seqs by default), at least max_num_seqs."""
    max_num_seqs = max_num_seqs_of(vllm_config)
    captured = getattr(getattr(vllm_config, "compilation_config", None), "max_cudagraph_capture_size", None)
    return max(max_num_seqs, int(captured or 2 * max_num_seqs))


def tensor_parallel_rank() -> int:
    """This worker's tensor-parallel rank (0 before vLLM's process groups exist, as in CPU tests)."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except (AssertionError, ImportError, RuntimeError, AttributeError):
        return 0


def runs_hot_window(vllm_config) -> bool:
    """Whether the engine runs tierkv's hot window: its attention backend is CUSTOM, which the plugin registers as
    the hot window's (`hot_window.register`, `hot_window_engine_args`), and only there does the plugin declare the
    hot window's SlidingWindowSpec. Any other backend leaves a sliding-window spec the model's own."""
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    return getattr(backend, "name", backend) == "CUSTOM"


@dataclass(frozen=True)
class KVGroupLayout:
    """What the connector reads of vLLM's one KV cache group."""

    layout: BlockLayout
    layer_names: list[str]
    hot_window: int | None  # tierkv's hot window in tokens (None: not run)
    own_window: int | None  # the model's own sliding window in tokens, without the hot window (None: full attention)


def layout_of(kv_cache_config: "KVCacheConfig", block_size: int, hot_window_tokens: int | None) -> KVGroupLayout:
    """The tierkv block layout, the layer names and the sliding window of the single KV cache group: full
    attention, the hot window's sliding-window spec, or without the hot window the model's own sliding window.
    hot_window_tokens: cache.window_tokens where the engine runs the hot window (`runs_hot_window`), else None.
    ConfigError: a group tierkv cannot serve, or the hot window over a model's own window."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) != 1:
        raise ConfigError("vllm kv_cache_groups", len(groups),
                          "the tierkv connector serves models with one group of full-attention layers")
    spec = groups[0].kv_cache_spec
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    full = type(spec) is FullAttentionSpec and not spec.sliding_window
    if not full and type(spec) is not SlidingWindowSpec:
        raise ConfigError("vllm kv_cache_spec", type(spec).__name__,
                          "only full-attention layers (or tierkv's hot window over them) are supported")
    window = spec.sliding_window if type(spec) is SlidingWindowSpec else None
    if spec.block_size != block_size:
        raise ConfigError("vllm block_size", spec.block_size, f"the KV cache group must use block_size {block_size}")
    if window is not None and hot_window_tokens is not None and window != hot_window_tokens:
        # the plugin declares cache.window_tokens only over full attention: another window is the model's own
        raise ConfigError("vllm kv_cache_spec sliding_window", window,
                          f"the model attends its own sliding window of {window} tokens (config.json sliding_window) "
                          f"and tierkv's hot window (attention backend CUSTOM, cache.window_tokens "
                          f"{hot_window_tokens}) would add every block before it, attention the model never does: run "
                          "it with hot_window=False (TieredLLM, vllm_engine_args) or without attention backend CUSTOM: "
                          "tierkv's connector then saves and loads its window's blocks")
    layout = BlockLayout(spec.num_kv_heads, block_size, spec.head_size, spec.dtype)
    hot = window if hot_window_tokens is not None else None
    return KVGroupLayout(layout, list(groups[0].layer_names), hot, None if hot_window_tokens is not None else window)
