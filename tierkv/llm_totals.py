"""What every TieredLLM front end (transformers: `tierkv.llm`; vLLM: `integrations/vllm/llm.py`) keeps
beside its engine: the running request totals that `stats()["requests"]` shows, and the config's
metrics service, told of each finished request.

Primitives: `RequestTotals` (`record`, `add`, `as_dict`), `start_metrics`.

    totals = RequestTotals(per_request=("prompt_tokens", "generated_tokens"), per_call=("wall_s",))
    metrics = start_metrics(config, llm.stats, on_failure=engine.close)
    totals.record(out.stats, metrics)     # one finished request: counted, summed, a metrics line
    totals.add("wall_s", 0.8)             # a figure of the whole call, not of one request
    llm.stats()["requests"] == totals.as_dict()
"""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

from tierkv.config import TierKVConfig
from tierkv.metrics import MetricsService
from tierkv.metrics.recorder import LiveReads


class RequestTotals:
    """Running totals since the front end started: `requests` (finished requests), the sum of each
    `per_request` key of their stats, and each `per_call` figure added with `add`. Keys ending in
    `_s` (seconds) start at 0.0, the others at 0; `as_dict` keeps the order given."""

    def __init__(self, per_request: Sequence[str], per_call: Sequence[str] = ()):
        names = ["requests", *per_request, *per_call]
        if len(set(names)) != len(names):
            raise ValueError(f"request totals: a key is named twice in {names}")
        self.per_request = tuple(per_request)
        self._totals: dict[str, int | float] = {name: 0.0 if name.endswith("_s") else 0 for name in names}

    def record(self, request_stats: Mapping, metrics: MetricsService | None = None,
               metrics_stats: Mapping | None = None) -> None:
        """One finished request: counted, its `per_request` figures added (KeyError naming a missing
        one, before anything is added), and `metrics_stats` (default: `request_stats`) handed to
        `metrics.record_request`."""
        missing = [key for key in self.per_request if key not in request_stats]
        if missing:
            raise KeyError(f"request stats lack {', '.join(missing)} (the totals sum them)")
        self._totals["requests"] += 1
        for key in self.per_request:
            self._totals[key] += request_stats[key]
        if metrics is not None:
            metrics.record_request(request_stats if metrics_stats is None else metrics_stats)

    def add(self, key: str, value: int | float) -> None:
        """Add a figure of a whole call (e.g. one batch's wall time) to its total."""
        if key not in self._totals or key == "requests" or key in self.per_request:
            raise KeyError(f"request totals: {key!r} is not a per-call total (those are {self._per_call()})")
        self._totals[key] += value

    def as_dict(self) -> dict:
        """A copy of the totals (reading changes nothing)."""
        return dict(self._totals)

    def _per_call(self) -> list[str]:
        return [k for k in self._totals if k != "requests" and k not in self.per_request]


def start_metrics(config: TierKVConfig, stats: Callable[[], Mapping], *, on_failure: Callable[[], None],
                  live_reads: LiveReads | None = None, set_gpu_budget: Callable | None = None) -> MetricsService:
    """The config's `metrics:` section started over the front end's `stats` (JSONL snapshots, the
    endpoint, the dashboard; `set_gpu_budget` served by the control endpoint when configured). If
    it cannot start, `on_failure` runs first (it closes what the front end already started) and
    the error propagates."""
    try:
        return MetricsService.from_config(config.metrics, stats, live_reads=live_reads, set_gpu_budget=set_gpu_budget)
    except Exception:
        on_failure()
        raise
