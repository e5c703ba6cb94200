"""The metrics endpoint of a running process: Prometheus text, JSON snapshots and the live page.

Primitives: `metrics_app(recorder, control, host)`, `start_metrics_server(recorder, port, host, control)`.

    GET /metrics                   Prometheus exposition (prometheus_client), read at scrape time
    GET /api/snapshots?since=N     the recorder's snapshot lines, as JSON (what the dashboard polls)
    GET /                          the dashboard page, live
    POST /api/gpu_budget           {"budget": "1GiB"}: resize the GPU KV budget; only with a control
                                   (metrics.control_enabled and a bearer token: tierkv.metrics.control)

Binds `metrics.host` (127.0.0.1 by default). Every request passes the Host and Origin checks and
every response carries the security headers of tierkv.dashboard.guard. See docs/security.md.
"""
from __future__ import annotations

from tierkv.dashboard.app import RunningServer, dashboard_app, json_response, serve
from tierkv.dashboard.guard import guarded
from tierkv.metrics.prometheus import TierKVCollector, new_registry
from tierkv.metrics.sources import RecorderSource


def metrics_app(recorder, control=None, host: str = "127.0.0.1"):
    """The WSGI app; `control` (a BudgetControl) serves POST /api/gpu_budget, else it is off (404)."""
    try:
        from prometheus_client import make_wsgi_app
    except ImportError:
        raise ImportError(
            "metrics.prometheus_port needs prometheus_client: pip install 'tierkv-runtime[dashboard]'"
        ) from None
    prometheus = make_wsgi_app(new_registry(TierKVCollector(recorder.measure)))
    page = dashboard_app(RecorderSource(recorder))

    def app(environ, start_response):
        path = environ.get("PATH_INFO", "/")
        if path == "/metrics":
            return prometheus(environ, start_response)
        if path == "/api/gpu_budget":
            if control is None:
                return json_response(start_response, "404 Not Found", {
                    "error": "the control endpoint is off (metrics.control_enabled, with metrics.control_token)"})
            return control.handle(environ, start_response)
        return page(environ, start_response)

    return guarded(app, host)


def start_metrics_server(recorder, port: int, host: str = "127.0.0.1", control=None) -> RunningServer:
    """Serve `recorder`'s figures on host:port (0: a free port) until `close()`."""
    return serve(metrics_app(recorder, control, host), host, port)
