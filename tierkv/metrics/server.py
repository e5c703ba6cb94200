"""The metrics endpoint of a running process: Prometheus text, JSON snapshots and the live page.

Primitives: `metrics_app(recorder)`, `start_metrics_server(recorder, port, host)`.

    GET /metrics                   Prometheus exposition (prometheus_client), read at scrape time
    GET /api/snapshots?since=N     the recorder's snapshot lines, as JSON (what the dashboard polls)
    GET /                          the dashboard page, live

Binds 127.0.0.1 unless told otherwise: expose it with care (it has no authentication).
"""
from __future__ import annotations

from tierkv.dashboard.app import RunningServer, dashboard_app, serve
from tierkv.metrics.prometheus import TierKVCollector, new_registry
from tierkv.metrics.sources import RecorderSource


def metrics_app(recorder):
    try:
        from prometheus_client import make_wsgi_app
    except ImportError:
        raise ImportError(
            "metrics.prometheus_port needs prometheus_client: pip install 'tierkv-runtime[dashboard]'"
        ) from None
    prometheus = make_wsgi_app(new_registry(TierKVCollector(recorder.measure)))
    page = dashboard_app(RecorderSource(recorder))

    def app(environ, start_response):
        if environ.get("PATH_INFO", "/") == "/metrics":
            return prometheus(environ, start_response)
        return page(environ, start_response)

    return app


def start_metrics_server(recorder, port: int, host: str = "127.0.0.1") -> RunningServer:
    """Serve `recorder`'s figures on host:port (0: a free port) until `close()`."""
    return serve(metrics_app(recorder), host, port)
