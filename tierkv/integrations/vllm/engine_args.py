"""The vLLM engine arguments that run tierkv: for vLLM's own `LLM(...)` and for
`TieredLLM(..., backend="vllm")`, with the GPU bytes the latter keeps beside vLLM's pool.

Primitives: `vllm_engine_args`, `tiered_engine_args` (-> `TieredEngineArgs`), `hot_window_engine_args`,
`require_plugin_installed`.

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"   # scheduler and worker share the tiers
    llm = vllm.LLM(model=path, max_model_len=131072, **vllm_engine_args("vllm-128k"))

`vllm_engine_args` gives the arguments `TieredLLM(..., backend="vllm")` passes for the exact policy.
The sparse policy reserves GPU bytes for key summaries sized from the checkpoint and `max_num_seqs`
(`pool_sizing`): use TieredLLM for it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from tierkv.config import ConfigError, TierKVConfig, load_config
from tierkv.integrations.vllm.config import check_hot_window_config, kv_transfer_config
from tierkv.integrations.vllm.full_graph_rows import full_graphs_configured
from tierkv.integrations.vllm.pool_sizing import (check_hot_window_pool, checkpoint_shape, full_decode_capture_sizes, full_graph_packed_bytes,
                                                  full_graph_rows, sparse_max_model_len, sparse_summary_bytes)
from tierkv.integrations.vllm.resize_plan import split_budget

PLUGIN_ENTRY_POINT = "tierkv.integrations.vllm.hot_window:register"
HOT_WINDOW_KEYS = ("attention_config", "kv_cache_memory_bytes")  # engine arguments the hot window sets


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
        check_hot_window_config(config)  # as TieredLLM does, before vLLM loads the model
        kwargs.update(hot_window_engine_args(config))
    return kwargs


@dataclass(frozen=True)
class TieredEngineArgs:
    """vLLM's arguments for `TieredLLM(..., backend="vllm")`, and what the budget keeps beside vLLM's
    hot-window pool (all 0 without the hot window or the sparse policy)."""

    kwargs: dict  # for vllm.LLM(**kwargs)
    summary_reserved_bytes: int = 0  # the sparse policy's key summaries (`sparse_summary_bytes`)
    full_graph_reserved_bytes: int = 0  # the full decode graph's codes and scales (`full_graph_packed_bytes`)
    full_graph_reserved_rows: int = 0  # the rows those codes were reserved for (the largest captured batch)


def tiered_engine_args(model, config: TierKVConfig, config_file: str, engine_kwargs: dict, *, hot_window: bool,
                       max_model_len: int | None, gpu_memory_utilization: float,
                       enable_prefix_caching: bool | None, resolved_config: bool = False) -> TieredEngineArgs:
    """vLLM's arguments for TieredLLM: the connector (loading `config_file`), and with `hot_window`
    its pool, the sparse policy's reservations and, under `scheduler.sparse_full_graphs` in a
    compiled engine, the capture sizes. `engine_kwargs` (the user's) win over all but the hot
    window's own keys (ValueError naming them). enable_prefix_caching None: vLLM's prefix cache on, off under the
    hot window (True there is refused). The engine runs eagerly unless the config asks
    for the full decode graph (`default_enforce_eager`) or `engine_kwargs` say otherwise. resolved_config:
    `config_file` holds the whole config as the caller runs it (environment overrides applied, sizes worked
    out): the connector loads it without applying TIERKV_* variables again."""
    check_engine_lengths(config, max_model_len, engine_kwargs, hot_window)
    check_engine_settings(config, engine_kwargs, hot_window, enable_prefix_caching)
    engine_kwargs = {"enforce_eager": default_enforce_eager(config, hot_window), **engine_kwargs}
    derived = None
    if hot_window and max_model_len is None and "max_model_len" not in engine_kwargs:
        # the length vLLM will run with (a rope-scaled model's is past max_position_embeddings): the pool
        # check and the sparse summaries are sized for it; vLLM derives it again itself
        derived = vllm_max_model_len(model, engine_kwargs)
    kwargs = dict(
        model=os.fspath(model),
        kv_transfer_config=kv_transfer_config(config_file, model_id=os.path.abspath(model),
                                              **({"resolved": True} if resolved_config else {})),
        block_size=config.cache.block_tokens,
        enforce_eager=True,
        gpu_memory_utilization=gpu_memory_utilization,
        enable_prefix_caching=enable_prefix_caching is not False,  # None: vLLM's default, on (off under the hot window)
    )
    reserved = TieredEngineArgs({})
    if hot_window:
        clash = sorted(set(HOT_WINDOW_KEYS) & set(engine_kwargs))
        if clash:
            raise ValueError(f"{', '.join(clash)}: set by the hot window (backend CUSTOM, pool = "
                             "cache.gpu_budget_bytes - scheduler.staging_bytes - sparse key summaries); "
                             "pass hot_window=False to set them")
        if config.scheduler.policy == "sparse":
            # the summaries are reserved for, and capped at, the same max_model_len vLLM runs with
            max_model_len = sparse_max_model_len(model, max_model_len or derived)
            reserved = _sparse_reservations(model, config, max_model_len, engine_kwargs)
        kwargs.update(hot_window_engine_args(config, reserved.summary_reserved_bytes,
                                             reserved.full_graph_reserved_bytes))
        if int(engine_kwargs.get("tensor_parallel_size", 1) or 1) > 1:
            require_plugin_installed()
    if max_model_len is not None:
        kwargs["max_model_len"] = max_model_len
    kwargs.update(engine_kwargs)
    if os.path.isfile(os.path.join(os.fspath(model), "config.json")):
        check_attention_kind(model)
        if hot_window:
            check_own_window(model)
            check_hot_window_pool(model, config, kwargs if "max_model_len" in kwargs or derived is None
                                  else {**kwargs, "max_model_len": derived})
    if (hot_window and full_graphs_configured(config) and not kwargs.get("enforce_eager")
            and "compilation_config" not in engine_kwargs):
        kwargs["compilation_config"] = {"cudagraph_capture_sizes": full_decode_capture_sizes(kwargs.get("max_num_seqs"))}
    return TieredEngineArgs(kwargs, reserved.summary_reserved_bytes, reserved.full_graph_reserved_bytes,
                            reserved.full_graph_reserved_rows)


# vLLM's KV cache dtypes the hot window's pool can hold: the far part attends the tiers' blocks in the model's dtype
_HOT_WINDOW_KV_DTYPES = ("auto", "bfloat16", "float16")


def check_engine_settings(config: TierKVConfig, engine_kwargs: dict, hot_window: bool,
                          enable_prefix_caching: bool | None = None) -> None:
    """Before vLLM starts, what it would refuse only after loading the model or would run otherwise than asked:
    a `block_size` other than cache.block_tokens (the connector's blocks are vLLM's), another KV connector
    (`kv_transfer_config`), and under the hot window a quantized `kv_cache_dtype`, prefill without chunks or
    vLLM's prefix cache asked for (ValueError naming the argument), or a config setting the hot window does not
    run (`check_hot_window_config`: ConfigError naming the key)."""
    block_size = engine_kwargs.get("block_size")
    if block_size is not None and block_size != config.cache.block_tokens:
        raise ValueError(f"block_size: got {block_size!r}; tierkv's blocks are vLLM's, so it must equal the config's "
                         f"cache.block_tokens ({config.cache.block_tokens}): leave it out (TieredLLM sets it) or "
                         "change cache.block_tokens")
    if "kv_transfer_config" in engine_kwargs:
        raise ValueError("kv_transfer_config: TieredLLM runs vLLM with tierkv's connector (its config from the config "
                         "given to TieredLLM); to run another connector, use vllm.LLM directly")
    if not hot_window:
        return
    check_hot_window_config(config)
    if enable_prefix_caching:
        raise ValueError("enable_prefix_caching=True: the hot window runs vLLM's prefix cache off (a repeated prefix "
                         "comes back from tierkv's tiers); leave it out, or pass hot_window=False")
    if engine_kwargs.get("enable_chunked_prefill", True) is False:
        raise ValueError("enable_chunked_prefill=False: the hot window prefills in chunks of "
                         f"scheduler.prefill_chunk_tokens ({config.scheduler.prefill_chunk_tokens} tokens, vLLM's "
                         "max_num_batched_tokens), so a prompt longer than one chunk needs chunked prefill; leave it "
                         "out, or pass hot_window=False")
    dtype = engine_kwargs.get("kv_cache_dtype", "auto")
    if str(dtype) not in _HOT_WINDOW_KV_DTYPES:
        raise ValueError(f"kv_cache_dtype: got {dtype!r}; the hot window keeps vLLM's pool in the model's dtype "
                         f"({', '.join(map(repr, _HOT_WINDOW_KV_DTYPES))}); tierkv quantizes its own tiers instead "
                         "(tiers[].storage_dtype: int8 or float8_e4m3fn), or pass hot_window=False")


def check_engine_lengths(config: TierKVConfig, max_model_len, engine_kwargs: dict, hot_window: bool) -> None:
    """ValueError naming the argument, before vLLM starts: a max_model_len that is not a positive number of tokens
    (vLLM's -1, fit to GPU memory, included: tierkv sizes the pool, the summaries and the tiers for a fixed
    length; None leaves it to the checkpoint), and under the hot window a max_num_seqs above the tokens a step
    schedules (vLLM refuses it, naming max_num_batched_tokens, which tierkv sets from
    scheduler.prefill_chunk_tokens)."""
    for name, value in (("max_model_len", max_model_len), ("engine max_model_len", engine_kwargs.get("max_model_len"))):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            auto = ("; vLLM's -1 (fit the length to GPU memory) does not apply: tierkv sizes the hot window and the "
                    "tiers for a fixed length" if value == -1 else "")
            raise ValueError(f"{name}: got {value!r}; a positive number of tokens, or None for the checkpoint's "
                             f"length as vLLM derives it{auto}")
    seqs = engine_kwargs.get("max_num_seqs")
    if not hot_window or seqs is None or isinstance(seqs, bool) or not isinstance(seqs, int):
        return
    given = engine_kwargs.get("max_num_batched_tokens")
    step_tokens = given if isinstance(given, int) else config.scheduler.prefill_chunk_tokens
    if seqs > step_tokens:
        what = (f"max_num_batched_tokens={step_tokens}" if isinstance(given, int)
                else f"scheduler.prefill_chunk_tokens={step_tokens} (vLLM's max_num_batched_tokens)")
        raise ValueError(f"max_num_seqs={seqs} is above {what}: vLLM schedules at most that many tokens a step and "
                         "needs one per running request; lower max_num_seqs or raise it")


_MODEL_CONFIG_KEYS = ("hf_overrides", "trust_remote_code", "revision", "code_revision", "tokenizer",
                      "tokenizer_revision", "hf_config_path")  # engine arguments that change what vLLM derives


def vllm_max_model_len(model, engine_kwargs: dict | None = None) -> int | None:
    """max_model_len as vLLM derives it when none is given (`vllm.config.ModelConfig` with the engine's
    own model arguments: rope scaling, hf_overrides, the tokenizer's model_max_length, ...), or None where
    vLLM cannot read the checkpoint here (then the checks fall back to config.json's
    max_position_embeddings and vLLM's own start-up check has the last word)."""
    if not os.path.isfile(os.path.join(os.fspath(model), "config.json")):
        return None
    given = {k: v for k, v in (engine_kwargs or {}).items() if k in _MODEL_CONFIG_KEYS}
    try:
        from vllm.config import ModelConfig

        return int(ModelConfig(model=os.fspath(model), skip_tokenizer_init=True, **given).max_model_len)
    except Exception:  # noqa: BLE001  not a checkpoint vLLM reads here (an architecture it lacks, no weights' config)
        return None


def check_own_window(model) -> None:
    """ValueError for a model whose layers attend their own sliding window (Mistral, Qwen2 with
    use_sliding_window, Gemma's sliding layers): vLLM keeps those layers' KV within the window already,
    and the hot window's far part would add every block before it (attention the model never does)."""
    window = checkpoint_shape(model)["sliding_window"]
    if window:
        raise ValueError(f"{model}: its layers attend a sliding window of {window} tokens (config.json "
                         "sliding_window); vLLM keeps only that window of KV already, and tierkv's hot window would "
                         "add the blocks before it: run it with hot_window=False (tierkv's connector alone saves "
                         "every block and loads a prefix hit's blocks within its own window) or on the transformers "
                         "backend")


# the sliding ones are check_own_window's; "attention" is a dense model written with a hybrid config class
# (granite-4.0-micro: every layer "attention", which vLLM runs as one full-attention group)
_FULL_ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "attention")


def check_attention_kind(model) -> None:
    """ValueError naming the config.json field, before vLLM loads the model, for attention the connector refuses
    once vLLM hands it the KV cache groups (one group of full-attention layers, or the hot window over them):
    latent attention (MLA: kv_lora_rank), chunked local attention (attention_chunk_size) and hybrid layer types
    (linear attention, state-space layers: layer_types)."""
    from tierkv.model_shape import read_config_json, text_config

    cfg = text_config(read_config_json(os.path.join(os.fspath(model), "config.json")))
    if not isinstance(cfg, dict):
        return
    why = None
    if cfg.get("kv_lora_rank"):
        why = f"kv_lora_rank {cfg['kv_lora_rank']!r}: multi-head latent attention (vLLM's MLA cache)"
    elif cfg.get("attention_chunk_size"):
        why = f"attention_chunk_size {cfg['attention_chunk_size']!r}: chunked local attention in some layers"
    elif isinstance(cfg.get("layer_types"), list):
        other = sorted({str(t) for t in cfg["layer_types"]} - set(_FULL_ATTENTION_LAYER_TYPES))
        if other:
            why = f"layer_types {other}: layers other than attention over every token"
    if why:
        raise ValueError(f"{model}: config.json {why}; tierkv's vLLM connector serves models whose layers all run "
                         "full attention (one KV cache group): use the transformers backend or vLLM without tierkv")


def default_enforce_eager(config: TierKVConfig, hot_window: bool) -> bool:
    """TieredLLM's enforce_eager when the caller gives none: compiled (False) where the hot window's
    sparse step runs inside vLLM's full decode graph (`scheduler.sparse_full_graphs`, which needs a
    compiled engine), eager otherwise (the connector's per-layer hooks run between vLLM's pieces)."""
    return not (hot_window and full_graphs_configured(config))


def _sparse_reservations(model, config: TierKVConfig, max_model_len: int, engine_kwargs: dict) -> TieredEngineArgs:
    """The sparse policy's GPU reservations (no engine arguments yet): key summaries, and the full
    decode graph's codes and scales with the rows they were sized for."""
    summary_bytes = sparse_summary_bytes(model, config, max_model_len, engine_kwargs)
    full_graph_bytes = full_graph_packed_bytes(model, config, engine_kwargs)
    return TieredEngineArgs({}, summary_bytes, full_graph_bytes, full_graph_rows(engine_kwargs) if full_graph_bytes else 0)


def hot_window_engine_args(config: TierKVConfig, summary_bytes: int = 0, full_graph_bytes: int = 0) -> dict:
    """vLLM engine arguments of the hot-window pool: backend CUSTOM, a KV pool of the GPU budget
    minus the staging ring and `summary_bytes` (the sparse policy's key summaries,
    `sparse_summary_bytes`), prefill chunks of `scheduler.prefill_chunk_tokens`, vLLM's async
    scheduling as `scheduler.vllm_async_scheduling` says (off by default). full_graph_bytes: what the
    full decode graph keeps for a quantized CPU tier's codes and scales (`full_graph_packed_bytes`),
    also out of the budget."""
    from tierkv.integrations.vllm import hot_window

    split = split_budget(config, config.cache.gpu_budget_bytes, summary_bytes, full_graph_bytes)
    if split.pool_bytes <= 0:
        raise ConfigError("cache.gpu_budget_bytes", config.cache.gpu_budget_bytes,
                          f"must exceed {split.reserved_text()}: the rest is vLLM's hot-window pool")
    hot_window.register()
    return dict(attention_config={"backend": "CUSTOM"}, kv_cache_memory_bytes=split.pool_bytes, enable_prefix_caching=False,
                max_num_batched_tokens=config.scheduler.prefill_chunk_tokens,
                async_scheduling=config.scheduler.vllm_async_scheduling)


def require_plugin_installed(entry_points=None) -> None:
    """Tensor-parallel workers are separate processes: vLLM registers the hot-window backend there
    only through the `vllm.general_plugins` entry point of an installed tierkv."""
    if entry_points is None:
        from importlib.metadata import entry_points as installed

        entry_points = installed(group="vllm.general_plugins")
    if not any(ep.value == PLUGIN_ENTRY_POINT for ep in entry_points):
        raise RuntimeError("tensor_parallel_size > 1 with the hot window needs tierkv installed (pip install "
                           "tierkv-runtime, or pip install -e . in a checkout) so that vLLM's worker processes load "
                           f"its plugin {PLUGIN_ENTRY_POINT!r}; or pass hot_window=False")
