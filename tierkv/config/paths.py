"""Paths in the config: `~` expanded, and a length a file system can hold.

Primitives: `expand_path`, `check_path`, `MAX_PATH_BYTES`, `MAX_NAME_BYTES`.
"""
from __future__ import annotations

import os

from tierkv.config.errors import ConfigError

MAX_PATH_BYTES = 4095
MAX_NAME_BYTES = 255


def expand_path(value: str, keypath: str) -> str:
    """`value` with a leading ~ or ~user expanded; ConfigError when that user has no home."""
    expanded = os.path.expanduser(value)
    if expanded.startswith("~"):
        user = value[1:].split("/", 1)[0]
        raise ConfigError(keypath, value, f"'~{user}' names no user with a home directory; give the path in full")
    return expanded


def check_path(value: str, keypath: str) -> str:
    """The expanded path, after checking it can name a file at all."""
    if not value:
        raise ConfigError(keypath, value, "expected a path")
    expanded = expand_path(value, keypath)
    encoded = os.fsencode(expanded)
    if len(encoded) > MAX_PATH_BYTES:
        raise ConfigError(keypath, value, f"a path of at most {MAX_PATH_BYTES} bytes ({len(encoded)} given)")
    longest = max(encoded.split(b"/"), key=len)
    if len(longest) > MAX_NAME_BYTES:
        raise ConfigError(keypath, value, f"path components of at most {MAX_NAME_BYTES} bytes "
                                          f"(one has {len(longest)})")
    return expanded
