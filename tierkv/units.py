"""Byte sizes with units: "2GiB", "512 MiB", "1.5GB", 4096; token counts: "128k", "1M", 131072.

Primitives: `parse_bytes`, `format_bytes`, `parse_tokens`.

Token counts use binary multiples, as context lengths are written (a "128k" model has 131072
positions): k = K = Ki = 1024, M = Mi = 1048576. So "1M" is 1,048,576 tokens.
"""
from __future__ import annotations

import re
from decimal import Decimal

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")
ALLOWED_UNITS = ("B; KB, MB, GB, TB (powers of 1000, as K, M, G, T); KiB, MiB, GiB, TiB (powers of 1024); "
                 "or a plain integer of bytes")


def parse_bytes(value: int | float | str) -> int:
    """Number of bytes in `value`; raises ValueError saying what is allowed (the value shown bounded)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):  # before any repr: a list of
        # aliases can stand for billions of entries
        raise ValueError(f"expected a size such as '2GiB', got {_shown(value)}; units: {ALLOWED_UNITS}")
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"a size in bytes must be whole, got {value!r}")
        return int(value)
    match = _SIZE_RE.match(value)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {_shown(value)} as a size; units: {ALLOWED_UNITS}")
    number, unit = match.groups()
    num_bytes = Decimal(number) * _UNITS[unit.lower()]  # exact: "1.005KB" is 1005 bytes, not 1004.99...
    if num_bytes != num_bytes.to_integral_value():
        raise ValueError(f"{_shown(value)} is not a whole number of bytes")
    return int(num_bytes)


def _shown(value: object) -> str:
    """A bounded repr for a message: scalars cut to SHOWN_CHARS (a long text or a huge int), collections by type
    only (a list of YAML aliases can stand for billions of entries)."""
    if value is None or isinstance(value, (bool, float, str)) or (isinstance(value, int) and value.bit_length() < 4096):
        text = repr(value)
        return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS - 5]}...{text[-1]} ({len(text)} characters)"
    return f"a {type(value).__name__}" if not isinstance(value, int) else f"an int of {value.bit_length()} bits"


SHOWN_CHARS = 80


def format_bytes(num_bytes: int | float) -> str:
    """4294967296 -> '4.00 GiB'."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


_TOKEN_UNITS = {"": 1, "k": 1024, "ki": 1024, "m": 1024**2, "mi": 1024**2}
TOKEN_UNITS_HELP = "k/K/Ki = 1024, M/Mi = 1048576 (128k = 131072 tokens, 1M = 1048576)"


MAX_TOKENS = 1 << 30  # a token count past this is a typo (a million times a 1k context), not a request


def parse_tokens(text: str | int) -> int:
    """A positive token count: 131072, "128k" (131072), "1.5k" (1536), "1M" (1048576); raises
    ValueError naming the value and what is allowed."""
    if isinstance(text, bool) or not isinstance(text, (int, str)):
        raise ValueError(f"expected a number of tokens such as 131072 or 128k, got {_shown(text)}")
    match = _SIZE_RE.match(str(text))
    if match is None or match.group(2).lower() not in _TOKEN_UNITS:
        raise ValueError(f"cannot read {_shown(text)} as a number of tokens: expected digits with an optional "
                         f"suffix, {TOKEN_UNITS_HELP}")
    number, unit = match.groups()
    value = float(number) * _TOKEN_UNITS[unit.lower()]
    if not value.is_integer() or value < 1:
        raise ValueError(f"{_shown(text)} is {value:g} tokens: expected a whole number of at least 1")
    if value > MAX_TOKENS:
        raise ValueError(f"{_shown(text)} is {value:g} tokens: at most {MAX_TOKENS} (1024M) tokens")
    return int(value)
