"""Redis tier: blocks shared across processes and hosts, normally the last tier of a chain.

Primitives: `RedisTier`.

    Redis key   f"{namespace}:{key}"
    Redis value codec.encode_block_bytes(key, block)   (format version, shape, dtype, crc32)

Every operation is a batch on the wire: get_many is MGET, put_many a pipeline of SET (PX when
ttl_s is set), contains_many a pipeline of EXISTS, remove_many a pipeline of DEL; the
single-block forms are batches of one. Batches are split so that one round trip carries at most
about 64 MiB. The SETs are framed here (`_send_sets`), so that each value goes out as its
header and the caller's payload buffer, never joined into one copy; get_many decodes each MGET
round trip into one fresh tensor, whose rows it returns.

Failures never reach the caller. A connection error or timeout marks the tier unhealthy for
`retry_interval_s`; meanwhile every operation answers at once (misses, PutResult(ok=False),
False) without touching the network. Each failed or skipped call counts one `errors`; each
block not stored counts one `put_failures`. After the interval the next call tries again and a
success makes the tier healthy. A value that fails to decode is a miss, counted as
`corrupt_blocks`, and deleted.

Capacity: this client keeps an LRU of the keys it wrote and, with `capacity_bytes` set,
deletes the oldest once they pass capacity_bytes // layout.num_bytes blocks; evicted data is
not returned (this is normally the last tier). `used_bytes` counts those keys in block bytes
(layout.num_bytes each, like the byte counters; keys other clients wrote are not counted).
Redis's own maxmemory policy and TTLs still apply on the server.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any, Callable, Sequence
from urllib.parse import urlsplit

import torch

from tierkv.blocks import BlockLayout
from tierkv.redact import redact_text, redact_url
from tierkv.storage.base import PutResult, StorageTier, TierError
from tierkv.storage.codec import CorruptBlock, decode_block_into, encode_block

logger = logging.getLogger(__name__)

_BATCH_BYTES = 64 << 20  # at most this many value bytes per round trip


class RedisTier(StorageTier):
    """Blocks in a Redis server at `url` (redis://, rediss:// or unix://), under `namespace`."""

    kind = "redis"

    def __init__(
        self,
        name: str,
        layout: BlockLayout,
        capacity_bytes: int | None,
        url: str,
        namespace: str = "tierkv",
        ttl_s: float | None = None,
        timeout_s: float = 0.5,
        retry_interval_s: float = 2.0,
    ):
        _check_params(name, layout, capacity_bytes, namespace, ttl_s, timeout_s, retry_interval_s)
        super().__init__(name, layout, capacity_bytes)
        redis = _import_redis()
        self.url = url
        self.namespace = namespace
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.retry_interval_s = retry_interval_s
        self.last_error: str | None = None
        self._client = _connect(redis, url, timeout_s)
        self._link_errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
        self._redis_error = redis.exceptions.RedisError
        self._response_error = redis.exceptions.ResponseError
        self._ttl_ms = None if ttl_s is None else max(1, round(ttl_s * 1000))
        self._batch_len = max(1, _BATCH_BYTES // (layout.num_bytes + 256))
        self.max_blocks = None if capacity_bytes is None else capacity_bytes // layout.num_bytes
        self._written: OrderedDict[str, float | None] = OrderedDict()  # key -> expiry, oldest first
        self._down_until: float | None = None
        self._closed = False
        self._call(lambda client: client.ping())  # a dead server starts us unhealthy; never raises

    # -- StorageTier ---------------------------------------------------------------------
    def contains(self, key: str) -> bool:
        return self.contains_many([key])[0]

    def get(self, key: str) -> torch.Tensor | None:
        return self.get_many([key])[0]

    def put(self, key: str, block: torch.Tensor) -> PutResult:
        return self.put_many([key], [block])[0]

    def remove(self, key: str) -> bool:
        return self.remove_many([key])[0]

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        return [bool(n) for n in self._per_key_pipeline("exists", keys, default=0)]

    def remove_many(self, keys: Sequence[str]) -> list[bool]:
        removed = [bool(n) for n in self._per_key_pipeline("delete", keys, default=0)]
        self._forget([k for k, was in zip(keys, removed) if was])
        self.counters.add(removes=sum(removed))
        return removed

    def get_many(self, keys: Sequence[str]) -> list[torch.Tensor | None]:
        """Hits are rows of one fresh tensor per round trip, which the caller owns; None for a miss."""
        self._check_open()
        blocks: list[torch.Tensor | None] = [None] * len(keys)
        with self.counters.timed("get"):
            answered, corrupt = [], []
            for start in range(0, len(keys), self._batch_len):
                chunk = [self._redis_key(k) for k in keys[start : start + self._batch_len]]
                ok, values = self._call(lambda client: client.mget(chunk))
                if not ok:
                    break
                answered += range(start, start + len(chunk))
                found = [(i, value) for i, value in enumerate(values, start) if value is not None]
                for (i, value), row in zip(found, self.layout.empty(len(found)).unbind(0)):
                    try:
                        decode_block_into(keys[i], value, row)
                        blocks[i] = row
                    except CorruptBlock as exc:
                        logger.warning("%s: dropping corrupt value: %s", self.name, exc)
                        corrupt.append(keys[i])
            num_hits = sum(b is not None for b in blocks)
            self.counters.record_lookups(num_hits, len(keys) - num_hits, num_hits * self.layout.num_bytes)
            self._touch([keys[i] for i in answered if blocks[i] is not None])
            self._forget([keys[i] for i in answered if blocks[i] is None])
            if corrupt:
                self.counters.add(corrupt_blocks=len(corrupt))
                self._call(lambda client: client.delete(*map(self._redis_key, corrupt)))
        return blocks

    def put_many(self, keys: Sequence[str], blocks: Sequence[torch.Tensor]) -> list[PutResult]:
        if len(keys) != len(blocks):
            raise ValueError(f"put_many: {len(keys)} keys but {len(blocks)} blocks")
        for key, block in zip(keys, blocks):
            self._check_block(key, block)
        self._check_open()
        results: list[PutResult] = []
        with self.counters.timed("put"):
            for start in range(0, len(keys), self._batch_len):
                chunk_keys = keys[start : start + self._batch_len]
                values = [encode_block(k, b) for k, b in zip(chunk_keys, blocks[start : start + self._batch_len])]
                ok, replies = self._call(lambda client: self._send_sets(client, chunk_keys, values))
                if not ok:
                    error = f"{self.name}: redis unavailable ({self.last_error})"
                    results += [PutResult(False, error) for _ in range(len(keys) - start)]
                    break
                results += [self._put_result(k, reply) for k, reply in zip(chunk_keys, replies)]
            num_failed = sum(not r.ok for r in results)
            self.counters.add(puts=len(results) - num_failed, put_failures=num_failed)
            self._evict_over_capacity()
        return results

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._client.close()

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return len(self._written) * self.layout.num_bytes

    @property
    def is_healthy(self) -> bool:
        with self._lock:
            return self._down_until is None or time.monotonic() >= self._down_until

    # -- wire --------------------------------------------------------------------------------
    def _call(self, op: Callable[[Any], Any]) -> tuple[bool, Any]:
        """(True, op(client)), or (False, None) with the failure counted; never raises a Redis error."""
        if not self.is_healthy:
            self.counters.add(errors=1)
            return False, None
        try:
            result = op(self._client)
        except self._link_errors as exc:
            self._mark_down(exc)
            return False, None
        except self._redis_error as exc:
            self.last_error = redact_text(f"{type(exc).__name__}: {exc}")
            logger.warning("%s: redis error: %s", self.name, self.last_error)
            self.counters.add(errors=1)
            return False, None
        if self._down_until is not None:
            with self._lock:
                self._down_until = None
            logger.info("%s: redis at %s is reachable again", self.name, redact_url(self.url))
        return True, result

    def _mark_down(self, exc: BaseException) -> None:
        self.last_error = redact_text(f"{type(exc).__name__}: {exc}")
        with self._lock:
            was_up = self._down_until is None
            self._down_until = time.monotonic() + self.retry_interval_s
        if was_up:
            logger.warning(
                "%s: redis at %s unreachable, retry in %.1fs: %s", self.name, redact_url(self.url), self.retry_interval_s,
                redact_text(str(exc)),
            )
        self.counters.add(errors=1)

    def _per_key_pipeline(self, command: str, keys: Sequence[str], default: Any) -> list[Any]:
        self._check_open()
        replies: list[Any] = []
        for start in range(0, len(keys), self._batch_len):
            chunk = keys[start : start + self._batch_len]

            def send(client: Any) -> list[Any]:
                pipe = client.pipeline(transaction=False)
                for key in chunk:
                    getattr(pipe, command)(self._redis_key(key))
                return pipe.execute(raise_on_error=False)

            ok, chunk_replies = self._call(send)
            if not ok:
                return replies + [default] * (len(keys) - start)
            replies += [default if isinstance(r, Exception) else r for r in chunk_replies]
        return replies

    def _send_sets(self, client: Any, keys: Sequence[str], values: list[list]) -> list[Any]:
        """Pipelined SETs of values given as buffers ([header, payload]); one reply (or error) per key.

        redis-py would join each value into one bytes object first (a block-sized copy); here the
        RESP frames are written around the buffers on a pooled connection, and the replies read
        the way redis-py's pipeline reads them. A link error drops the connection and propagates.
        """
        px = b"" if self._ttl_ms is None else b"$2\r\nPX\r\n$%d\r\n%d\r\n" % (len(str(self._ttl_ms)), self._ttl_ms)
        frames: list[Any] = []
        for key, parts in zip(keys, values):
            name = self._redis_key(key).encode()
            num_bytes = sum(memoryview(part).nbytes for part in parts)
            frames.append(b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (5 if px else 3, len(name), name, num_bytes))
            frames += parts
            frames.append(b"\r\n" + px)
        pool = client.connection_pool
        connection = pool.get_connection()
        try:
            connection.send_packed_command(frames)
            replies: list[Any] = []
            for _ in keys:
                try:
                    replies.append(connection.read_response())
                except self._response_error as exc:  # this SET failed; its reply is consumed
                    replies.append(exc)
            return replies
        except BaseException:
            connection.disconnect()  # replies may be left unread: never reuse this socket
            raise
        finally:
            pool.release(connection)

    def _put_result(self, key: str, reply: Any) -> PutResult:
        if isinstance(reply, Exception):
            self.counters.add(errors=1)
            return PutResult(False, f"{self.name}: SET {key} failed: {reply}")
        with self._lock:
            self._written.pop(key, None)
            self._written[key] = None if self.ttl_s is None else time.monotonic() + self.ttl_s
        self.counters.add(bytes_written=self.layout.num_bytes)
        return PutResult(True)

    # -- client-side LRU ---------------------------------------------------------------------
    def _evict_over_capacity(self) -> None:
        """Drop expired entries, then delete the oldest keys this client wrote while over capacity."""
        now = time.monotonic()
        victims = []
        with self._lock:
            while self._written:
                key, expiry = next(iter(self._written.items()))
                expired = expiry is not None and expiry <= now
                if not expired and (self.max_blocks is None or len(self._written) <= self.max_blocks):
                    break
                del self._written[key]
                if not expired:
                    victims.append(key)
        if victims:
            self.counters.add(evictions=len(victims))
            self._call(lambda client: client.delete(*map(self._redis_key, victims)))

    def _touch(self, keys: list[str]) -> None:
        with self._lock:
            for key in keys:
                if key in self._written:
                    self._written.move_to_end(key)

    def _forget(self, keys: list[str]) -> None:
        with self._lock:
            for key in keys:
                self._written.pop(key, None)

    # -- helpers -------------------------------------------------------------------------------
    def _redis_key(self, key: str) -> str:
        return f"{self.namespace}:{key}"

    def _check_open(self) -> None:
        if self._closed:
            raise TierError(f"{self.name}: tier is closed")


def _check_params(name, layout, capacity_bytes, namespace, ttl_s, timeout_s, retry_interval_s) -> None:
    if capacity_bytes is not None and (not isinstance(capacity_bytes, int) or capacity_bytes < layout.num_bytes):
        raise ValueError(
            f"{name}: capacity_bytes={capacity_bytes!r}; must be None or at least one block ({layout.num_bytes})"
        )
    if not isinstance(namespace, str) or not namespace:
        raise ValueError(f"{name}: namespace={namespace!r}; must be a non-empty string")
    if ttl_s is not None and not ttl_s > 0:
        raise ValueError(f"{name}: ttl_s={ttl_s!r}; must be None or > 0")
    if not timeout_s > 0:
        raise ValueError(f"{name}: timeout_s={timeout_s!r}; must be > 0")
    if not retry_interval_s >= 0:
        raise ValueError(f"{name}: retry_interval_s={retry_interval_s!r}; must be >= 0")


def _import_redis() -> Any:
    try:
        import redis
    except ImportError as exc:
        raise TierError(f"the Redis tier needs redis-py: pip install tierkv-runtime[redis] ({exc})") from exc
    return redis


def _connect(redis: Any, url: str, timeout_s: float) -> Any:
    """A client with one try per command (no retries: the tier's health logic decides)."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    problem = None
    if not isinstance(url, str):
        problem = "not a string"
    else:
        try:
            parts = urlsplit(url)
            _ = parts.port  # raises ValueError for a bad port
            if parts.scheme in ("redis", "rediss") and not parts.hostname:
                problem = "no host"
            elif parts.scheme in ("redis", "rediss") and parts.path.strip("/") and not parts.path.strip("/").isdigit():
                problem = f"database {parts.path.strip('/')!r} is not a number"
            elif parts.scheme == "unix" and not parts.path:
                problem = "no socket path"
        except ValueError as exc:
            problem = str(exc)
    if problem is None:
        try:
            return redis.Redis.from_url(
                url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
            )
        except ValueError as exc:
            problem = str(exc)
    expected = "redis://host:port/db, rediss://host:port/db or unix:///path"
    raise ValueError(redact_text(f"malformed Redis url {url!r}: {problem}; expected {expected}"))
