"""The configs shipped with tierkv, by name: `--config default`, `load_config("long-128k")`.

Primitives: `SHIPPED_DIR`, `shipped_names`, `resolve_config_path`.
"""
from __future__ import annotations

import os
from pathlib import Path

SHIPPED_DIR = Path(__file__).resolve().parent


def shipped_names() -> list[str]:
    """Names of the shipped configs (file names without .yaml), sorted."""
    return sorted(p.stem for p in SHIPPED_DIR.glob("*.yaml"))


def resolve_config_path(source: str | os.PathLike) -> Path:
    """A config file path as given (a leading `~` expanded, as for the paths inside a config), or a shipped
    config's name ('default', 'long-128k', ...)."""
    path = Path(source)
    try:
        path = path.expanduser()
    except RuntimeError:  # no home directory to expand `~` to: the reader reports the path as given
        pass
    if str(source) not in shipped_names():  # a path: the reader reports what is wrong with it
        return path
    try:
        if path.exists():  # a file named like a shipped config, in the working directory
            return path
    except (OSError, ValueError):
        return path
    return SHIPPED_DIR / f"{source}.yaml"
