"""Snapshot lines: `stats()` flattened to dotted figures, plus rates since the previous line.

Primitives: `flatten_stats`, `derive_rates`, `tier_names`, `distinct_tier_names`, `histogram_quantile`, `SCHEMA`.

One line of a metrics JSONL file (every key but `request` and `prefetch_*` always present):

    {"schema": "tierkv.metrics/1", "run_id": "9f2c...", "seq": 7, "kind": "interval",
     "t": 1733150000.25,              # unix seconds        "elapsed_s": 3.5,
     "figures": {"tier.cpu.hits": 120, "tier.gpu.hit_rate": 0.12, "gpu.held_bytes": 1572864,
                 "transfer.h2d_bytes": 8388608, "prefetch.precision": null, ...},   # running totals
     "rates": {"transfer.h2d_bytes_per_s": 2.1e9, "tier.cpu.hit_rate_interval": 0.5,
               "scheduler.stalls_interval": 0, ...},                  # since the previous line
     "latency": {"cpu.get": {"buckets_s": [...], "counts": [...], "sum_s": 0.01, "count": 40}, ...},
     "info": {"transfer.backend": "torch_cpu", ...},                 # strings
     "request": {...RequestOutput.stats...},                         # kind "request" only
     "prefetch_layers": {"chunks": [...], "late_chunks": [...], "wait_s": [...]},   # when reported
     "prefetch_chunks": {"n": [...], "t": [...], "layer": [...], "is_late": [...], "wait_s": [...]}}
                       # chunks consumed since the previous line (at most the last 256), t in unix seconds

Tier "gpu" counts attention's block reads: a hit is a block read from the GPU hot window, a
miss one streamed from the CPU tier. Under vLLM, where the stats come from the connector's store,
the hot window's sparse decode reads stand in for it: a hit is a block read from vLLM's pool (the
window) or from a far-block cache, a miss a selected far block fetched when selected; the hot
window's stalls stand in for the scheduler's, and the full decode graph's next-step prefetch gives
the prefetch precision and recall. The other tiers count their own lookups (prefix reuse,
promotions). A figure that nothing has reported yet (prefetch precision and recall before a
sparse predictor exists) is present with the value None.
"""
from __future__ import annotations

import math
from typing import Mapping

SCHEMA = "tierkv.metrics/1"

# Running totals whose rate per second is kept (suffix "_per_s").
PER_SECOND = ("transfer.h2d_bytes", "transfer.d2h_bytes", "scheduler.bytes_streamed", "chain.spilled",
              "chain.promoted", "requests.generated_tokens", "requests.prompt_tokens")
PER_SECOND_TIER = ("bytes_read", "bytes_written")
# Running totals whose change per line is kept (suffix "_interval").
PER_INTERVAL = ("scheduler.stalls", "scheduler.chunks_streamed", "chain.dropped", "prefetch.stall_s")
ALWAYS_PRESENT = ("prefetch.precision", "prefetch.recall", "prefetch.stall_s")
PREFETCH_DETAIL = ("layers", "recent_chunks")  # arrays in stats()["prefetch"], not figures


def flatten_stats(stats: Mapping) -> tuple[dict, dict, dict, dict | None]:
    """stats() -> (figures, latency histograms, info strings, prefetch detail or None): the detail
    holds what the prefetcher reported of "layers" (per-layer arrays) and "recent_chunks"."""
    figures: dict = {}
    latency: dict = {}
    info: dict = {}
    prefetch = None
    for key, value in stats.items():
        if key == "tiers":
            for tier, name in zip(value, distinct_tier_names([tier["tier"] for tier in value])):
                _flatten_tier(tier, name, figures, latency)
        elif key == "prefetch" and isinstance(value, Mapping):
            detail = {k: value[k] for k in PREFETCH_DETAIL if value.get(k)}
            prefetch = detail or None
            _walk("prefetch", {k: v for k, v in value.items() if k not in PREFETCH_DETAIL}, figures, info)
        else:
            _walk(key, value, figures, info)
    _gpu_tier_from_hot_window(figures)
    _sparse_figures_from_hot_window(figures)
    for key in ALWAYS_PRESENT:
        figures.setdefault(key, None)
    if "gpu.resident_bytes" in figures and "gpu.staging_bytes" in figures:
        figures["gpu.held_bytes"] = figures["gpu.resident_bytes"] + figures["gpu.staging_bytes"]
    return figures, latency, info, prefetch


def _gpu_tier_from_hot_window(figures: dict) -> None:
    """Tier "gpu" figures from the vLLM hot window's sparse decode reads, when no runtime reported
    that tier and some sparse row has read blocks."""
    if any(key.startswith("tier.gpu.") for key in figures):
        return
    resident = figures.get("hot_window.sparse_resident_reads") or 0
    selected = figures.get("hot_window.sparse_selected_reads") or 0
    if not resident + selected:
        return
    hits = resident + (figures.get("hot_window.cache_hits") or 0)
    lookups = resident + selected
    figures.update({"tier.gpu.lookups": lookups, "tier.gpu.hits": hits, "tier.gpu.misses": lookups - hits,
                    "tier.gpu.hit_rate": hits / lookups})


