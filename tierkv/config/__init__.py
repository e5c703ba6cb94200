"""Typed configuration, loaded from YAML or a dict plus `TIERKV_*` environment variables.

The public names (`from tierkv.config import load_config, TierKVConfig, ConfigError`) are
re-exported here from the modules that own them:

    schema.py   the dataclasses (one per section, a default and a doc per field), `load_config`
    load.py     the one loader: YAML or dict + environment -> the dataclasses, validated
    fields.py   one conversion and check per kind of field (sizes, paths, booleans, URLs)
    paths.py    paths: `~` expanded, lengths a file system can hold
    rules.py    rules across fields, checked after every field is valid on its own
    errors.py   `ConfigError`, naming the key, the value and what is allowed

The shipped YAML files live apart, in `tierkv.configs`.
"""
from __future__ import annotations

from tierkv.config.errors import ConfigError
from tierkv.config.schema import (
    STORAGE_DTYPES,
    TIER_CONFIG_KINDS,
    CacheConfig,
    CpuTierConfig,
    DiskTierConfig,
    MetricsConfig,
    ModelConfig,
    RedisTierConfig,
    SchedulerConfig,
    StorageConfig,
    TierConfig,
    TierKVConfig,
    config_errors,
    load_config,
)

__all__ = [
    "STORAGE_DTYPES", "TIER_CONFIG_KINDS", "CacheConfig", "ConfigError", "CpuTierConfig", "DiskTierConfig",
    "MetricsConfig", "ModelConfig", "RedisTierConfig", "SchedulerConfig", "StorageConfig", "TierConfig",
    "TierKVConfig", "config_errors", "load_config",
]
