"""The metrics endpoint of a running process: Prometheus text, JSON snapshots and the live page.

Primitives: `metrics_app(recorder)`, `start_metrics_server(recorder, port, host)`.

    GET /metrics                   Prometheus exposition (prometheus_client), read at scrape time
    GET /api/snapshots?since=N     the recorder's snapshot lines, as JSON (what the dashboard polls)
    GET /                          the dashboard page, live
    POST /api/gpu_budget           {"budget": "1GiB"}: resize the GPU KV budget (when a control is given)

Binds 127.0.0.1 unless told otherwise: expose it with care (it has no authentication).
"""
from __future__ import annotations

import json

from tierkv.dashboard.app import RunningServer, dashboard_app, serve
from tierkv.metrics.prometheus import TierKVCollector, new_registry
from tierkv.metrics.sources import RecorderSource


def metrics_app(recorder, set_gpu_budget=None):
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
        if environ.get("PATH_INFO") == "/api/gpu_budget" and set_gpu_budget is not None:
            return _budget(environ, start_response, set_gpu_budget)
        return page(environ, start_response)

    return app


def start_metrics_server(recorder, port: int, host: str = "127.0.0.1", set_gpu_budget=None) -> RunningServer:
    """Serve `recorder`'s figures on host:port (0: a free port) until `close()`."""
    return serve(metrics_app(recorder, set_gpu_budget), host, port)


def _budget(environ, start_response, set_gpu_budget):
    """POST {"budget": "1GiB" | bytes} -> 200 {"budget": ...} once applied; 400 naming what is wrong."""
    def reply(status: str, body: dict):
        data = json.dumps(body).encode()
        start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(data)))])
        return [data]

    if environ.get("REQUEST_METHOD") != "POST":
        return reply("405 Method Not Allowed", {"error": "POST {\"budget\": \"1GiB\"} to resize the GPU KV budget"})
    try:
        length = int(environ.get("CONTENT_LENGTH") or 0)
        budget = json.loads(environ["wsgi.input"].read(length) or b"{}").get("budget")
        if budget is None:
            raise ValueError("the body must be JSON with a 'budget' (bytes or a size such as '1GiB')")
        set_gpu_budget(budget)
    except (ValueError, TypeError, AttributeError) as exc:
        return reply("400 Bad Request", {"error": str(exc)})
    return reply("200 OK", {"budget": budget})
