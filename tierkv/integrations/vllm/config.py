"""The tierkv config of a vLLM engine, named from its kv_transfer_config.

Primitives: `CONNECTOR_NAME`, `CONNECTOR_MODULE`, `kv_transfer_config`, `config_from_kv_transfer`,
`check_hot_window_config`, `unused_under_vllm`.

    LLM(model, kv_transfer_config={
        "kv_connector": "TierKVConnector",
        "kv_connector_module_path": "tierkv.integrations.vllm.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"config_file": "vllm-128k"},   # or a path
    })

Without `config_file` the TIERKV_CONFIG_FILE environment variable names the file. The file is
loaded by the same loader as everywhere else (TIERKV_* overrides, precise errors).
"""
from __future__ import annotations

import dataclasses
import difflib
import os
from typing import Any, Mapping

from tierkv.config import CacheConfig, ConfigError, ModelConfig, SchedulerConfig, TierKVConfig, load_config
from tierkv.configs import resolve_config_path

CONNECTOR_NAME = "TierKVConnector"
CONNECTOR_MODULE = "tierkv.integrations.vllm.connector"
EXTRA_KEYS = ("config_file", "model_id", "resolved")


def kv_transfer_config(config_file: str | os.PathLike, **extra: Any) -> dict:
    """The `kv_transfer_config` dict that makes a vLLM engine use tierkv with `config_file`. A block the
    tiers cannot load (corrupt, or gone since the lookup) is recomputed by vLLM (`kv_load_failure_policy`
    'recompute'; vLLM's default 'fail' would fail the request)."""
    if not isinstance(config_file, (str, os.PathLike)) or not str(config_file):
        raise TypeError(f"config_file: got {config_file!r}; expected a path or a shipped config's name")
    _refuse_unknown_keys(extra, EXTRA_KEYS[1:], "allowed beside config_file")  # else found in vLLM's start-up
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"config_file": str(config_file), **extra},
    }


def _refuse_unknown_keys(extra: Mapping[str, Any], allowed: tuple[str, ...], said: str) -> None:
    """ConfigError naming the first `kv_connector_extra_config` entry not in `allowed`, with the closest match."""
    for key in extra:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ConfigError(f"kv_connector_extra_config.{key}", extra[key], f"{hint}{said}: {list(allowed)}")


def config_from_kv_transfer(extra_config: Mapping[str, Any] | None, *, block_size: int | None,
                            env: Mapping[str, str] | None = None) -> TierKVConfig:
    """Validate `kv_connector_extra_config` and load the tierkv config it names.

    `block_size`: vLLM's KV block size; tierkv's `cache.block_tokens` must equal it, since one
    tierkv block is one vLLM block (None: not known yet, not checked).
    """
    env = os.environ if env is None else env
    if extra_config is not None and not isinstance(extra_config, Mapping):
        raise ConfigError("kv_connector_extra_config", extra_config,
                          f"expected a mapping such as {{'config_file': 'vllm-128k'}}; allowed keys: {list(EXTRA_KEYS)}")
    extra = dict(extra_config or {})
    _refuse_unknown_keys(extra, EXTRA_KEYS, "allowed keys")
    model_id = extra.get("model_id")
    if model_id is not None and (not isinstance(model_id, str) or not model_id.strip()):
        raise ConfigError("kv_connector_extra_config.model_id", model_id,
                          "expected a non-empty string naming where the weights came from (part of every block's address)")
    named = extra.get("config_file")
    if named is not None and (not isinstance(named, (str, os.PathLike)) or not str(named).strip()):
        raise ConfigError("kv_connector_extra_config.config_file", named, "expected a path or a shipped config's name")
    resolved = extra.get("resolved", False)
    if not isinstance(resolved, bool):
        raise ConfigError("kv_connector_extra_config.resolved", resolved, "expected true or false")
    path = named or env.get("TIERKV_CONFIG_FILE")
    if not path:
        raise ConfigError("kv_connector_extra_config.config_file", None,
                          "name a tierkv YAML file there or in the TIERKV_CONFIG_FILE environment variable")
    if isinstance(path, (str, os.PathLike)):
        path = resolve_config_path(path)  # a shipped config's name ('vllm-128k') or a path
    if not isinstance(path, os.PathLike) or not os.path.isfile(path):
        key = "kv_connector_extra_config.config_file" if named else "config_file (set by TIERKV_CONFIG_FILE)"
        raise ConfigError(key, str(named or path), "must be an existing tierkv YAML file or a shipped config's name")
    if extra.get("config_file"):  # named here, it is the file (TieredLLM writes one): the variable is not read
        env = {k: v for k, v in env.items() if k != "TIERKV_CONFIG_FILE"}
    if resolved:  # a file TieredLLM wrote from a config it loaded with the environment and sized: taken as it is
        env = {}
    config = load_config(path, env=env)
    if block_size is not None and config.cache.block_tokens != block_size:
        raise ConfigError("cache.block_tokens", config.cache.block_tokens,
                          f"must equal vLLM's block_size ({block_size}) when tierkv runs as a vLLM connector")
    scheduler = config.scheduler
    if scheduler.sparse_prefetch_margin and not (scheduler.sparse_cuda_graphs and scheduler.sparse_full_graphs):
        # the loader lets predictor 'cache' (the transformers engine's) carry a margin; under vLLM it would do nothing
        raise ConfigError("scheduler.sparse_prefetch_margin", scheduler.sparse_prefetch_margin,
                          "under vLLM the next-step prefetch runs inside its full decode graph: set "
                          "scheduler.sparse_cuda_graphs and sparse_full_graphs true, or the margin to 0")
    return config


