"""The Redis tier's record of the keys this client wrote: an LRU with each key's expiry.

Primitives: `WrittenKeys`.

Redis keeps no order of its own that a client could evict by, and other clients write the same
namespace; so a tier with capacity_bytes deletes the oldest keys *it* wrote once they pass its
block count. Keys read as misses or removed are forgotten; a TTL's keys drop out when due.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Iterable


class WrittenKeys:
    """Keys written by this client, oldest first, at most `max_blocks` kept (None: no limit)."""

    def __init__(self, max_blocks: int | None, ttl_s: float | None):
        self.max_blocks = max_blocks
        self.ttl_s = ttl_s
        self._expiry: OrderedDict[str, float | None] = OrderedDict()  # key -> monotonic expiry
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._expiry)

    def __iter__(self):
        with self._lock:
            return iter(list(self._expiry))

    def wrote(self, key: str) -> None:
        with self._lock:
            self._expiry.pop(key, None)
            self._expiry[key] = None if self.ttl_s is None else time.monotonic() + self.ttl_s

    def touch(self, keys: Iterable[str]) -> None:
        with self._lock:
            for key in keys:
                if key in self._expiry:
                    self._expiry.move_to_end(key)

    def forget(self, keys: Iterable[str]) -> None:
        with self._lock:
            for key in keys:
                self._expiry.pop(key, None)

    def over_capacity(self) -> list[str]:
        """Drop expired keys, then take the oldest while over max_blocks: the keys to delete."""
        now, victims = time.monotonic(), []
        with self._lock:
            while self._expiry:
                key, expiry = next(iter(self._expiry.items()))
                expired = expiry is not None and expiry <= now
                if not expired and (self.max_blocks is None or len(self._expiry) <= self.max_blocks):
                    break
                del self._expiry[key]
                if not expired:
                    victims.append(key)
        return victims


class BoundedKeys:
    """A set of at most `limit` keys, the oldest dropped first: keys whose bad value a server without scripting
    kept (the conditional delete failed). Not held for contains_many, so the next spill or write-through stores
    the block over the bad value; a put of the key takes it out."""

    def __init__(self, limit: int = 1 << 16):
        self.limit = limit
        self._keys: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._keys

    def __len__(self) -> int:
        with self._lock:
            return len(self._keys)

    def add(self, keys: Iterable[str]) -> None:
        with self._lock:
            for key in keys:
                self._keys[key] = None
            while len(self._keys) > self.limit:
                self._keys.popitem(last=False)

    def discard(self, key: str) -> None:
        with self._lock:
            self._keys.pop(key, None)
