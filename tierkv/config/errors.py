"""`ConfigError`: the one error a bad configuration raises, and how it shows a value.

Primitives: `ConfigError`, `show_value`.

The message names the key, the value and what is allowed. The value is shown bounded (a
document of nested aliases can be huge when printed) and redacted (`tierkv.redact`: a secret
field shows ***, a URL its host without the password); the raw value stays on `.value`.
"""
from __future__ import annotations

import itertools
import reprlib

_SHOW = reprlib.Repr()
_SHOW.maxlevel, _SHOW.maxstring, _SHOW.maxother, _SHOW.maxlong = 2, 200, 80, 60
_SHOW.maxlist = _SHOW.maxdict = _SHOW.maxtuple = _SHOW.maxset = 6


def show_value(key: str, value: object) -> str:
    """A short, redacted repr of `value` for messages about config key `key`."""
    from tierkv.redact import redact_value

    try:
        redacted = redact_value(key, _bounded(value, 4))
        shown = _SHOW.repr(redacted)
    except (ValueError, RecursionError):  # an int too long to print
        return f"<{type(value).__name__}>"
    if key.endswith("_bytes") and type(value) is int and redacted is value and 1024 <= value < 1 << 80:
        from tierkv.units import format_bytes  # a size: its units beside it (never beside a masked value)

        shown = f"{shown} ({format_bytes(value)})"
    return shown


def _bounded(value: object, depth: int) -> object:
    """A copy of at most `depth` levels and 7 entries per level (the repr shows fewer): a tree of
    aliases, or one that holds itself, is never walked whole."""
    if isinstance(value, dict):
        items = list(itertools.islice(value.items(), 7))
        return {k: _bounded(v, depth - 1) for k, v in items} if depth > 0 else {"...": "..."}
    if isinstance(value, (list, tuple)):
        return [_bounded(v, depth - 1) for v in value[:7]] if depth > 0 else ["..."]
    return value


class ConfigError(ValueError):
    """A configuration value is not allowed. The message names key, value and what is allowed."""

    def __init__(self, key: str, value: object, allowed: str):
        from tierkv.redact import redact_text

        self.key, self.value, self.allowed = key, value, redact_text(allowed)
        super().__init__(f"config key '{key}': got {show_value(key, value)}; {self.allowed}")
