"""What `metrics:` in the config turns on for a TieredLLM: recorder, sampling thread, endpoint.

Primitives: `MetricsService` (`from_config`, `record_request`, `close`, `url`).

    metrics.enabled            false: nothing is recorded (the tiers keep their counters anyway)
    metrics.jsonl_path         append a snapshot line every snapshot_interval_s and after each request
    metrics.prometheus_port    serve /metrics, /api/snapshots and the live dashboard on metrics.host
    metrics.control_enabled    also serve POST /api/gpu_budget, behind a bearer token (tierkv.metrics.control)
    (neither)                  a line per request, kept in memory only (`service.recorder.lines_since`)
"""
from __future__ import annotations

import errno
import socket
from typing import Callable, Mapping

from tierkv.config import MetricsConfig
from tierkv.metrics.control import BudgetControl
from tierkv.metrics.recorder import LiveReads, MetricsRecorder

# bind() errors that mean the host, not the port, is wrong (EADDRINUSE and EACCES stay the port's)
_ADDRESS_ERRNOS = (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT)


class MetricsService:
    def __init__(self, recorder: MetricsRecorder | None, server=None):
        self.recorder = recorder
        self.server = server

    @classmethod
    def from_config(cls, config: MetricsConfig, source: Callable[[], Mapping], *,
                    live_reads: LiveReads | None = None, host: str | None = None,
                    set_gpu_budget: Callable | None = None) -> "MetricsService":
        """`set_gpu_budget` is served only when `config.control_enabled` (ConfigError without a token)."""
        if not config.enabled:
            return cls(None)
        host = config.host if host is None else host
        control = BudgetControl.from_config(config, set_gpu_budget) if config.prometheus_port is not None else None
        recorder = MetricsRecorder(source, jsonl_path=config.jsonl_path, live_reads=live_reads,
                                   history_bytes=config.history_bytes)
        server = None
        try:
            recorder.snapshot("start")
            if config.prometheus_port is not None:
                from tierkv.metrics.server import start_metrics_server

                try:
                    server = start_metrics_server(recorder, config.prometheus_port, host, control)
                except OSError as exc:  # name the key at fault: an address no interface has, or a port in use
                    key = ("metrics.host" if exc.errno in _ADDRESS_ERRNOS or isinstance(exc, socket.gaierror)
                           else "metrics.prometheus_port")
                    raise OSError(exc.errno, f"{key}: cannot listen on {host}:{config.prometheus_port}"
                                             f" ({exc.strerror})") from None
            if config.jsonl_path is not None or server is not None:
                recorder.start(config.snapshot_interval_s)
        except Exception:
            recorder.close()
            raise
        return cls(recorder, server)

    @property
    def url(self) -> str | None:
        """Base URL of the endpoint, when one is served."""
        return self.server.url if self.server is not None else None

    def record_request(self, request_stats: Mapping) -> None:
        if self.recorder is not None:
            self.recorder.record_request(request_stats)

    def close(self) -> None:
        """Stop the endpoint and the sampling thread; write the last line. Safe to call twice."""
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.recorder is not None:
            self.recorder.close()
