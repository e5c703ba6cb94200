"""One conversion and check per kind of config field, chosen by the field's type and name.

Primitives: `convert_scalar`, `check_value`, `check_path`, `expand_path`, the limits below.

    bool             a real YAML boolean (true/false), never 1 or "yes please"
    int              an integer, not a boolean, within [min_value, max_value or MAX_INT]
    float            a finite number (no .inf, .nan) within [min_value, max_value or MAX_FLOAT]
    str              UTF-8 text without NUL characters
    *_bytes          a size with units (tierkv.units), whole bytes, at most MAX_BYTES
    path, *_path     a path: no NUL, components of at most 255 bytes, at most 4095 bytes in all,
                     '~user' only for a user that exists
    choices=(...)    one of them;  check="..."  a named check (writable_dir, writable_file, redis_url, non_empty, host,
                     secret, control_token)
"""
from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping

from tierkv.config.errors import ConfigError
from tierkv.config.paths import MAX_NAME_BYTES, MAX_PATH_BYTES, check_path, expand_path  # re-exported
from tierkv.redis_url import check_redis_url
from tierkv.units import ALLOWED_UNITS, format_bytes, parse_bytes

MAX_INT = 2**31 - 1  # counts of tokens, layers, rows: nothing real comes near
MAX_FLOAT = 1e9  # seconds: about 31 years, and still a valid socket timeout
MAX_BYTES = 2**50  # 1 PiB


def is_path_field(name: str) -> bool:
    return name == "path" or name.endswith("_path")


def convert_scalar(tp: object, raw: object, keypath: str, name: str) -> object:
    """`raw` as a value of type `tp` for field `name`, or ConfigError saying what is allowed."""
    if name.endswith("_bytes"):
        try:
            return parse_bytes(raw)
        except (ValueError, OverflowError) as exc:
            units = "" if "units:" in str(exc) else f"; units: {ALLOWED_UNITS}"  # (said once)
            raise ConfigError(keypath, raw, f"expected a size in whole bytes ({exc}){units}") from None
    if tp is bool:
        if isinstance(raw, bool):
            return raw
        raise ConfigError(keypath, raw, "expected true or false")
    if tp is int:
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        raise ConfigError(keypath, raw, "expected an integer")
    if tp is float:
        return _finite(raw, keypath)
    if tp is str:
        return _text(raw, keypath)
    raise AssertionError(f"unsupported config type {tp} for {keypath}")


def _finite(raw: object, keypath: str) -> float:
    if isinstance(raw, (int, float)) and not isinstance(raw, bool):
        try:
            value = float(raw)
        except OverflowError:
            value = math.inf
        if math.isfinite(value):
            return value
    raise ConfigError(keypath, raw, "expected a finite number")


def _text(raw: object, keypath: str) -> str:
    if not isinstance(raw, str):
        raise ConfigError(keypath, raw, "expected a string")
    if "\x00" in raw:
        raise ConfigError(keypath, raw, "expected text without NUL characters")
    try:
        raw.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(keypath, raw, "expected valid UTF-8 text (no lone surrogates)") from None
    return raw


