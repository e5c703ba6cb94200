"""The disk tier's I/O threads: a large batch split over them, device reads checked on them.

Primitives: `IOThreads`.

A batch of writes or page-cache reads is cut into contiguous parts, one per thread; the calling
thread does the first part itself. Parts smaller than about a MiB of blocks are not worth a
hand-off, so small batches stay on the calling thread. Checksums and copies into or out of the
page cache release the GIL, which is what makes the threads pay; more threads than cores only
add GIL hand-offs, hence at most 4 by default.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable

from tierkv.storage.base import TierError

_SPREAD_MIN_BYTES = 1 << 20  # smaller batches stay on the caller's thread
_MAX_IO_THREADS = 4


class IOThreads:
    """Up to `num_threads` threads doing one tier's I/O (the caller's own counts as one); the
    pool behind them starts at the first batch large enough to spread.

    num_threads: None: one per CPU this process may run on, at most 4.
    """

    def __init__(self, tier_name: str, num_threads: int | None):
        self.tier_name = tier_name
        self.num_threads = num_threads or min(_MAX_IO_THREADS, _num_usable_cpus())
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._is_shut_down = False

    def spread(self, fn: Callable[[list], list], xs: list, item_bytes: int) -> list:
        """fn over contiguous parts of xs (each item about `item_bytes`), the parts on the I/O
        threads when xs is large; results concatenated.

        A part that raises is re-raised once every part has finished."""
        num_parts = min(self.num_threads, len(xs), len(xs) * item_bytes // _SPREAD_MIN_BYTES)
        if num_parts < 2:
            return fn(xs)
        bounds = [len(xs) * part // num_parts for part in range(num_parts + 1)]
        parts = [xs[a:b] for a, b in zip(bounds, bounds[1:])]
        futures = [self.pool().submit(fn, part) for part in parts[1:]]
        try:
            first = fn(parts[0])
        finally:
            wait(futures)  # every part is done before anyone cleans up after a failure
        return first + [r for future in futures for r in future.result()]

    def checker(self) -> ThreadPoolExecutor | None:
        """Where device reads are checked while the next piece is read; None: on the reading thread."""
        return self.pool() if self.num_threads > 1 else None

    def pool(self) -> ThreadPoolExecutor:
        """The threads besides the caller's; TierError once shut down (the tier is closed)."""
        with self._lock:
            if self._is_shut_down:
                raise TierError(f"{self.tier_name}: tier is closed")
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.num_threads - 1, thread_name_prefix=f"tierkv-{self.tier_name}")
            return self._pool

    def shutdown(self) -> None:
        """Wait for the running parts to finish and stop the threads; later batches raise TierError."""
        with self._lock:
            self._is_shut_down, pool, self._pool = True, self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


def _num_usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
