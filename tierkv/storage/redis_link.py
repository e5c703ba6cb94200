"""The wire under the Redis tier: one server (`SingleLink`; a cluster: `redis_cluster.ClusterLink`).

Primitives: `KeyFailed`, `Unavailable`, `NodeHealth`, `LinkBase`, `SingleLink`, `send_sets`,
`import_redis`.

A link answers per key: every batch method returns one entry per name, the reply or an
exception instance. `KeyFailed` (and its subclass `Unavailable`: the key's node could not be
reached, or was skipped while marked down) means the call that carried the key failed and the
link has counted it already (one `on_error()` per failed or skipped call); any other exception
is a per-key error reply (a SET the server refused) for the caller to count. Links never raise
a Redis error.

Health is per node: a connection error or timeout marks the node down for retry_interval_s;
meanwhile its calls are skipped (Unavailable at once, no network); the next call after that
tries again and a success marks it up.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Sequence

from tierkv.redact import redact_text
from tierkv.storage.base import TierError

logger = logging.getLogger(__name__)


class KeyFailed(Exception):
    """The call that carried this key failed; already counted as one `errors` for the whole call."""


class Unavailable(KeyFailed):
    """The key's node was unreachable, or skipped while marked down."""


def import_redis() -> Any:
    try:
        import redis
    except ImportError as exc:
        raise TierError(f"the Redis tier needs redis-py: pip install tierkv-runtime[redis] ({exc})") from exc
    return redis


class NodeHealth:
    """Which nodes are marked down, and until when (monotonic seconds)."""

    def __init__(self, retry_interval_s: float):
        self.retry_interval_s = retry_interval_s
        self._down_until: dict[str, float] = {}
        self._lock = threading.Lock()

    def is_up(self, node: str) -> bool:
        with self._lock:
            until = self._down_until.get(node)
            return until is None or time.monotonic() >= until

    def mark_down(self, node: str) -> bool:
        """Skip `node` for retry_interval_s; True if it was up."""
        with self._lock:
            was_up = node not in self._down_until
            self._down_until[node] = time.monotonic() + self.retry_interval_s
            return was_up

    def mark_up(self, node: str) -> bool:
        """True if `node` was marked down."""
        with self._lock:
            return self._down_until.pop(node, None) is not None

    def down_nodes(self) -> list[str]:
        """Nodes marked down whose retry interval has not passed."""
        now = time.monotonic()
        with self._lock:
            return sorted(node for node, until in self._down_until.items() if now < until)


class LinkBase:
    """Per-node calls with health tracking and error counting, shared by both links."""

    def __init__(self, tier_name: str, redis: Any, retry_interval_s: float, on_error: Callable[[], None]):
        self.tier_name = tier_name
        self.health = NodeHealth(retry_interval_s)
        self.last_error: str | None = None
        self._on_error = on_error
        self._link_errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
        self._redis_error = redis.exceptions.RedisError
        self._response_error = redis.exceptions.ResponseError

    def _call_node(self, node: str, num_keys: int, op: Callable[[], list[Any]]) -> list[Any]:
        """op() (one entry per key) on `node`, or num_keys KeyFailed entries with the failure counted."""
        if not self.health.is_up(node):
            self._on_error()
            return [Unavailable(f"{node} is down: {self.last_error}")] * num_keys
        try:
            replies = op()
        except self._link_errors as exc:
            self._mark_down(node, exc)
            return [Unavailable(self.last_error)] * num_keys
        except self._redis_error as exc:
            self.last_error = redact_text(f"{node}: {type(exc).__name__}: {exc}")  # which node, whatever redis-py says
            logger.warning("%s: redis error from %s", self.tier_name, self.last_error)
            self._on_error()
            return [KeyFailed(self.last_error)] * num_keys
        if self.health.mark_up(node):
            logger.info("%s: redis at %s is reachable again", self.tier_name, node)
        return replies

    def _mark_down(self, node: str, exc: BaseException) -> None:
        # the node leads: redis-py's message names it for a refused connection, not for a broken pipe
        self.last_error = redact_text(f"{node}: {type(exc).__name__}: {exc}")
        refused = type(exc).__name__ in ("AuthenticationError", "AuthenticationWrongNumberOfArgsError")
        if self.health.mark_down(node):
            what = ("refused this tier's credentials (the url's user and password; retried, as a server's users can "
                    "change)" if refused else "unreachable")
            logger.warning("%s: redis at %s %s, retry in %.1fs: %s",
                           self.tier_name, redact_text(node), what, self.health.retry_interval_s, self.last_error)
        self._on_error()

    def _per_key_pipeline(self, client: Any, command: str, names: Sequence[str],
                          args: Sequence[Any] | None = None) -> list[Any]:
        pipe = client.pipeline(transaction=False)
        for i, name in enumerate(names):
            for call in key_calls(command, name, None if args is None else args[i]):
                pipe.execute_command(*call)
        return group_replies(command, pipe.execute(raise_on_error=False))


