"""In-process metrics: per-tier counters (hits, misses, bytes, latency)."""
from tierkv.metrics.counters import LatencyHistogram, TierCounters

__all__ = ["LatencyHistogram", "TierCounters"]
