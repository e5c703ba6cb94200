"""Redis tier: blocks shared across processes and hosts, normally the last tier of a chain.

Primitives: `RedisTier` (its read path: `redis_reads.RedisReads`).

    Redis key   f"{namespace}:{key}"
    Redis value codec.encode_block_bytes(key, block)   (format version, shape, dtype, crc32)

The wire is a link (`redis_link.SingleLink` for one server; `redis_cluster.ClusterLink` for
a Redis Cluster, url redis+cluster://host:port,...), chosen by the URL. Every operation is a
batch on the wire: get_many a pipeline of STRLEN and GETRANGE (per node, in a cluster) that sends at most
four blocks' bytes of a value (one planted at hundreds of MB is a counted miss, not read whole), put_many
pipelined SETs (PX when ttl_s is set), contains_many a pipeline of STRLEN and PTTL, remove_many
a pipeline of DEL; the single-block forms are batches of one. A key holds a block for
contains_many only as a string of the length a block of this layout encodes to under it, whose
expiry (if the server has one for it) is not within the last 30 s or half of ttl_s, whichever is
shorter (a lookup's blocks are read soon after): a value another writer
left damaged, of another layout or type, or about to expire is not held, so a chain writes the
block there again instead of skipping it. Batches are split so that one
round trip carries at most about 64 MiB. The SETs are framed by `redis_link.send_sets`, so
that each value goes out as its header and the caller's payload buffer, never joined into one
copy; get_many decodes each round trip into one fresh tensor, whose rows it returns.

Failures never reach the caller. A connection error or timeout marks the node down for
`retry_interval_s` (one server: the whole tier, `is_healthy` False; a cluster: that node, and
the tier stays healthy while any primary is up); meanwhile calls for it answer at once
(misses, PutResult(ok=False), False) without touching the network. Each failed or skipped
call counts one `errors`; each block not stored counts one `put_failures`. After the interval
the next call tries again and a success marks the node up. A SET that gets an error reply of its
own (OOM: maxmemory reached under noeviction; READONLY: a replica) fails that put, logged (one
line per 10 s) and kept as `last_error`; the tier stays healthy, its reads still served.
A value that fails to decode is a miss, counted as `corrupt_blocks`, and deleted; so is a key
that holds another Redis type (a list, a hash: its STRLEN answers WRONGTYPE).
An intact block of another layout under a key is a miss counted as `foreign_records` and deleted
too: block addresses name the tiers' storage formats, so only an older writer puts one there.
Each such delete is a script that deletes the key only while it still holds the value read (or
another type): another process may have stored the block there since.

Capacity: this client keeps an LRU of the keys it wrote and, with `capacity_bytes` set,
deletes the oldest once they pass capacity_bytes // layout.num_bytes blocks; evicted data is
not returned (this is normally the last tier). `used_bytes` counts those keys in block bytes
(layout.num_bytes each, like the byte counters; keys other clients wrote are not counted).
Redis's own maxmemory policy and TTLs still apply on the server.
"""
from __future__ import annotations

import hashlib
import logging
from typing import Any, Sequence

import torch

from tierkv.blocks import BlockLayout
from tierkv.redact import redact_text
from tierkv.redis_url import is_cluster_url, parse_cluster_url, single_url_problem
from tierkv.storage.base import PutResult, StorageTier, TierError
from tierkv.storage.codec import encode_block, encode_block_bytes, header_num_bytes
from tierkv.storage.log_limit import LimitedWarning
from tierkv.storage.redis_link import KeyFailed, SingleLink, Unavailable
from tierkv.storage.redis_reads import RedisReads, is_wrong_type
from tierkv.storage.redis_written import BoundedKeys, WrittenKeys

logger = logging.getLogger(__name__)

_BATCH_BYTES = 64 << 20  # at most this many value bytes per round trip
_EXPIRING_MS = 30_000  # a key this close to its expiry does not hold a block (contains_many)


