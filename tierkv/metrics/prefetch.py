"""What the prefetcher reports about itself: per-layer chunks on time or late, wait time, and
the precision and recall of a sparse selection.

Primitives: `PrefetchRecorder` (`record_chunk`, `record_selection`, `snapshot`).

Nothing here is estimated. A figure nobody has reported is None (or absent for the per-layer
arrays), so exact mode, which has no predictor, shows precision and recall as None:

    precision = |prefetched and needed| / |prefetched|      recall = |prefetched and needed| / |needed|

The scheduler calls it from the host, after it consumed a chunk or compared a selection:

    recorder.record_chunk(layer, is_late=g >= num_issued, wait_s=0.0012)
    recorder.record_selection(num_prefetched=512, num_used=480, num_needed=500)

On CUDA the wait is the compute stream's, measured by the GPU: the scheduler brackets the
stream's wait for a chunk's copy with two timing events (`chunk_wait_events`, then
`record_chunk_timed`); the time between them is how long compute stood still for that chunk.
They are read when they have completed (at the latest in `snapshot`) and reused.

The last RECENT_CHUNKS chunks are also kept one by one, for the dashboard's prefetch timeline:

    snapshot()["recent_chunks"] = {"n": [...],        # chunk number since start (0, 1, ...)
                                   "t": [...],        # unix seconds when it was consumed (`clock`)
                                   "layer": [...], "is_late": [0/1 ...], "wait_s": [...]}
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable

RECENT_CHUNKS = 256


class PrefetchRecorder:
    """Thread-safe running totals; `snapshot()` returns plain data for `KVRuntime.stats()`."""

    def __init__(self, num_layers: int, *, clock: Callable[[], float] = time.time):
        self.num_layers = num_layers
        self._clock = clock
        self._recent: deque[list] = deque(maxlen=RECENT_CHUNKS)  # [n, t, layer, is_late, wait_s]
        self._lock = threading.Lock()
        self._chunks = [0] * num_layers
        self._late_chunks = [0] * num_layers
        self._wait_s = [0.0] * num_layers
        self._stall_s = 0.0
        self._num_late_unmeasured = 0
        self._num_chunks_reported = 0
        self._num_prefetched = 0
        self._num_used = 0
        self._num_needed = 0
        self._num_selections = 0
        self._pending: list[tuple[list, bool, object, object]] = []   # (recent entry, is_late, start, end)
        self._free_events: list = []

    def record_chunk(self, layer: int, *, is_late: bool, wait_s: float | None = None) -> list:
        """One streamed chunk of `layer` consumed; `is_late`: it was not copied ahead of need.
        Returns its entry in the recent chunks (internal: a timed wait is filled in later)."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer: got {layer}; expected 0..{self.num_layers - 1}")
        t = self._clock()
        with self._lock:
            entry = [self._num_chunks_reported, t, layer, int(is_late), wait_s]
            self._recent.append(entry)
            self._chunks[layer] += 1
            self._late_chunks[layer] += int(is_late)
            self._wait_s[layer] += wait_s or 0.0
            self._stall_s += (wait_s or 0.0) if is_late else 0.0
            self._num_late_unmeasured += int(is_late and wait_s is None)
            self._num_chunks_reported += 1
        return entry

    def chunk_wait_events(self):
        """Two CUDA timing events (reused) to bracket one wait of the compute stream."""
        import torch

        with self._lock:
            if len(self._free_events) >= 2:
                return self._free_events.pop(), self._free_events.pop()
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def record_chunk_timed(self, layer: int, *, is_late: bool, start, end) -> None:
        """Like `record_chunk`, the wait being the GPU time between the recorded `start` and `end`."""
        entry = self.record_chunk(layer, is_late=is_late, wait_s=0.0)
        with self._lock:
            self._pending.append((entry, is_late, start, end))
            resolve = len(self._pending) >= 1024
        if resolve:
            self._resolve(block=False)

    def _resolve(self, *, block: bool) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        still = []
        for entry, is_late, start, end in pending:
            if block:
                end.synchronize()
            elif not end.query():
                still.append((entry, is_late, start, end))
                continue
            wait_s = start.elapsed_time(end) / 1e3
            layer = entry[2]
            with self._lock:
                entry[4] = wait_s
                self._wait_s[layer] += wait_s
                self._stall_s += wait_s if is_late else 0.0
                self._free_events.extend((start, end))
        with self._lock:
            self._pending = still + self._pending

    def record_selection(self, *, num_prefetched: int, num_used: int, num_needed: int) -> None:
        """Blocks a predictor prefetched, how many of them attention used, how many it needed."""
        if not 0 <= num_used <= min(num_prefetched, num_needed):
            raise ValueError(
                f"num_used: got {num_used}; must be in [0, min(num_prefetched={num_prefetched}, num_needed={num_needed})]"
            )
        with self._lock:
            self._num_prefetched += num_prefetched
            self._num_used += num_used
            self._num_needed += num_needed
            self._num_selections += 1

    def snapshot(self) -> dict:
        self._resolve(block=True)
        with self._lock:
            snap: dict = {"precision": None, "recall": None, "stall_s": None}
            if self._num_selections:
                snap.update(
                    precision=self._num_used / self._num_prefetched if self._num_prefetched else None,
                    recall=self._num_used / self._num_needed if self._num_needed else None,
                    prefetched_blocks=self._num_prefetched, used_blocks=self._num_used,
                    needed_blocks=self._num_needed,
                )
            if self._num_chunks_reported:
                # a late chunk whose wait was not measured (CUDA, no host timing) leaves stall time unknown
                snap["stall_s"] = None if self._num_late_unmeasured else self._stall_s
                snap["late_chunks"] = sum(self._late_chunks)
                snap["layers"] = {"chunks": list(self._chunks), "late_chunks": list(self._late_chunks),
                                  "wait_s": list(self._wait_s)}
                columns = list(zip(*self._recent))
                snap["recent_chunks"] = {name: list(values) for name, values in
                                         zip(("n", "t", "layer", "is_late", "wait_s"), columns)}
            return snap
