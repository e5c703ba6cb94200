"""What the tierkv connector reads of the vLLM engine it serves: the tierkv block layout of its one
KV cache group (and the hot window's sliding window), the model's identity in block addresses,
its batch sizes, and this worker's tensor-parallel rank.

Primitives: `layout_of`, `model_identity_of`, `max_num_seqs_of`, `sleep_mode_of`, `query_heads_of`, `graph_rows`,
`tensor_parallel_rank`.
vLLM is imported only inside the functions that read its types.
"""
from __future__ import annotations

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


def layout_of(kv_cache_config: "KVCacheConfig", block_size: int) -> tuple[BlockLayout, list[str], int | None]:
    """The tierkv block layout, the layer names and the hot window (None: full attention) of the
    single KV cache group: full attention, or the hot window's sliding-window spec."""
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
    layout = BlockLayout(spec.num_kv_heads, block_size, spec.head_size, spec.dtype)
    return layout, list(groups[0].layer_names), window
