"""Counters every tier keeps: hits, misses, bytes, errors and a latency histogram per operation.

Primitives: `LatencyHistogram`, `TierCounters` (thread-safe; `snapshot()` returns plain data).
"""
from __future__ import annotations

import bisect
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

# Upper bounds in seconds, Prometheus style; the last bucket is +Inf.
LATENCY_BUCKETS_S = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1.0, 5.0)


@dataclass
class LatencyHistogram:
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))
    total_s: float = 0.0
    num: int = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS_S, seconds)] += 1
        self.total_s += seconds
        self.num += 1

    def snapshot(self) -> dict:
        return {"buckets_s": list(LATENCY_BUCKETS_S), "counts": list(self.counts), "sum_s": self.total_s, "count": self.num}


_COUNTER_NAMES = (
    "lookups", "hits", "misses", "puts", "put_failures", "removes",
    "bytes_read", "bytes_written", "evictions", "corrupt_blocks", "errors", "auth_failures",
    "scan_dropped_records", "lost_blocks", "foreign_records",
)
_BY_REASON = ("scan_dropped_records", "lost_blocks")  # counters also kept per reason: "<name>_by_reason"


class TierCounters:
    """Running totals for one tier. hits + misses == lookups by construction."""

    def __init__(self, tier_name: str):
        self.tier_name = tier_name
        self._lock = threading.Lock()
        self._values = dict.fromkeys(_COUNTER_NAMES, 0)
        self._latency = {"get": LatencyHistogram(), "put": LatencyHistogram()}
        self._reasons: dict[str, dict[str, int]] = {name: {} for name in _BY_REASON}

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                if name not in self._values:
                    raise KeyError(f"unknown counter {name!r}; known: {_COUNTER_NAMES}")
                self._values[name] += delta

    def add_for_reason(self, name: str, reason: str, delta: int = 1) -> None:
        """Add to counter `name` (one of _BY_REASON) and to its count for `reason`."""
        if name not in self._reasons:
            raise KeyError(f"counter {name!r} has no reasons; those that do: {_BY_REASON}")
        with self._lock:
            self._values[name] += delta
            self._reasons[name][reason] = self._reasons[name].get(reason, 0) + delta

    def by_reason(self, name: str) -> dict[str, int]:
        with self._lock:
            return dict(self._reasons[name])

    def record_lookups(self, num_hits: int, num_misses: int, bytes_read: int) -> None:
        self.add(lookups=num_hits + num_misses, hits=num_hits, misses=num_misses, bytes_read=bytes_read)

    @contextmanager
    def timed(self, op: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.observe_latency(op, time.perf_counter() - start)

    def observe_latency(self, op: str, seconds: float) -> None:
        """One latency sample of `op` ("get" or "put"), measured by the caller (a two-phase call)."""
        with self._lock:
            self._latency[op].observe(seconds)

    def __getitem__(self, name: str) -> int:
        with self._lock:
            return self._values[name]

    @property
    def hit_rate(self) -> float | None:
        with self._lock:
            lookups = self._values["lookups"]
            return self._values["hits"] / lookups if lookups else None

    def snapshot(self) -> dict:
        with self._lock:
            snap = dict(self._values)
            snap["latency"] = {op: h.snapshot() for op, h in self._latency.items()}
            snap.update({f"{name}_by_reason": dict(reasons) for name, reasons in self._reasons.items()})
        snap["tier"] = self.tier_name
        snap["hit_rate"] = snap["hits"] / snap["lookups"] if snap["lookups"] else None
        return snap