def _sparse_figures_from_hot_window(figures: dict) -> None:
    """Under vLLM, where no runtime reports them: the dashboard's stalls from the hot window's (sparse
    rows that waited for a fetch at selection, and chunks streamed late), and its prefetch precision
    and recall from the next-step prefetch of the full decode graph (`sparse_prefetch_margin`)."""
    if "scheduler.stalls" not in figures and figures.get("hot_window.stalls") is not None:
        figures["scheduler.stalls"] = figures["hot_window.stalls"]
    if figures.get("prefetch.precision") is None and figures.get("prefetch.recall") is None:
        for key in ("precision", "recall"):
            value = figures.get(f"hot_window.full_decode_graphs.prefetch_{key}")
            if value is not None:
                figures[f"prefetch.{key}"] = value


def distinct_tier_names(names: list[str]) -> list[str]:
    """Tiers are named after their kind, and a config may have two of a kind (disk tiers on two paths, Redis
    tiers in two namespaces): the second of a name is "<name>_2", the third "<name>_3" (before an "@rank<i>"
    suffix), so its figures and labels no longer overwrite the first's; a name met once is kept as it is.

        ["cpu", "disk", "disk"] -> ["cpu", "disk", "disk_2"]
    """
    seen: dict[str, int] = {}
    distinct: list[str] = []
    for name in names:
        kind, at, rank = name.partition("@")
        number = seen.get(name, 0) + 1
        candidate = name if number == 1 else f"{kind}_{number}{at}{rank}"
        while candidate in distinct:  # taken by a tier so named (no kind is, but here names are only strings)
            number += 1
            candidate = f"{kind}_{number}{at}{rank}"
        seen[name] = number
        distinct.append(candidate)
    return distinct


def _flatten_tier(tier: Mapping, name: str, figures: dict, latency: dict) -> None:
    for key, value in tier.items():
        if key == "latency":
            for op, histogram in value.items():
                latency[f"{name}.{op}"] = dict(histogram)
        elif isinstance(value, Mapping):  # e.g. scan_dropped_records_by_reason: one figure per reason
            _walk(f"tier.{name}.{key}", value, figures, {})
        elif key != "tier":
            _put(f"tier.{name}.{key}", value, figures, {})


def _walk(prefix: str, value: object, figures: dict, info: dict) -> None:
    if isinstance(value, Mapping):
        for key, child in value.items():
            _walk(f"{prefix}.{key}", child, figures, info)
    else:
        _put(prefix, value, figures, info)


def _put(key: str, value: object, figures: dict, info: dict) -> None:
    if isinstance(value, bool):
        figures[key] = int(value)
    elif isinstance(value, float) and not math.isfinite(value):
        figures[key] = None  # JSON has no NaN or Infinity
    elif value is None or isinstance(value, (int, float)):
        figures[key] = value
    elif isinstance(value, str):
        info[key] = value
    elif isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        info[key] = value[-1]  # e.g. the last spill error
    # other lists (empty ones, per-layer arrays) are not figures


def tier_names(figures: Mapping) -> list[str]:
    """Tier names in the order their figures appear (gpu first when present)."""
    names: list[str] = []
    for key in figures:
        if key.startswith("tier."):
            name = key.split(".")[1]
            if name not in names:
                names.append(name)
    return sorted(names, key=lambda n: n != "gpu")


def derive_rates(previous: Mapping | None, figures: Mapping, latency: Mapping, t: float) -> dict:
    """Rates and interval figures between `previous` (a snapshot line, or None) and now."""
    if previous is None:
        return {}
    dt = t - previous["t"]
    before = previous["figures"]
    rates: dict = {}
    for key in _per_second_keys(figures):
        delta = _delta(before, figures, key)
        rates[f"{key}_per_s"] = None if delta is None or dt <= 0 else delta / dt
    for key in PER_INTERVAL:
        if key in figures:
            rates[f"{key}_interval"] = _delta(before, figures, key)
    for name in tier_names(figures):
        lookups = _delta(before, figures, f"tier.{name}.lookups")
        hits = _delta(before, figures, f"tier.{name}.hits")
        rates[f"tier.{name}.hit_rate_interval"] = hits / lookups if lookups and hits is not None else None
    previous_latency = previous.get("latency", {})
    for name, histogram in latency.items():
        old = previous_latency.get(name, {"count": 0, "sum_s": 0.0})
        count = histogram["count"] - old["count"]
        rates[f"latency.{name}.mean_s_interval"] = (histogram["sum_s"] - old["sum_s"]) / count if count > 0 else None
    return rates


def _per_second_keys(figures: Mapping) -> list[str]:
    keys = [k for k in PER_SECOND if k in figures]
    for name in tier_names(figures):
        keys += [f"tier.{name}.{field}" for field in PER_SECOND_TIER if f"tier.{name}.{field}" in figures]
    return keys


def _delta(before: Mapping, after: Mapping, key: str) -> int | float | None:
    """after - before for a running total (one not reported before counts from 0); None when it is
    not reported now or went down."""
    old, new = before.get(key), after.get(key)
    if new is None or old is not None and new < old:
        return None
    return new - (old or 0)


def histogram_quantile(histogram: Mapping, q: float) -> float | None:
    """Upper bound of the bucket holding quantile q (None when empty; inf above the last bound)."""
    total = histogram["count"]
    if not total:
        return None
    rank = q * total
    seen = 0
    for bound, count in zip(list(histogram["buckets_s"]) + [float("inf")], histogram["counts"]):
        seen += count
        if seen >= rank:
            return bound
    return float("inf")