def check_hot_window_config(config: TierKVConfig) -> None:
    """ConfigError on settings vLLM's hot window cannot run, where the hot window is known to be on (TieredLLM's
    and `tierkv plan`'s pool check before vLLM starts, the connector, the plugin's sliding-window spec), so they
    are not refused later by the worker (after vLLM loaded the model) or by nothing at all:
    - `cache.window_tokens` below 1. The schema allows 0, which the transformers engine runs (its GPU keeps the
      sinks and the block being written); under vLLM the window is each layer's SlidingWindowSpec and the
      worker's far part (`FarKV`), which need at least the newest token.
    - `scheduler.sparse_selection: per_kv_head` with the sparse policy: built only where far blocks are read in
      place (the transformers engine on a CPU device)."""
    window = config.cache.window_tokens
    if window < 1:
        raise ConfigError("cache.window_tokens", window,
                          "under vLLM it must be at least 1: the hot window keeps each request's newest "
                          "cache.window_tokens tokens in vLLM's pool (configs/vllm-128k.yaml keeps 2048); "
                          "0 only runs on the transformers engine")
    scheduler = config.scheduler
    if scheduler.policy == "sparse" and scheduler.sparse_selection != "per_layer":
        raise ConfigError("scheduler.sparse_selection", scheduler.sparse_selection,
                          "under vLLM only 'per_layer' is built (per_kv_head needs far blocks read in place: the "
                          "transformers engine on a CPU device)")


# scheduler settings only the transformers engine reads: under vLLM the far path has its own prefetch (the
# hot window's lookahead, the sparse graphs' far-block caches) and no CPU device
_TRANSFORMERS_ONLY = ("predictor", "predict_with_previous", "decode_cuda_graph", "cpu_far_reads")
# settings of the sparse policy's CUDA graphs: nothing reads them under the exact policy
_SPARSE_GRAPHS_ONLY = ("sparse_cuda_graphs", "sparse_graph_rows", "sparse_cache_selections", "sparse_full_graphs",
                       "vllm_rows_from_batch")


def unused_under_vllm(config: TierKVConfig, hot_window: bool = True) -> list[str]:
    """Settings given a value other than their default that a vLLM engine never reads (the transformers engine's
    prefetch predictors, CUDA decode graph, CPU far reads, sinks and model shape; with the exact policy or
    without the hot window, the sparse policy's graph settings), each as "<section>.<key>: <value> (<why>)": the
    connector logs them once, since the loader accepts them for the transformers engine."""
    scheduler, defaults = config.scheduler, SchedulerConfig()
    changed = [f.name for f in dataclasses.fields(SchedulerConfig)
               if getattr(scheduler, f.name) != getattr(defaults, f.name)]
    unused = [f"scheduler.{key}: {getattr(scheduler, key)!r} (the transformers engine's)"
              for key in changed if key in _TRANSFORMERS_ONLY]
    if scheduler.policy != "sparse" or not hot_window:
        why = "the sparse policy's graphs under the hot window" if hot_window else "the hot window's"
        unused += [f"scheduler.{key}: {getattr(scheduler, key)!r} ({why})" for key in changed if key in _SPARSE_GRAPHS_ONLY]
    if scheduler.policy == "sparse" and not hot_window:
        unused.append("scheduler.policy: 'sparse' (the hot window's: vLLM's own pool attends every token)")
    model, model_defaults = config.model, ModelConfig()
    unused += [f"model.{key}: {getattr(model, key)!r} (vLLM's KV cache spec gives the shape)"
               for key in _SHAPE_KEYS if getattr(model, key) != getattr(model_defaults, key)]
    if config.cache.sink_tokens != CacheConfig().sink_tokens:
        unused.append(f"cache.sink_tokens: {config.cache.sink_tokens!r} (the transformers engine's: vLLM's pool keeps "
                      "each request's newest tokens, the rest comes from the tiers)")
    return unused


_SHAPE_KEYS = ("num_layers", "num_kv_heads", "head_dim", "kv_dtype")  # model.*: the transformers engine's checks
