"""Redis tier URLs: one server, or a Redis Cluster (Valkey speaks the same protocol).

Primitives: `RedisUrl`, `parse_redis_url`, `URL_FORMS`.

    redis://[user:password@]host[:port][/db]     one server (rediss:// for TLS)
    unix:///path/to/socket[?db=N]                 one server on a local socket
    redis+cluster://[user:password@]host[:port][,host[:port]...][/0]
                                                  a cluster, found from any of these startup
                                                  nodes (rediss+cluster:// for TLS)

The port defaults to 6379. A cluster has only database 0. Nothing here imports redis: the
config loader checks URLs with `parse_redis_url` before any tier is built.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

URL_FORMS = ("redis://host[:port][/db], rediss://host[:port][/db], unix:///path, or "
             "redis+cluster://host[:port][,host[:port]...] (rediss+cluster:// for TLS)")
_CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
DEFAULT_PORT = 6379


@dataclass(frozen=True)
class RedisUrl:
    """A checked URL: `is_cluster` with its `startup_nodes`, or one server (`url` as given)."""

    url: str
    is_cluster: bool
    startup_nodes: list[tuple[str, int]] = field(default_factory=list)  # (host, port), cluster only
    is_tls: bool = False
    username: str | None = None
    password: str | None = None


def parse_redis_url(url: object) -> RedisUrl:
    """The parsed URL, or ValueError saying what is wrong (the message leaves out the URL's credentials)."""
    if not isinstance(url, str) or not url:
        raise ValueError("not a non-empty string")
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme in _CLUSTER_SCHEMES:
        return _parse_cluster(url, scheme)
    try:
        parts = urlsplit(url)
        _ = parts.port  # raises ValueError for a bad port
    except ValueError as exc:
        raise ValueError(str(exc)) from None
    if parts.scheme == "unix":
        if not parts.path:
            raise ValueError("no socket path")
    elif parts.scheme in ("redis", "rediss"):
        if not parts.hostname:
            raise ValueError("no host")
        db = parts.path.strip("/")
        if db and not db.isdigit():
            raise ValueError(f"database {db!r} is not a number")
    else:
        raise ValueError(f"unknown scheme {parts.scheme!r}")
    return RedisUrl(url=url, is_cluster=False, is_tls=parts.scheme == "rediss")


def _parse_cluster(url: str, scheme: str) -> RedisUrl:
    rest = url.split("://", 1)[1]
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
    return RedisUrl(url=url, is_cluster=True, startup_nodes=nodes, is_tls=scheme.startswith("rediss"),
                    username=username, password=password)


def _host_port(item: str) -> tuple[str, int]:
    try:
        parts = urlsplit(f"//{item}")
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"startup node {item!r}: {exc}") from None
    if not parts.hostname:
        raise ValueError(f"startup node {item!r} has no host")
    return parts.hostname, DEFAULT_PORT if port is None else port