def check_value(value: object, keypath: str, name: str, meta: Mapping) -> None:
    """Choices, range (with the type's default bounds) and the named check of one field."""
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(keypath, value, f"allowed: {', '.join(map(str, choices))}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        _check_range(value, keypath, name, meta)
    if isinstance(value, str) and is_path_field(name):
        check_path(value, keypath)
    check = meta.get("check")
    if check is not None:
        _checks()[check](value, keypath)


def _check_range(value: int | float, keypath: str, name: str, meta: Mapping) -> None:
    low = meta.get("min_value")
    high = meta.get("max_value")
    if high is None:
        high = MAX_BYTES if name.endswith("_bytes") else MAX_INT if isinstance(value, int) else MAX_FLOAT
    if low is not None and value < low:
        what = "must be positive" if low > 0 else f"must be at least {low}"
        raise ConfigError(keypath, value, what)
    if value > high:
        shown = f"{format_bytes(high)} ({high} bytes)" if name.endswith("_bytes") else f"{high}"
        raise ConfigError(keypath, value, f"must be at most {shown}")


PSEUDO_FILE_SYSTEMS = ("/proc", "/sys")  # writable to root by os.access, yet no directory or file can be made there


def check_writable_dir(value: str, keypath: str, probe: str | None = None) -> None:
    """`value` (or, for a file, its directory `probe`) can be made or is a writable directory."""
    probe = check_path(value, keypath) if probe is None else probe
    while not os.path.lexists(probe):
        parent = os.path.dirname(probe.rstrip("/")) if probe.rstrip("/") else "/"
        probe = parent or "."
    if not os.path.isdir(probe):
        raise ConfigError(keypath, value, f"expected a directory; {probe} is not one")
    real = os.path.realpath(probe)
    if any(real == root or real.startswith(root + "/") for root in PSEUDO_FILE_SYSTEMS):
        raise ConfigError(keypath, value, f"expected a writable directory; {real} is on the kernel's "
                                          f"{real.split('/')[1]} pseudo file system, which holds no files")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(keypath, value, f"expected a writable directory; {probe} is not writable")


def check_writable_file(value: str, keypath: str) -> None:
    """A file to append to: not a directory, writable if it exists, else in a directory that can hold it; never a
    symbolic link (whoever made it would choose the file written to)."""
    path = check_path(value, keypath)
    if os.path.islink(path):
        raise ConfigError(keypath, value, "expected a file; it is a symbolic link (it is written to: the link would "
                                          "choose which file)")
    if os.path.isdir(path):
        raise ConfigError(keypath, value, "expected a file; it is a directory")
    if os.path.lexists(path):
        if not os.path.isfile(path):  # a FIFO, a device: the recorder would refuse it at start
            raise ConfigError(keypath, value, "expected a regular file; it is a FIFO, socket or device")
        if not os.access(path, os.W_OK):
            raise ConfigError(keypath, value, "expected a writable file; it is not writable")
        return
    check_writable_dir(value, keypath, probe=os.path.dirname(path.rstrip("/")) or ".")


def check_non_empty(value: str, keypath: str) -> None:
    if not value.strip():
        raise ConfigError(keypath, value, "expected a non-empty string")


_HOST = re.compile(r"^(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?"
                   r"|[0-9A-Fa-f:.]+(?:%[A-Za-z0-9_.-]+)?)$")


def check_host(value: str, keypath: str) -> None:
    """A host name or an IP address to listen on (what the HTTP server's bind would otherwise refuse late)."""
    if not _HOST.match(value) or len(value) > 253:
        raise ConfigError(keypath, value, "expected a host name or an IP address, e.g. 127.0.0.1, localhost or ::1")


MIN_CONTROL_TOKEN_CHARS = 16  # (tierkv.metrics.control checks the TIERKV_CONTROL_TOKEN variable the same way)


def control_token_problem(value: str) -> str | None:
    """Why no client could send `value` as a bearer token, or None: whitespace at an end (a client's token is read
    stripped), fewer than MIN_CONTROL_TOKEN_CHARS characters, or a character that is not printable ASCII (HTTP
    headers carry bytes: the server reads them as latin-1, curl sends UTF-8, Python's client refuses other
    characters and controls). The value itself is never put in the answer."""
    if value != value.strip():
        return ("expected no whitespace at either end (a YAML block scalar keeps its last newline): no client could "
                "send it")
    if len(value) < MIN_CONTROL_TOKEN_CHARS:
        return f"expected at least {MIN_CONTROL_TOKEN_CHARS} characters, got {len(value)}"
    bad = [i for i, c in enumerate(value) if not " " <= c <= "~"]
    if bad:
        return (f"expected printable ASCII characters only (character {bad[0] + 1} is not): an HTTP header cannot "
                "carry it the same way from every client")
    return None


def check_control_token(value: str, keypath: str) -> None:
    """A bearer token a client can send (`control_token_problem`)."""
    problem = control_token_problem(value)
    if problem is not None:
        raise ConfigError(keypath, "<hidden>", problem)


def check_secret(value: str, keypath: str) -> None:
    """At least 16 bytes (UTF-8) besides ASCII whitespace at either end, stripped as a secret file's content is."""
    size = len(value.encode("utf-8", "surrogatepass").strip())
    if size < 16:  # the value itself is never echoed back
        raise ConfigError(keypath, "<hidden>", f"expected at least 16 bytes besides surrounding whitespace, got {size}")


def _checks() -> dict:
    return {"writable_dir": check_writable_dir, "writable_file": check_writable_file, "redis_url": check_redis_url,
            "non_empty": check_non_empty, "secret": check_secret, "control_token": check_control_token,
            "host": check_host}
