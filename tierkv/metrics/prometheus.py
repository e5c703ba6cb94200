"""Prometheus view of the same figures: a custom collector that reads them at scrape time.

Primitives: `TierKVCollector`, `new_registry`. Needs `prometheus_client` (the `dashboard` extra).

    tierkv_tier_lookups_total{tier="cpu"}        hits, misses, puts, put_failures, removes, evictions,
    tierkv_tier_read_bytes_total{tier="disk"}    corrupt_blocks, errors, auth_failures, written_bytes,
                                                 scan_dropped_records, lost_blocks alike; the last two
                                                 also _by_reason{tier,reason}
    tierkv_tier_hit_ratio{tier="gpu"}            tier "gpu": attention block reads from the hot window
    tierkv_tier_latency_seconds{tier,op}         histogram of get / put calls (LATENCY_HELP says what each times)
    tierkv_transfer_bytes_total{direction="h2d"} tierkv_scheduler_{stalls,chunks_streamed,streamed_bytes}_total
    tierkv_gpu_kv_{resident,staging,held,budget}_bytes    tierkv_chain_{spilled,promoted,dropped}_blocks_total
    tierkv_gpu_budget_{changes,refusals}_total
    tierkv_requests_total, tierkv_{prompt,prefix,generated}_tokens_total, tierkv_{prefill,decode}_seconds_total
    tierkv_prefetch_{precision,recall}, tierkv_scheduler_stall_seconds_total: only once reported
    tierkv_model_info{name,source,weights_fingerprint,block_fingerprint}  what addresses the blocks

A figure that is None (nothing reported yet) is left out rather than exported as a made-up 0.
"""
from __future__ import annotations

from typing import Callable, Iterator

TIER_COUNTERS = {  # figure -> metric name (before _total)
    "lookups": "lookups", "hits": "hits", "misses": "misses", "puts": "puts", "put_failures": "put_failures",
    "removes": "removes", "evictions": "evictions", "corrupt_blocks": "corrupt_blocks", "errors": "errors",
    "auth_failures": "auth_failures", "bytes_read": "read_bytes", "bytes_written": "written_bytes",
    "scan_dropped_records": "scan_dropped_records", "lost_blocks": "lost_blocks",
}
TIER_REASON_COUNTERS = ("scan_dropped_records", "lost_blocks")  # also per reason: {tier, reason}
COUNTERS = {  # figure -> (metric name before _total, help)
    "scheduler.chunks_streamed": ("tierkv_scheduler_chunks_streamed", "chunks of far blocks streamed to the GPU"),
    "scheduler.bytes_streamed": ("tierkv_scheduler_streamed_bytes", "bytes streamed to the GPU staging ring"),
    "scheduler.stalls": ("tierkv_scheduler_stalls", "chunks not prefetched ahead of attention (late)"),
    "prefetch.stall_s": ("tierkv_scheduler_stall_seconds", "time attention waited for late chunks"),
    "chain.spilled": ("tierkv_chain_spilled_blocks", "blocks spilled to a lower tier"),
    "chain.promoted": ("tierkv_chain_promoted_blocks", "blocks promoted into the CPU tier"),
    "chain.dropped": ("tierkv_chain_dropped_blocks", "blocks no tier accepted"),
    "requests.requests": ("tierkv_requests", "finished requests"),
    "requests.prompt_tokens": ("tierkv_prompt_tokens", "prompt tokens of finished requests"),
    "requests.prefix_tokens": ("tierkv_prefix_tokens", "prompt tokens reused from a tier"),
    "requests.generated_tokens": ("tierkv_generated_tokens", "generated tokens"),
    "requests.prefill_s": ("tierkv_prefill_seconds", "time in prefill"),
    "requests.decode_s": ("tierkv_decode_seconds", "time in decode"),
    "gpu.budget_changes": ("tierkv_gpu_budget_changes", "GPU budget changes applied"),
    "gpu.budget_refusals": ("tierkv_gpu_budget_refusals", "GPU budget changes refused (the old budget kept)"),
}
MODEL_INFO = ("model.name", "model.source", "model.weights_fingerprint", "model.block_fingerprint")
LATENCY_HELP = ("time inside a tier's calls, one sample per batched call: op get = a batch of lookups (cpu tier: "
                "get_many, and acquire, the lookups and pins before an H2D gather); op put = a batch of stores (cpu "
                "tier: put_many, and prepare_put plus complete_put around a D2H scatter, the copy itself not included)")
