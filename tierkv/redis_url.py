"""The Redis tier's URL, checked when the config loads: what redis-py would connect with.

Primitives: `check_redis_url`, `QUERY_PARAMETERS`, `is_cluster_url`, `parse_cluster_url`,
`ClusterUrl`, `single_url_problem`, `keyspace`.

    redis://[[user]:password@]host[:port][/db][?query]     rediss://...  (TLS)
    unix://[[user]:password@]/path/to/socket[?db=N]
    redis+cluster://[user:password@]host[:port][,host[:port]...][/0]   a Redis Cluster (or Valkey
                                cluster) found from any of these startup nodes; rediss+cluster:// (TLS)

A cluster URL names its startup nodes (port 6379 when left out), has only database 0 and takes
no query.

The URL goes through redis-py's own parser (`redis.connection.parse_url`) where redis-py is
installed, and its errors become ConfigError. Beyond what that parser checks: the host must be
a name or an IP address (a name that IDNA encodes, no NUL or spaces), the port a number from 1 to
65535, the database a number, and the query may hold only the parameters below (redis-py would
pass any other name to its connection class, which fails when the tier first connects). Socket
timeouts are the tier's `timeout_s`, not query parameters. The password is never echoed.
"""
from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, unquote, urlsplit

from tierkv.config.errors import ConfigError
from tierkv.config.paths import check_path

EXPECTED = ("expected redis://host[:port][/db], rediss://..., unix:///path, or a cluster: "
            "redis+cluster://host[:port][,host[:port]...] (rediss+cluster://...)")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
DEFAULT_PORT = 6379
MAX_PORT = 65535
_TLS_PARAMETERS = ("ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_check_hostname")
QUERY_PARAMETERS = ("db", "client_name", *_TLS_PARAMETERS)
_HOST_LABEL = re.compile(r"^[A-Za-z0-9_-]+$")
_CLIENT_NAME = re.compile(r"^[!-~]{1,128}$")  # Redis refuses spaces and newlines in names
_MAX_DB = 2**31 - 1


def check_redis_url(url: str, keypath: str) -> None:
    """ConfigError naming `keypath` unless `url` is one the Redis tier can connect with. A URL with credentials
    gets a hint in place of what a check found (a '?' or '#' in a password moves it into what the checks quote)."""
    problem = userinfo_problem(url)
    if problem:
        raise ConfigError(keypath, url, f"{EXPECTED}; {problem}")
    try:
        _check_parts(url, keypath)
    except ConfigError as exc:
        if not _quotes_secret(url, exc.allowed):
            raise
        raise ConfigError(keypath, url, f"{EXPECTED}; {_detail(url, exc)}") from None


def _quotes_secret(url: str, message: str) -> bool:
    """Whether `message` holds a piece (2 characters or more) of what may be `url`'s password: everything
    after the first ':' of the text before its last '@'."""
    region = url.partition("://")[2].rpartition("@")[0]
    secret = region.partition(":")[2]
    return any(len(piece) >= 2 and piece in message for piece in re.split(r"[:/?#@&=;,%]", secret))


def _check_parts(url: str, keypath: str) -> None:
    if is_cluster_url(url):
        try:
            nodes = parse_cluster_url(url).startup_nodes
        except ValueError as exc:
            raise ConfigError(keypath, url, f"{EXPECTED}; {_detail(url, exc)}") from None
        for host, _ in nodes:
            _check_host(url, host, keypath)
        return
    try:
        parts = urlsplit(url)
        port_problem = _port_problem(parts)
    except ValueError as exc:
        raise ConfigError(keypath, url, f"{EXPECTED} ({_detail(url, exc)})") from None
    if port_problem:
        raise ConfigError(keypath, url, f"{EXPECTED}; {port_problem}")
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
    _check_query(url, scheme, parts.query, keypath)


def _port_problem(parts) -> str | None:
    """Why the port of a split URL is not one a server listens on (0, or past 65535), or None; ValueError
    for a port that is not a number."""
    try:
        port = parts.port
    except ValueError as exc:
        if "out of range" not in str(exc):
            raise
        return f"the port must be 1 to {MAX_PORT} (got {parts.netloc.rpartition(':')[2][:12]})"
    return f"the port must be 1 to {MAX_PORT} (got 0)" if port == 0 else None


