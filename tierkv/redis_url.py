"""The Redis tier's URL, checked when the config loads: what redis-py would connect with.

Primitives: `check_redis_url`, `QUERY_PARAMETERS`.

    redis://[[user]:password@]host[:port][/db][?query]     rediss://...  (TLS)
    unix://[[user]:password@]/path/to/socket[?db=N]

The URL goes through redis-py's own parser (`redis.connection.parse_url`) where redis-py is
installed, and its errors become ConfigError. Beyond what that parser checks: the host must be
a name or an IP address (a name that IDNA encodes, no NUL or spaces), the port a number up to
65535, the database a number, and the query may hold only the parameters below (redis-py would
pass any other name to its connection class, which fails when the tier first connects). Socket
timeouts are the tier's `timeout_s`, not query parameters. The password is never echoed.
"""
from __future__ import annotations

import ipaddress
import re
from urllib.parse import parse_qsl, unquote, urlsplit

from tierkv.config_error import ConfigError
from tierkv.config_paths import check_path

EXPECTED = "expected redis://host[:port][/db], rediss://... or unix:///path"
_TLS_PARAMETERS = ("ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_check_hostname")
QUERY_PARAMETERS = ("db", "client_name", *_TLS_PARAMETERS)
_HOST_LABEL = re.compile(r"^[A-Za-z0-9_-]+$")
_CLIENT_NAME = re.compile(r"^[!-~]{1,128}$")  # Redis refuses spaces and newlines in names
_MAX_DB = 2**31 - 1


def check_redis_url(url: str, keypath: str) -> None:
    """ConfigError naming `keypath` unless `url` is one the Redis tier can connect with."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ConfigError(keypath, url, f"{EXPECTED} ({exc})") from None
    scheme = parts.scheme.lower()
    if scheme not in ("redis", "rediss", "unix") or not url.lower().startswith(f"{scheme}://"):
        raise ConfigError(keypath, url, EXPECTED)
    _parse_with_redis_py(url, keypath)
    if scheme == "unix":
        if not parts.path:
            raise ConfigError(keypath, url, f"{EXPECTED}; a unix:// URL needs the socket's path")
        check_path(unquote(parts.path), keypath)
    else:
        _check_host(url, unquote(parts.hostname or ""), keypath)
        db = parts.path.strip("/")
        if db and not (db.isascii() and db.isdigit() and int(db) <= _MAX_DB):
            raise ConfigError(keypath, url, f"{EXPECTED}; database must be a number up to {_MAX_DB}, got {db!r}")
    del port
    _check_query(url, scheme, parts.query, keypath)


def _parse_with_redis_py(url: str, keypath: str) -> None:
    try:
        from redis.connection import parse_url
    except ImportError:  # the tier says redis-py is missing when it is built
        return
    try:
        parse_url(url)
    except (ValueError, TypeError, UnicodeError) as exc:
        raise ConfigError(keypath, url, f"{EXPECTED} (redis-py: {exc})") from None


def _check_host(url: str, host: str, keypath: str) -> None:
    if not host:
        raise ConfigError(keypath, url, f"{EXPECTED}; the host is missing")
    try:
        ipaddress.ip_address(host)
        return
    except ValueError:
        pass
    try:
        ascii_host = host.encode("idna").decode("ascii")
    except UnicodeError as exc:
        raise ConfigError(keypath, url, f"{EXPECTED}; host {host!r} is not a valid name ({exc})") from None
    if len(ascii_host) > 253 or not all(_HOST_LABEL.match(label) for label in ascii_host.rstrip(".").split(".")):
        raise ConfigError(keypath, url, f"{EXPECTED}; host {host!r} is not a valid name")


def _check_query(url: str, scheme: str, query: str, keypath: str) -> None:
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name in ("socket_timeout", "socket_connect_timeout", "timeout"):
            raise ConfigError(keypath, url, f"query parameter '{name}': set the tier's timeout_s instead")
        if name not in QUERY_PARAMETERS:
            raise ConfigError(keypath, url, f"unknown query parameter '{name}'; allowed: {', '.join(QUERY_PARAMETERS)}")
        if name in _TLS_PARAMETERS and scheme != "rediss":
            raise ConfigError(keypath, url, f"query parameter '{name}' needs a rediss:// URL")
        problem = _query_value_problem(name, value)
        if problem:
            raise ConfigError(keypath, url, f"query parameter '{name}': {problem}")


def _query_value_problem(name: str, value: str) -> str | None:
    if name == "db":
        ok = value.isascii() and value.isdigit() and int(value) <= _MAX_DB
        return None if ok else f"a database number up to {_MAX_DB}"
    if name == "client_name":
        return None if _CLIENT_NAME.match(value) else "1 to 128 printable ASCII characters without spaces"
    if name == "ssl_cert_reqs":
        return None if value in ("none", "optional", "required") else "one of none, optional, required"
    if name == "ssl_check_hostname":
        return None if value.lower() in ("true", "false", "yes", "no", "1", "0") else "true or false"
    try:
        check_path(value, name)
    except ConfigError as exc:
        return exc.allowed
    return None
