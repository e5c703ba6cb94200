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
    """A config file path as given, or a shipped config's name ('default', 'long-128k', ...)."""
    path = Path(source)
    if path.exists() or os.sep in str(source) or path.suffix in (".yaml", ".yml"):
        return path
    shipped = SHIPPED_DIR / f"{source}.yaml"
    return shipped if shipped.is_file() else path