GAUGES = {
    "gpu.resident_bytes": ("tierkv_gpu_kv_resident_bytes", "GPU bytes of resident KV slots"),
    "gpu.staging_bytes": ("tierkv_gpu_kv_staging_bytes", "GPU bytes of the prefetch staging ring"),
    "gpu.held_bytes": ("tierkv_gpu_kv_held_bytes", "GPU bytes held for KV (resident + staging)"),
    "gpu.budget_bytes": ("tierkv_gpu_kv_budget_bytes", "configured GPU KV budget"),
    "gpu.returned_bytes": ("tierkv_gpu_kv_returned_bytes", "GPU bytes given back by set_gpu_budget"),
    "chain.in_flight": ("tierkv_chain_in_flight_blocks", "blocks being spilled"),
    "prefetch.precision": ("tierkv_prefetch_precision", "prefetched blocks that attention used / prefetched"),
    "prefetch.recall": ("tierkv_prefetch_recall", "prefetched blocks that attention used / needed"),
}


def new_registry(collector: "TierKVCollector"):
    """A registry holding only tierkv's figures (not the process-global default one)."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


class TierKVCollector:
    """`measure` returns (figures, latency, info, layers), as `MetricsRecorder.measure` does."""

    def __init__(self, measure: Callable[[], tuple]):
        self._measure = measure

    def collect(self) -> Iterator:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

        figures, latency, info, _ = self._measure()
        yield from _tier_families(figures, latency)
        transfer = CounterMetricFamily("tierkv_transfer_bytes", "bytes copied between the CPU tier and the GPU",
                                       labels=["direction"])
        for direction in ("h2d", "d2h"):
            if figures.get(f"transfer.{direction}_bytes") is not None:
                transfer.add_metric([direction], figures[f"transfer.{direction}_bytes"])
        yield transfer
        prefix = CounterMetricFamily("tierkv_prefix_blocks", "prompt blocks reused, by the tier that held them",
                                     labels=["tier"])
        for key, value in figures.items():
            if key.startswith("requests.prefix_blocks."):
                prefix.add_metric([key.rsplit(".", 1)[1]], value)
        yield prefix
        for key, (name, text) in COUNTERS.items():
            if figures.get(key) is not None:
                yield CounterMetricFamily(name, text, value=figures[key])
        for key, (name, text) in GAUGES.items():
            if figures.get(key) is not None:
                yield GaugeMetricFamily(name, text, value=figures[key])
        labels = {k.replace(".", "_"): v for k, v in info.items() if k in ("transfer.backend", "layout.kv_dtype")}
        if labels:
            yield InfoMetricFamily("tierkv_runtime", "transfer backend and KV dtype", value=labels)
        model = {k.split(".", 1)[1]: v for k, v in info.items() if k in MODEL_INFO}
        if model:
            yield InfoMetricFamily("tierkv_model", "the model that addresses the blocks: configured name, source, "
                                   "weights and block-address fingerprints", value=model)


def _tier_families(figures: dict, latency: dict) -> Iterator:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    tiers = sorted({key.split(".")[1] for key in figures if key.startswith("tier.")}, key=lambda n: n != "gpu")
    for field, name in TIER_COUNTERS.items():
        family = CounterMetricFamily(f"tierkv_tier_{name}", f"tier {field.replace('_', ' ')}", labels=["tier"])
        for tier in tiers:
            if figures.get(f"tier.{tier}.{field}") is not None:
                family.add_metric([tier], figures[f"tier.{tier}.{field}"])
        yield family
    for field in TIER_REASON_COUNTERS:
        family = CounterMetricFamily(f"tierkv_tier_{field}_by_reason", f"tier {field.replace('_', ' ')} by reason",
                                     labels=["tier", "reason"])
        for key, value in sorted(figures.items()):
            parts = key.split(".")
            if len(parts) == 4 and parts[0] == "tier" and parts[2] == f"{field}_by_reason" and value is not None:
                family.add_metric([parts[1], parts[3]], value)
        yield family
    ratio = GaugeMetricFamily("tierkv_tier_hit_ratio", "hits / lookups since start", labels=["tier"])
    healthy = GaugeMetricFamily("tierkv_tier_healthy", "1 while the tier serves", labels=["tier"])
    for tier in tiers:
        if figures.get(f"tier.{tier}.hit_rate") is not None:
            ratio.add_metric([tier], figures[f"tier.{tier}.hit_rate"])
        if figures.get(f"tier.{tier}.healthy") is not None:
            healthy.add_metric([tier], figures[f"tier.{tier}.healthy"])
    yield ratio
    yield healthy
    histogram = HistogramMetricFamily("tierkv_tier_latency_seconds", LATENCY_HELP, labels=["tier", "op"])
    for key, h in sorted(latency.items()):
        tier, op = key.rsplit(".", 1)
        cumulative, buckets = 0, []
        for bound, count in zip(list(h["buckets_s"]) + ["+Inf"], h["counts"]):
            cumulative += count
            buckets.append((str(bound) if bound != "+Inf" else "+Inf", cumulative))
        histogram.add_metric([tier, op], buckets, sum_value=h["sum_s"])
    yield histogram