class RedisTier(RedisReads, StorageTier):
    """Blocks in a Redis server or cluster at `url` (see `redis_url`), under `namespace`."""

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
        self.url = url
        self.namespace = namespace
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.retry_interval_s = retry_interval_s
        self._link = _connect(name, url, timeout_s, retry_interval_s, lambda: self.counters.add(errors=1))
        self._ttl_ms = None if ttl_s is None else max(1, round(ttl_s * 1000))
        self._batch_len = max(1, _BATCH_BYTES // (layout.num_bytes + 256))
        self.max_blocks = None if capacity_bytes is None else capacity_bytes // layout.num_bytes
        # a key expiring sooner is not held (rewritten, its TTL renewed); short, so reuse keeps nearly all of ttl_s
        self._min_pttl_ms = 1 if self._ttl_ms is None else min(self._ttl_ms // 2, _EXPIRING_MS)
        self._written = WrittenKeys(self.max_blocks, ttl_s)  # this client's keys, for capacity_bytes
        self._kept_bad = BoundedKeys()  # bad values a server without scripting kept: not held
        self._closed = False
        self._corrupt_log = LimitedWarning(logger)  # a namespace full of bad values: one line per 10 s
        self._put_error_log = LimitedWarning(logger)
        self._key_error: tuple[str | None, str] | None = None  # (the link's last_error then, a SET's error reply)
        try:
            self._link.ping()  # a dead server starts us unhealthy; a cluster node's url raises ValueError
        except ValueError:
            self._link.close()  # the connection this refused start opened
            raise

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
        return [self._holds(k, reply) and k not in self._kept_bad for k, reply in zip(keys, self._per_key("held", keys))]

    def remove_if_held(self, keys: Sequence[str], blocks: Sequence[torch.Tensor]) -> None:
        """Delete each key only while it still holds exactly this block (as read: a sealed block that failed its
        check), not a block another writer stored there since."""
        digests = [hashlib.sha1(encode_block_bytes(k, b)).hexdigest() for k, b in zip(keys, blocks)]
        self._written.forget(list(keys))
        self._drop_bad("drop_if_same", list(keys), digests)

    def remove_many(self, keys: Sequence[str]) -> list[bool]:
        removed = [bool(n) for n in self._per_key("delete", keys)]
        self._written.forget([k for k, was in zip(keys, removed) if was])
        self.counters.add(removes=sum(removed))
        return removed

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
                replies = self._link.set_many([self._redis_key(k) for k in chunk_keys], values, self._ttl_ms)
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
        self._link.close()

    @property
    def used_bytes(self) -> int:
        return len(self._written) * self.layout.num_bytes

    @property
    def is_healthy(self) -> bool:
        return self._link.is_healthy

    @property
    def last_error(self) -> str | None:
        """The latest failure: a SET's error reply (OOM, READONLY) unless the link failed since (a node down, a
        call refused: the link makes a new string for each, so `is` tells whether it changed)."""
        link_error = self._link.last_error
        if self._key_error is not None and self._key_error[0] is link_error:
            return self._key_error[1]
        return link_error

    @property
    def down_nodes(self) -> list[str]:
        """Servers (host:port; one server: its url) marked down whose retry interval has not passed."""
        return self._link.down_nodes()

    # -- wire --------------------------------------------------------------------------------
    def _per_key(self, command: str, keys: Sequence[str], args: Sequence[Any] | None = None,
                 keep_errors: bool = False) -> list[Any]:
        """One reply per key (0 for a key whose call failed, unless keep_errors) of a `redis_link.key_calls`
        command."""
        self._check_open()
        replies: list[Any] = []
        for start in range(0, len(keys), self._batch_len):
            names = [self._redis_key(k) for k in keys[start : start + self._batch_len]]
            chunk = self._link.per_key(command, names, None if args is None else args[start : start + self._batch_len])
            self._count_key_errors(chunk)
            replies += chunk if keep_errors else [0 if isinstance(r, Exception) else r for r in chunk]
        return replies

    def _count_key_errors(self, replies: Sequence[Any]) -> None:
        """Error replies of single keys (calls that failed as a whole were counted by the link; a key of another
        Redis type is no failure: it is counted as corrupt where found)."""
        num = sum(isinstance(r, Exception) and not isinstance(r, KeyFailed) and not is_wrong_type(r) for r in replies)
        if num:
            self.counters.add(errors=num)

    def _put_result(self, key: str, reply: Any) -> PutResult:
        if isinstance(reply, Unavailable):
            return PutResult(False, f"{self.name}: redis unavailable ({reply})", retry=True)
        if isinstance(reply, KeyFailed):
            return PutResult(False, f"{self.name}: SET {key} failed: {reply}")
        if isinstance(reply, Exception):  # this key's own error reply: OOM (maxmemory, noeviction), READONLY
            self.counters.add(errors=1)
            error = redact_text(f"{self.name}: SET {key} failed: {type(reply).__name__}: {reply}")
            # a full server refuses every SET: one line per 10 s; seen in last_error until the link fails anew
            self._put_error_log.note("%s (counted in put_failures)", error)
            self._key_error = (self._link.last_error, error)
            return PutResult(False, error)
        self._written.wrote(key)
        self._kept_bad.discard(key)
        self.counters.add(bytes_written=self.layout.num_bytes)
        return PutResult(True)

    def _evict_over_capacity(self) -> None:
        """Delete the oldest keys this client wrote while over capacity (expired ones are only forgotten)."""
        victims = self._written.over_capacity()
        if victims:
            self.counters.add(evictions=len(victims))
            self._per_key("delete", victims)

    # -- helpers -------------------------------------------------------------------------------
    def _holds(self, key: str, reply: Any) -> bool:
        """A ("held") reply: a string of a block's encoded length under `key`, not expiring within _min_pttl_ms."""
        if not isinstance(reply, tuple):
            return False  # a failed call, or another Redis type (STRLEN's WRONGTYPE)
        length, pttl = reply
        encoded = header_num_bytes(key, len(self.layout.shape)) + self.layout.num_bytes
        return length == encoded and (pttl == -1 or pttl >= self._min_pttl_ms)

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


def _connect(name: str, url: str, timeout_s: float, retry_interval_s: float, on_error) -> Any:
    """The link for `url`: one server, or a cluster (redis+cluster://); ValueError for a malformed url."""
    try:
        if is_cluster_url(url):
            from tierkv.storage.redis_cluster import ClusterLink

            return ClusterLink(name, parse_cluster_url(url), timeout_s, retry_interval_s, on_error)
        problem = single_url_problem(url)
        if problem is None:
            return SingleLink(name, url, timeout_s, retry_interval_s, on_error)
    except ValueError as exc:
        problem = str(exc)
    expected = "redis://host:port/db, rediss://host:port/db, unix:///path or redis+cluster://host:port,host:port"
    raise ValueError(redact_text(f"malformed Redis url {url!r}: {problem}; expected {expected}"))