# Deletes that race no writer: a key goes only while it still holds what its reader found bad (another
# process may have stored the block there since the read: a plain DEL would drop a block its put was told
# stored). A server without scripting answers an error: the key stays, counted, reads of it miss, and the
# tier no longer counts it held (RedisTier._drop_bad).
_DROP_IF_SAME = "if redis.sha1hex(redis.call('GET', KEYS[1]) or '') == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
_DROP_IF_NOT_STRING = ("local t = redis.call('TYPE', KEYS[1])['ok'] "
                       "if t ~= 'string' and t ~= 'none' then return redis.call('DEL', KEYS[1]) end return 0")


def key_calls(command: str, name: str, arg: Any = None) -> list[tuple]:
    """The wire commands of one key's `command`: get, bounded_get (STRLEN and GETRANGE), delete, type, held (STRLEN
    and PTTL), drop_if_same
    (arg: the SHA-1 hex of the bad value), drop_if_not_string."""
    if command == "held":
        return [("STRLEN", name), ("PTTL", name)]
    if command == "bounded_get":  # arg: the most bytes a block's value holds; a longer value is never sent whole
        return [("STRLEN", name), ("GETRANGE", name, 0, max(int(arg or 1), 1) - 1)]
    if command == "drop_if_same":
        return [("EVAL", _DROP_IF_SAME, 1, name, arg)]
    if command == "drop_if_not_string":
        return [("EVAL", _DROP_IF_NOT_STRING, 1, name)]
    return [({"get": "GET", "delete": "DEL", "type": "TYPE"}[command], name)]


def group_replies(command: str, replies: Sequence[Any]) -> list[Any]:
    """One entry per key: the reply, or for a command of several calls the tuple of their replies (the first
    error reply among them instead, if any)."""
    width = len(key_calls(command, ""))
    if width == 1:
        return list(replies)
    grouped = []
    for start in range(0, len(replies), width):
        part = tuple(replies[start : start + width])
        grouped.append(next((r for r in part if isinstance(r, Exception)), part))
    return grouped


class SingleLink(LinkBase):
    """One redis-server at `url`; one try per command (no retries: the health logic decides)."""

    def __init__(self, tier_name: str, url: str, timeout_s: float, retry_interval_s: float,
                 on_error: Callable[[], None]):
        redis = import_redis()
        super().__init__(tier_name, redis, retry_interval_s, on_error)
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.node = redact_text(url)  # how logs and down_nodes name the server
        self._client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
        )

    @property
    def is_healthy(self) -> bool:
        return self.health.is_up(self.node)

    def down_nodes(self) -> list[str]:
        return self.health.down_nodes()

    def ping(self) -> None:
        """Reach the server (a dead one starts the tier unhealthy); ValueError if it runs in cluster mode, where
        every batch of keys over several slots would fail (CROSSSLOT, MOVED)."""
        if isinstance(self._call_node(self.node, 1, lambda: [self._client.ping()])[0], KeyFailed):
            return
        try:
            enabled = self._client.info("cluster").get("cluster_enabled")
        except (self._redis_error, OSError):  # INFO renamed or refused (a managed server): nothing to tell
            return
        if str(enabled) == "1":
            raise ValueError(f"{self.tier_name}: {self.node} is a Redis Cluster node; a cluster's url is "
                             "redis+cluster://host:port,host:port (any of its nodes)")

    def get_many(self, names: Sequence[str]) -> list[Any]:
        return self._call_node(self.node, len(names), lambda: self._client.mget(names))

    def per_key(self, command: str, names: Sequence[str], args: Sequence[Any] | None = None) -> list[Any]:
        return self._call_node(self.node, len(names),
                               lambda: self._per_key_pipeline(self._client, command, names, args))

    def set_many(self, names: Sequence[str], values: Sequence[list], ttl_ms: int | None) -> list[Any]:
        op = lambda: send_sets(self._client.connection_pool, names, values, ttl_ms, self._response_error)  # noqa: E731
        return self._call_node(self.node, len(names), op)

    def close(self) -> None:
        self._client.close()


def send_sets(pool: Any, names: Sequence[str], values: Sequence[list], ttl_ms: int | None,
              response_error: type) -> list[Any]:
    """Pipelined SETs of values given as buffers ([header, payload]); one reply (or error) per name.

    redis-py would join each value into one bytes object first (a block-sized copy); here the
    RESP frames are written around the buffers on a connection of `pool`, and the replies read
    the way redis-py's pipeline reads them. A link error drops the connection and propagates.
    """
    px = b"" if ttl_ms is None else b"$2\r\nPX\r\n$%d\r\n%d\r\n" % (len(str(ttl_ms)), ttl_ms)
    frames: list[Any] = []
    for name, parts in zip(names, values):
        encoded = name.encode()
        num_bytes = sum(memoryview(part).nbytes for part in parts)
        frames.append(b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (5 if px else 3, len(encoded), encoded, num_bytes))
        frames += parts
        frames.append(b"\r\n" + px)
    connection = pool.get_connection()
    try:
        connection.send_packed_command(frames)
        replies: list[Any] = []
        for _ in names:
            try:
                replies.append(connection.read_response())
            except response_error as exc:  # this SET failed; its reply is consumed
                replies.append(exc)
        return replies
    except BaseException:
        connection.disconnect()  # replies may be left unread: never reuse this socket
        raise
    finally:
        pool.release(connection)
