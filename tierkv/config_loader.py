"""The one loader: YAML or dict + TIERKV_* environment -> `TierKVConfig`, validated.

Primitives: `load`, `build_section`, `to_dict`.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import typing
from collections.abc import Mapping
from pathlib import Path

import yaml

from tierkv.config import TIER_CONFIG_KINDS, ConfigError, TierKVConfig
from tierkv.units import ALLOWED_UNITS, parse_bytes

ENV_PREFIX = "TIERKV_"
ENV_CONFIG_FILE = "TIERKV_CONFIG_FILE"
ENV_CONTROL_TOKEN = "TIERKV_CONTROL_TOKEN"  # read by tierkv.metrics.control, not a config key


def load(source: str | os.PathLike | Mapping | None = None, *, env: Mapping[str, str] | None = None) -> TierKVConfig:
    env = os.environ if env is None else env
    if source is None:
        source = env.get(ENV_CONFIG_FILE)
    if source is None:
        data: dict = {}
    elif isinstance(source, Mapping):
        data = copy.deepcopy(dict(source))
    else:
        data = _read_yaml(Path(source))
    origins = _apply_env(data, env)
    try:
        config = build_section(TierKVConfig, data, "")
        _check_tier_order(config)
        _check_prefetch_margin(config)
    except ConfigError as err:
        origin = origins.get(err.key)
        if origin is None:
            raise
        raise ConfigError(f"{err.key} (set by {origin})", err.value, err.allowed) from None
    return config


def to_dict(config: object) -> dict:
    """Plain data, as YAML would hold it (`tierkv config check` prints this)."""
    return dataclasses.asdict(config)


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError("config_file", str(path), "expected an existing YAML file")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError("config_file", str(path), f"expected valid YAML ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError("config_file", str(path), "expected a mapping at the top level")
    return data


def _apply_env(data: dict, env: Mapping[str, str]) -> dict[str, str]:
    """Write TIERKV_A__B=v into data['a']['b']; returns {dotted key: variable name}."""
    origins = {}
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX) or var in (ENV_CONFIG_FILE, ENV_CONTROL_TOKEN):
            continue
        parts = var[len(ENV_PREFIX) :].lower().split("__")
        value = _parse_env_value(env[var])
        node: object = data
        dotted = ""
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            if isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    raise ConfigError(var, env[var], f"'{dotted}' has {len(node)} entries; use an index below that")
                dotted += f"[{part}]"
                if last:
                    node[int(part)] = value
                else:
                    node = node[int(part)]
                continue
            dotted = f"{dotted}.{part}" if dotted else part
            if last:
                node[part] = value
            else:
                if part == "tiers" and part not in node:
                    node[part] = [to_dict(t) for t in TierKVConfig().tiers]
                node = node.setdefault(part, {})
        origins[dotted] = var
    return origins


def _parse_env_value(raw: str) -> object:
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def build_section(cls: type, data: object, prefix: str):
    """Build dataclass `cls` from a mapping, converting and checking every field."""
    if not isinstance(data, Mapping):
        raise ConfigError(prefix or "<root>", data, f"expected a mapping of {cls.__name__} fields")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, raw in data.items():
        keypath = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ConfigError(keypath, raw, f"unknown key; {hint}allowed keys: {', '.join(fields)}")
        kwargs[key] = _convert(hints[key], raw, keypath, fields[key])
    return cls(**kwargs)


def _convert(tp: object, raw: object, keypath: str, fld: dataclasses.Field) -> object:
    args = typing.get_args(tp)
    if type(None) in args:
        if raw is None:
            return None
        tp = next(a for a in args if a is not type(None))
    if typing.get_origin(tp) is list:
        return _build_tiers(raw, keypath)
    if dataclasses.is_dataclass(tp):
        return build_section(tp, raw, keypath)
    value = _coerce_scalar(tp, raw, keypath, fld.name)
    _check_value(value, keypath, fld.metadata)
    return value


def _coerce_scalar(tp: object, raw: object, keypath: str, name: str) -> object:
    if name.endswith("_bytes"):
        try:
            return parse_bytes(raw)
        except ValueError:
            raise ConfigError(keypath, raw, f"expected a size; units: {ALLOWED_UNITS}") from None
    if tp is bool:
        if isinstance(raw, bool):
            return raw
        raise ConfigError(keypath, raw, "expected true or false")
    if tp is int:
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        raise ConfigError(keypath, raw, "expected an integer")
    if tp is float:
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            return float(raw)
        raise ConfigError(keypath, raw, "expected a number")
    if tp is str:
        if isinstance(raw, str):
            return raw
        raise ConfigError(keypath, raw, "expected a string")
    raise AssertionError(f"unsupported config type {tp} for {keypath}")


def _check_value(value: object, keypath: str, meta: Mapping) -> None:
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(keypath, value, f"allowed: {', '.join(map(str, choices))}")
    low, high = meta.get("min_value"), meta.get("max_value")
    if low is not None and value < low:
        what = "must be positive" if low > 0 else f"must be at least {low}"
        raise ConfigError(keypath, value, what)
    if high is not None and value > high:
        raise ConfigError(keypath, value, f"must be at most {high}")
    check = meta.get("check")
    if check is not None:
        _CHECKS[check](value, keypath)


def _build_tiers(raw: object, keypath: str) -> list:
    if not isinstance(raw, list):
        raise ConfigError(keypath, raw, "expected a list of tiers, each with a 'kind'")
    tiers = []
    for i, item in enumerate(raw):
        itempath = f"{keypath}[{i}]"
        kind = item.get("kind") if isinstance(item, Mapping) else None
        if kind not in TIER_CONFIG_KINDS:
            raise ConfigError(f"{itempath}.kind", kind, f"allowed: {', '.join(TIER_CONFIG_KINDS)}")
        tiers.append(build_section(TIER_CONFIG_KINDS[kind], item, itempath))
    return tiers


def _check_tier_order(config: TierKVConfig) -> None:
    kinds = [t.kind for t in config.tiers]
    if not kinds or kinds[0] != "cpu":
        raise ConfigError("tiers", kinds, "the first tier must be kind 'cpu' (the pinned slab GPU copies use)")
    if kinds.count("cpu") > 1:
        raise ConfigError("tiers", kinds, "at most one 'cpu' tier")


def _check_prefetch_margin(config: TierKVConfig) -> None:
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


def _check_writable_dir(value: str, keypath: str) -> None:
    if not value:
        raise ConfigError(keypath, value, "expected a directory path")
    path = Path(value).expanduser()
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(keypath, value, f"expected a directory; {probe} is not one")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(keypath, value, f"expected a writable directory; {probe} is not writable")


def _check_redis_url(value: str, keypath: str) -> None:
    from tierkv.storage.redis_url import URL_FORMS, parse_redis_url

    try:
        parse_redis_url(value)
    except ValueError as exc:
        raise ConfigError(keypath, value, f"expected {URL_FORMS}: {exc}") from None


def _check_non_empty(value: str, keypath: str) -> None:
    if not value:
        raise ConfigError(keypath, value, "expected a non-empty string")


def _check_secret(value: str, keypath: str) -> None:
    if len(value) < 16:  # the value itself is never echoed back
        raise ConfigError(keypath, "<hidden>", f"expected at least 16 characters, got {len(value)}")


_CHECKS = {"writable_dir": _check_writable_dir, "redis_url": _check_redis_url, "non_empty": _check_non_empty,
           "secret": _check_secret}