def userinfo_problem(url: str) -> str | None:
    """Why `url`'s user name or password cannot be told from the rest (redis-py would still connect, with a
    password no redaction can find in a log line), or None."""
    if any(c.isspace() for c in url):
        return "a URL takes no whitespace (percent-encode it in a user name or password: %20)"
    _, sep, rest = url.partition("://")
    if not sep or rest.startswith("/"):  # no authority (unix:///path): an '@' there is the path's
        return None
    before_query = rest.split("?", 1)[0].split("#", 1)[0]  # (an '@' in a query value, client_name=a@b, is fine)
    credentials = before_query.rpartition("@")[0]
    if any(c in credentials for c in "@/"):
        return ("its user name or password holds '@' or '/' (or an '@' follows a '/' before the query): "
                "percent-encode them there (%40, %2F)")
    return None


def _detail(url: str, exc: BaseException) -> str:
    """A parser's message about `url`, unless the URL has credentials: then it could quote part of the password
    (a '?' or '#' in it cuts the host and port short), and a hint stands in for it."""
    if "@" in url:
        return ("its host, port, database or query cannot be read as given; percent-encode '@', '/', '?', '#' or ':' "
                "in a user name or password")
    return str(exc)


def _parse_with_redis_py(url: str, keypath: str) -> None:
    try:
        from redis.connection import parse_url
    except ImportError:  # the tier says redis-py is missing when it is built
        return
    try:
        parse_url(url)
    except (ValueError, TypeError, UnicodeError) as exc:
        raise ConfigError(keypath, url, f"{EXPECTED} (redis-py: {_detail(url, exc)})") from None


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


# -- Redis Cluster ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ClusterUrl:
    """A cluster's startup nodes and how to talk to them."""

    startup_nodes: list[tuple[str, int]] = field(default_factory=list)  # (host, port)
    is_tls: bool = False
    username: str | None = None
    password: str | None = None


def is_cluster_url(url: object) -> bool:
    return isinstance(url, str) and url.split("://", 1)[0].lower() in CLUSTER_SCHEMES and "://" in url


def parse_cluster_url(url: str) -> ClusterUrl:
    """The startup nodes of a redis+cluster:// URL; ValueError saying what is wrong (never the password)."""
    scheme, rest = url.split("://", 1)
    netloc, _, tail = rest.partition("/")
    if "?" in netloc or "#" in netloc or "?" in tail or "#" in tail:
        raise ValueError("a cluster URL takes no query or fragment")
    if tail.strip("/") not in ("", "0"):
        raise ValueError(f"a cluster has only database 0, got {tail.strip('/')!r}")
    credentials, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = credentials.partition(":")
        username, password = unquote(user) or None, unquote(secret) if colon else None
    if not hosts:
        raise ValueError("no startup node: expected host[:port][,host[:port]...]")
    nodes = [_host_port(item) for item in hosts.split(",")]
    return ClusterUrl(nodes, scheme.lower().startswith("rediss"), username, password)


def _host_port(item: str) -> tuple[str, int]:
    try:
        parts = urlsplit(f"//{item}")
        problem = _port_problem(parts)
        port = parts.port if problem is None else None
    except ValueError as exc:
        raise ValueError(f"startup node {item!r}: {exc}") from None
    if problem:
        raise ValueError(f"startup node {item!r}: {problem}")
    if not parts.hostname:
        raise ValueError(f"startup node {item!r} has no host")
    return unquote(parts.hostname), DEFAULT_PORT if port is None else port


def keyspace(url: str) -> tuple:
    """(nodes, database) a checked Redis URL stores into, the credentials and TLS left out: redis://h and
    redis://:pw@H:6379/0 are one keyspace (a cluster: its startup nodes, in any order)."""
    if is_cluster_url(url):
        return tuple(sorted((host.lower(), port) for host, port in parse_cluster_url(url).startup_nodes)), 0
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    if parts.scheme == "unix":
        return (parts.path,), int(query.get("db", 0))
    return ((parts.hostname, parts.port or DEFAULT_PORT),), int(parts.path.strip("/") or query.get("db", 0))


def single_url_problem(url: object) -> str | None:
    """What makes a one-server URL unusable by the tier (the config loader checks more), or None."""
    if not isinstance(url, str):
        return "not a string"
    problem = userinfo_problem(url)
    if problem:
        return problem
    try:
        parts = urlsplit(url)
        _ = parts.port  # raises ValueError for a bad port
    except ValueError as exc:
        return str(exc)
    db = parts.path.strip("/")
    if parts.scheme in ("redis", "rediss"):
        if not parts.hostname:
            return "no host"
        if db and not db.isdigit():
            return f"database {db!r} is not a number"
    elif parts.scheme == "unix":
        return None if parts.path else "no socket path"
    return None
