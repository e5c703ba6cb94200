"""The one loader: YAML or dict + TIERKV_* environment -> typed dataclasses, validated.

Primitives: `load`, `load_with_errors`, `build_section`, `to_dict`, `shown_dict`.

Generic over the dataclasses it builds (`tierkv.config` passes `TierKVConfig` and its
cross-field rules), so it imports nothing of them. Each field is converted and checked by
its type and name (`tierkv.config.fields`); a list field holds sections picked by their
`kind` from the field's `kinds` metadata. Errors are collected per field: `load` raises the
first, `load_with_errors` returns them all. A TIERKV_* variable is read by the type its field
declares (`tierkv.config.env_vars`): text verbatim, never as YAML.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import logging
import os
import typing
from collections.abc import Callable, Mapping
from pathlib import Path

from tierkv.config.env_vars import ENV_CONFIG_FILE, apply_env
from tierkv.config.errors import ConfigError
from tierkv.config.fields import check_value, convert_scalar
from tierkv.config.yaml_reader import _YAML_ERRORS, MAX_DEPTH, _DuplicateKey, _TooDeep, _yaml_load
from tierkv.configs import resolve_config_path
from tierkv.redact import MASK, is_secret_key, redact_tree

logger = logging.getLogger("tierkv.config")


def load(root: type, source: object = None, *, env: Mapping[str, str] | None = None,
         check: Callable[[object], None] | None = None) -> object:
    """`root` built from source (YAML path, mapping or None) and TIERKV_* overrides; raises the first ConfigError."""
    config, errors = load_with_errors(root, source, env=env, check=check)
    if errors:
        raise errors[0]
    return config


def load_with_errors(root: type, source: object = None, *, env: Mapping[str, str] | None = None,
                     check: Callable[[object], None] | None = None) -> tuple[object | None, list[ConfigError]]:
    """(config, []) or (None, every ConfigError found: one per bad field, or the one that stopped reading).
    TypeError naming the argument for a source that is none of a path, a name, a mapping or None."""
    if source is not None and not isinstance(source, (str, os.PathLike, Mapping)):
        raise TypeError(f"config: got {type(source).__name__}; expected a YAML file's path, a shipped config's name, "
                        "a mapping or None")
    env = os.environ if env is None else env
    env_file = env.get(ENV_CONFIG_FILE) or None  # set but empty: unset, as for every optional variable
    _warn_unused_env_file(source, env_file)
    try:
        data = _read_source(env_file if source is None else source)
    except ConfigError as err:
        if source is None and err.key == "config_file":  # the file the variable named
            err = ConfigError(f"config_file (set by {ENV_CONFIG_FILE})", err.value, err.allowed)
        return None, [err]
    try:
        origins = apply_env(data, env, root)
    except ConfigError as err:
        return None, [err]
    errors: list[ConfigError] = []
    config = build_section(root, data, "", errors)
    if not errors and check is not None:
        try:
            check(config)
        except ConfigError as err:
            errors.append(err)
    errors = [_named_by_origin(err, origins) for err in errors]
    return (None if errors else config), errors


def to_dict(config: object) -> dict:
    """Plain data, as YAML would hold it, secrets included (to hand the config to another process)."""
    return dataclasses.asdict(config)


def shown_dict(config: object) -> dict:
    """`to_dict` with secrets and URL passwords masked: what may be printed or logged."""
    return redact_tree(to_dict(config))


def _named_by_origin(err: ConfigError, origins: Mapping[str, str]) -> ConfigError:
    """The error with the variable that set its key (or a key below it) named."""
    origin = origins.get(err.key) or next((var for key, var in origins.items()
                                           if key.startswith((f"{err.key}.", f"{err.key}["))), None)
    if origin is None:
        return err
    return ConfigError(f"{err.key} (set by {origin})", err.value, err.allowed)


def _warn_unused_env_file(source: object, env_file: str | None) -> None:
    """TIERKV_CONFIG_FILE names the file only when no config is passed: say so when both are, and differ
    (the TIERKV_* field variables apply either way)."""
    if source is None or not env_file:
        return
    if not isinstance(source, Mapping):
        try:
            if resolve_config_path(source).resolve() == resolve_config_path(env_file).resolve():
                return
        except (OSError, ValueError, TypeError, ConfigError):
            pass
    shown = "a mapping" if isinstance(source, Mapping) else str(source)
    logger.warning("tierkv: %s=%s is not read: the config passed (%s) is used instead", ENV_CONFIG_FILE, env_file, shown)


def _read_source(source: object) -> dict:
    if source is None:
        return {}
    if isinstance(source, Mapping):
        try:
            return copy.deepcopy(dict(source))
        except RecursionError:
            raise ConfigError("<root>", "<mapping>", "nested too deeply") from None
    if not str(source):  # Path('') is '.', the working directory: refused as the empty path it was
        raise ConfigError("config_file", str(source), "expected a YAML file's path or a shipped config's name, "
                                                      "not an empty path")
    return _read_yaml(resolve_config_path(source))


def _read_yaml(path: Path) -> dict:
    try:
        raw = path.read_bytes()
    except IsADirectoryError:
        raise ConfigError("config_file", str(path), "expected an existing YAML file, not a directory") from None
    except (OSError, ValueError) as exc:
        from tierkv.configs import shipped_names

        reason = getattr(exc, "strerror", None) or str(exc)
        raise ConfigError("config_file", str(path), f"expected an existing YAML file ({reason}) or a shipped "
                          f"config: {', '.join(shipped_names())}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError("config_file", str(path), f"expected UTF-8 text (byte {exc.start} is not)") from None
    try:
        data = _yaml_load(text)
    except (RecursionError, _TooDeep):
        raise ConfigError("config_file", str(path), f"expected valid YAML nested at most {MAX_DEPTH} levels") from None
    except _DuplicateKey as exc:
        raise ConfigError("config_file", str(path), f"expected each key once: {exc}") from None
    except _YAML_ERRORS as exc:
        if "maximum nesting depth" in str(exc):  # PyYAML 6.0.4's own limit, met before ours
            raise ConfigError("config_file", str(path), f"expected valid YAML nested at most {MAX_DEPTH} levels") \
                from None
        raise ConfigError("config_file", str(path), f"expected valid YAML ({exc})") from None
    if data is None:
        if not text.strip():  # a file truncated or never written, not a choice of the defaults
            raise ConfigError("config_file", str(path), "expected YAML settings; the file is empty (write `{}` "
                              "or a comment for the defaults)")
        return {}
    if not isinstance(data, dict):
        raise ConfigError("config_file", str(path), "expected a mapping at the top level")
    return data


def build_section(cls: type, data: object, prefix: str, errors: list[ConfigError] | None = None):
    """Build dataclass `cls` from a mapping, converting and checking every field.

    With `errors` given, each bad field is recorded there and left at its default (the result is
    then only good for finding more errors); without, the first bad field raises."""
    collect = [] if errors is None else errors
    if not isinstance(data, Mapping):
        collect.append(ConfigError(prefix or "<root>", data, f"expected a mapping of {cls.__name__} fields"))
        data = {}
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, raw in data.items():
        keypath = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            # a misspelt secret key is still a secret: its value is shown only where no close key is one
            shown = MASK if any(is_secret_key(name) for name in close) else raw
            collect.append(ConfigError(keypath, shown, f"unknown key; {hint}allowed keys: {', '.join(fields)}"))
            continue
        try:
            kwargs[key] = _convert(hints[key], raw, keypath, fields[key], collect)
        except ConfigError as err:
            collect.append(err)
    if errors is None and collect:
        raise collect[0]
    return cls(**kwargs)


def _convert(tp: object, raw: object, keypath: str, fld: dataclasses.Field, errors: list[ConfigError]) -> object:
    args = typing.get_args(tp)
    if type(None) in args:
        if raw is None:
            return None
        tp = next(a for a in args if a is not type(None))
    if typing.get_origin(tp) is list:
        return _build_list(raw, keypath, fld.name, fld.metadata["kinds"], errors)
    if dataclasses.is_dataclass(tp):
        return build_section(tp, raw, keypath, errors)
    value = convert_scalar(tp, raw, keypath, fld.name)
    check_value(value, keypath, fld.name, fld.metadata)
    return value


def _build_list(raw: object, keypath: str, name: str, kinds: Mapping[str, type], errors: list[ConfigError]) -> list:
    if not isinstance(raw, list):
        raise ConfigError(keypath, raw, f"expected a list of {name}, each with a 'kind' ({', '.join(kinds)})")
    items = []
    for i, item in enumerate(raw):
        itempath = f"{keypath}[{i}]"
        if not isinstance(item, Mapping):
            example = f" (e.g. {{kind: {item}}})" if isinstance(item, str) and item in kinds else ""
            errors.append(ConfigError(itempath, item, f"expected a mapping with a 'kind'{example}; kinds: {', '.join(kinds)}"))
            continue
        kind = item.get("kind")
        if not isinstance(kind, str) or kind not in kinds:
            errors.append(ConfigError(f"{itempath}.kind", kind, f"allowed: {', '.join(kinds)}"))
            continue
        items.append(build_section(kinds[kind], item, itempath, errors))
    return items
