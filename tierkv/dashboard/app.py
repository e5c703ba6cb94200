"""The dashboard as a WSGI app, and a small threaded server to run any WSGI app on loopback.

Primitives: `dashboard_app(source)`, `serve(app, host, port) -> RunningServer`.

    GET /                          the page (polls api/snapshots every second)
    GET /static/<file>             dashboard.js, dashboard.css, uPlot
    GET /api/snapshots?since=N     {"lines": [...], "next": M, "source": "..."}: the newest MAX_REPLY_LINES
                                   of the lines numbered >= N (older ones are skipped, "next" is the same);
                                   502 {"error"} when the source cannot be read (missing file, endpoint down)
"""
from __future__ import annotations

import json
from urllib.parse import parse_qs

from tierkv.dashboard.page import STATIC_DIR, STATIC_FILES, live_page, live_page_csp
from tierkv.dashboard.server import RunningServer, WsgiApp, serve  # noqa: F401 (this module's names too)
from tierkv.metrics.sources import SourceError


def respond(start_response, status: str, body: bytes, content_type: str, extra_headers=()) -> list[bytes]:
    start_response(status, [("Content-Type", content_type), ("Content-Length", str(len(body))),
                            ("Cache-Control", "no-store"), *extra_headers])
    return [body]


def json_response(start_response, status: str, value: object) -> list[bytes]:
    return respond(start_response, status, json.dumps(value, default=str).encode(), "application/json")


MAX_REPLY_LINES = 600  # lines one /api/snapshots reply holds at most (10 minutes at one a second; ~3 MB)


def _snapshots_reply(source, since: int) -> bytes:
    """The JSON body of /api/snapshots. A source that keeps its lines encoded (RecorderSource) has them copied
    as they are: a poller asking for the whole history costs no decode or encode, and no lock held for either."""
    tail = json.dumps(source.description)
    if hasattr(source, "encoded_lines_since"):
        encoded, next_n = source.encoded_lines_since(since, MAX_REPLY_LINES)
        return b'{"lines": [' + b", ".join(encoded) + f'], "next": {next_n}, "source": {tail}}}'.encode()
    lines, next_n = source.lines_since(since)
    return json.dumps({"lines": lines[-MAX_REPLY_LINES:], "next": next_n, "source": source.description},
                      default=str).encode()


def dashboard_app(source, *, poll_ms: int = 1000) -> WsgiApp:
    """`source` has `lines_since(n) -> (lines, next)` and `description` (tierkv.metrics.sources).
    Serve it behind `tierkv.dashboard.guard.guarded` (Host and Origin checks, security headers)."""
    page_html, page_csp = live_page(poll_ms=poll_ms).encode(), live_page_csp(poll_ms=poll_ms)

    def app(environ, start_response):
        path = environ.get("PATH_INFO", "/")
        if environ.get("REQUEST_METHOD", "GET") not in ("GET", "HEAD"):
            return respond(start_response, "405 Method Not Allowed", b"GET only\n", "text/plain")
        if path in ("/", "/index.html"):
            return respond(start_response, "200 OK", page_html, "text/html; charset=utf-8",
                           [("Content-Security-Policy", page_csp)])
        if path.startswith("/static/") and path[len("/static/"):] in STATIC_FILES:
            file_name, content_type = STATIC_FILES[path[len("/static/"):]]
            return respond(start_response, "200 OK", (STATIC_DIR / file_name).read_bytes(), content_type)
        if path == "/api/snapshots":
            query = parse_qs(environ.get("QUERY_STRING", ""))
            try:
                since = int(query.get("since", ["0"])[0])
            except ValueError:
                return json_response(start_response, "400 Bad Request", {"error": "since: expected an integer"})
            try:
                body = _snapshots_reply(source, max(0, since))
            except SourceError as exc:
                return json_response(start_response, "502 Bad Gateway", {"error": str(exc)})
            return respond(start_response, "200 OK", body, "application/json")
        return respond(start_response, "404 Not Found", f"no such page: {path}\n".encode(), "text/plain")

    return app
