"""`TIERKV_SECTION__KEY=value` variables over a config's data, each read by the type its field declares.

Primitives: `apply_env`. A text field (names, paths, secrets, URLs, tokens, dtypes) takes the text verbatim,
never read as YAML; other scalars plain decimals, YAML 1.1's booleans, or the text (a size with units); a
section or the tier list a YAML flow mapping or list.
"""
from __future__ import annotations

import copy
import dataclasses
import re
import typing
from collections.abc import Mapping

from tierkv.config.errors import ConfigError
from tierkv.config.yaml_reader import _YAML_ERRORS, _DuplicateKey, _TooDeep, _yaml_load

ENV_PREFIX = "TIERKV_"
ENV_CONFIG_FILE = "TIERKV_CONFIG_FILE"
ENV_CONTROL_TOKEN = "TIERKV_CONTROL_TOKEN"  # read by tierkv.metrics.control, not a config key


def apply_env(data: dict, env: Mapping[str, str], root: type) -> dict[str, str]:
    """Write TIERKV_A__B=v into data['a']['b'], read as the field's declared type; returns {dotted key: variable}."""
    origins = {}
    defaults = dataclasses.asdict(root())
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX) or var in (ENV_CONFIG_FILE, ENV_CONTROL_TOKEN):
            continue
        parts = var[len(ENV_PREFIX) :].lower().split("__")
        if not all(parts):
            raise ConfigError(var, env[var], "expected TIERKV_SECTION__KEY (levels joined by '__', none empty)")
        dotted = _set_path(data, defaults, root, parts, var, env[var])
        if dotted in origins:  # another spelling of one key (case, an index's leading zeros): which one is meant?
            raise ConfigError(var, env[var], f"{origins[dotted]} sets the same key ({dotted}); set it once")
        origins[dotted] = var
    return origins


def _set_path(data: dict, defaults: object, declared: object, parts: list[str], var: str, raw: str) -> str:
    """Set the value of one variable; returns the dotted key it set. `declared`: the type of the node walked
    (a dataclass; a mapping of kinds for a list of sections; None where unknown)."""
    node: object = data
    dotted = ""
    optional = False
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):
            problem = _index_problem(var[len(ENV_PREFIX):].split("__")[i], len(node), dotted,
                                     f"{ENV_PREFIX}{'__'.join(parts[:i]).upper()}")
            if problem:
                raise ConfigError(var, raw, problem)
            key: object = int(part)
            dotted += f"[{key}]"
            defaults = None
        elif isinstance(node, dict):
            key = part
            dotted = f"{dotted}.{part}" if dotted else part
            defaults = defaults.get(part) if isinstance(defaults, dict) else None
            if not last and part not in node:
                node[part] = copy.deepcopy(defaults) if isinstance(defaults, list) else {}
        else:
            raise ConfigError(var, raw, f"'{dotted}' holds a {type(node).__name__}, not a section or list; "
                                        f"set {ENV_PREFIX}{'__'.join(parts[:i]).upper()} itself")
        declared, optional = _declared_below(declared, key, node)
        if last:
            node[key] = _parse_env_value(raw, declared, optional)
        else:
            node = node[key]
    return dotted


def _index_problem(given: str, num_entries: int, dotted: str, list_var: str) -> str | None:
    """What is wrong with `given` (as written in the variable) as an index into the list at `dotted` of
    `num_entries` entries, set as a whole by `list_var`; None for a decimal index in 0..N-1."""
    if num_entries == 0:
        return f"'{dotted}' has no entries, so none can be set by index; set {list_var} itself"
    allowed = f"'{dotted}' has {num_entries} entries, so the index must be 0..{num_entries - 1}"
    if not (given.isascii() and given.isdigit()):
        return f"{given!r} is not an index; {allowed}"
    if int(given) >= num_entries:
        return f"index {given} is out of range; {allowed}"
    return None


def _declared_below(declared: object, key: object, node: object) -> tuple[object, bool]:
    """(the declared type at `key` of `node`, whether it may be None): a field's type (a list of sections as the
    mapping of its kinds), or a list entry's section by its `kind`; (None, False) where it is not known."""
    if isinstance(declared, Mapping):  # a list of sections: the entry's own kind
        item = node[key] if isinstance(node, list) else None
        kind = item.get("kind") if isinstance(item, Mapping) else None
        return (declared.get(kind) if isinstance(kind, str) else None), False
    if not (isinstance(declared, type) and dataclasses.is_dataclass(declared)):
        return None, False
    fld = next((f for f in dataclasses.fields(declared) if f.name == key), None)
    if fld is None:
        return None, False
    tp = typing.get_type_hints(declared)[fld.name]
    args = typing.get_args(tp)
    optional = type(None) in args
    if optional:
        tp = next(a for a in args if a is not type(None))
    return (fld.metadata.get("kinds", {}) if typing.get_origin(tp) is list else tp), optional


_NULLS = ("", "null", "Null", "NULL", "~")
_BOOLS = {**dict.fromkeys(("true", "yes", "on"), True), **dict.fromkeys(("false", "no", "off"), False)}  # as YAML 1.1
_INT = re.compile(r"[-+]?[0-9]+")
_FLOAT = re.compile(r"[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")


def _parse_env_value(raw: str, declared: object, optional: bool) -> object:
    """The value of a variable for a field of type `declared`. Text fields (and unknown keys) take the raw text
    verbatim: no YAML, so no '#' comment, quote or escape is read. Other scalars: plain decimal integers (0100 is
    100), decimal floats, true/false, else the text itself (a size with units; the field's check refuses the
    rest). A section or list of sections: a YAML flow mapping or list. An empty value is None for an optional
    field (null and ~ too, for one that holds no text)."""
    if optional and (raw == "" or (declared is not str and raw.strip() in _NULLS)):
        return None
    if declared is None or declared is str:
        return raw
    if isinstance(declared, Mapping) or dataclasses.is_dataclass(declared):
        try:
            return _yaml_load(raw)
        except (*_YAML_ERRORS, _TooDeep, _DuplicateKey):
            return raw
    text = raw.strip()
    if text.lower() in _BOOLS:
        return _BOOLS[text.lower()]
    if _INT.fullmatch(text):
        return int(text, 10) if len(text) <= 400 else raw  # (past 400 digits: refused as text, not converted)
    if _FLOAT.fullmatch(text):
        return float(text)
    return raw
