"""In-process metrics: per-tier counters, snapshot lines (JSONL), a Prometheus endpoint.

Primitives: `LatencyHistogram`, `TierCounters` (kept by every tier), `PrefetchRecorder` (what the
prefetcher reports), `MetricsRecorder` (stats() -> snapshot lines), `MetricsService` (what the
`metrics:` config section turns on). prometheus_client is imported only when an endpoint is served.
"""
from tierkv.metrics.counters import LatencyHistogram, TierCounters
from tierkv.metrics.prefetch import PrefetchRecorder
from tierkv.metrics.recorder import MetricsRecorder, runtime_reads
from tierkv.metrics.service import MetricsService

__all__ = ["LatencyHistogram", "MetricsRecorder", "MetricsService", "PrefetchRecorder", "TierCounters", "runtime_reads"]
