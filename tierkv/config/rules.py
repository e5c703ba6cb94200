"""Rules across config fields, checked after every field is valid on its own.

Primitives: `check_config`.
"""
from __future__ import annotations

from tierkv.config.errors import ConfigError


def check_config(config) -> None:
    """Raise ConfigError for the first rule a `TierKVConfig` breaks."""
    _check_tier_order(config)
    _check_prefetch_margin(config)
    _check_sparse_budget(config)
    _check_disk_paths(config)
    _check_redis_keyspaces(config)
    _check_control(config)
    _check_encrypted_tiers(config)


def _check_encrypted_tiers(config) -> None:
    """`encrypt` seals a tier's blocks with the secret: a trusted tier stores them as they are."""
    for index, tier in enumerate(config.tiers):
        if getattr(tier, "trusted", False) and getattr(tier, "encrypt", False):
            raise encrypt_on_trusted(index)


def encrypt_on_trusted(index: int) -> ConfigError:
    """The error for `encrypt: true` on trusted tier `index`, in the words a start uses (`storage.auth`)."""
    return ConfigError(f"tiers[{index}].encrypt", True, f"needs an untrusted tier (trusted: false) and a secret: "
                       f"tiers[{index}].trusted is true, and a trusted tier stores blocks as they are; set "
                       f"tiers[{index}].trusted: false or tiers[{index}].encrypt: false")


def _check_disk_paths(config) -> None:
    """Two disk tiers on one directory would each count the other's blocks against their capacity."""
    import os

    from tierkv.config.paths import expand_path

    seen: dict[str, int] = {}
    for i, tier in enumerate(config.tiers):
        if tier.kind != "disk":
            continue
        path = os.path.realpath(expand_path(tier.path, f"tiers[{i}].path"))
        if path in seen:
            raise ConfigError(f"tiers[{i}].path", tier.path, f"tiers[{seen[path]}] already uses that directory; "
                              "give each disk tier its own")
        seen[path] = i


def _check_redis_keyspaces(config) -> None:
    """Two Redis tiers on one server's database under one namespace would store into, evict and count each
    other's keys."""
    from tierkv.redis_url import keyspace

    seen: dict[tuple, int] = {}
    for i, tier in enumerate(config.tiers):
        if tier.kind != "redis":
            continue
        where = (keyspace(tier.url), tier.namespace)
        if where in seen:
            raise ConfigError(f"tiers[{i}].namespace", tier.namespace,
                              f"tiers[{seen[where]}] already uses that server, database and namespace; give each "
                              "Redis tier its own namespace (or server)")
        seen[where] = i


def _check_control(config) -> None:
    metrics = config.metrics
    if metrics.control_enabled and metrics.prometheus_port is None:
        raise ConfigError("metrics.control_enabled", True, "the budget control is served on the metrics endpoint: "
                          "set metrics.prometheus_port too")


def _check_sparse_budget(config) -> None:
    """Sparse decode reads whole blocks: a budget below one block would read no far block at all."""
    scheduler, block_tokens = config.scheduler, config.cache.block_tokens
    if scheduler.policy == "sparse" and scheduler.sparse_token_budget < block_tokens:
        raise ConfigError("scheduler.sparse_token_budget", scheduler.sparse_token_budget,
                          f"sparse decode reads whole far blocks of cache.block_tokens ({block_tokens}) tokens: "
                          f"give at least one block's worth (budgets are rounded down to whole blocks)")


def _check_tier_order(config) -> None:
    kinds = [t.kind for t in config.tiers]
    if not kinds or kinds[0] != "cpu":
        raise ConfigError("tiers", kinds, "the first tier must be kind 'cpu' (the pinned slab GPU copies use)")
    if kinds.count("cpu") > 1:
        raise ConfigError("tiers", kinds, "at most one 'cpu' tier")


def _check_prefetch_margin(config) -> None:
    scheduler = config.scheduler
    under_vllm = scheduler.sparse_cuda_graphs and scheduler.sparse_full_graphs
    if scheduler.sparse_prefetch_margin and not (scheduler.policy == "sparse"
                                                 and (under_vllm or scheduler.predictor == "cache")):
        raise ConfigError("scheduler.sparse_prefetch_margin", scheduler.sparse_prefetch_margin,
                          "the next-step prefetch runs inside vLLM's full decode graph (scheduler.policy 'sparse', "
                          "sparse_cuda_graphs and sparse_full_graphs true) or with the transformers engine's "
                          "predictor 'cache' (scheduler.policy 'sparse'); set one of those, or the margin to 0")
    if scheduler.sparse_prefetch_margin and scheduler.sparse_cache_selections < 2:
        raise ConfigError("scheduler.sparse_prefetch_margin", scheduler.sparse_prefetch_margin,
                          f"the prefetched blocks need cache slots beside the selection's: "
                          f"scheduler.sparse_cache_selections is {scheduler.sparse_cache_selections}, set it to 2 "
                          "or more")
