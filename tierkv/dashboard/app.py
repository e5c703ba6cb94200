"""The dashboard as a WSGI app, and a small threaded server to run any WSGI app on loopback.

Primitives: `dashboard_app(source)`, `serve(app, host, port) -> RunningServer`.

    GET /                          the page (polls api/snapshots every second)
    GET /static/<file>             dashboard.js, dashboard.css, uPlot
    GET /api/snapshots?since=N     {"lines": [...], "next": M, "source": "..."}; 502 {"error"} when
                                   the source cannot be read (missing file, endpoint down)
"""
from __future__ import annotations

import json
import socket
import sys
import threading
from socketserver import ThreadingMixIn
from typing import Callable, Iterable
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from tierkv.dashboard.page import STATIC_DIR, STATIC_FILES, live_page, live_page_csp
from tierkv.metrics.control import ANSWERING
from tierkv.metrics.sources import SourceError

WsgiApp = Callable[[dict, Callable], Iterable[bytes]]


def respond(start_response, status: str, body: bytes, content_type: str, extra_headers=()) -> list[bytes]:
    start_response(status, [("Content-Type", content_type), ("Content-Length", str(len(body))),
                            ("Cache-Control", "no-store"), *extra_headers])
    return [body]


def json_response(start_response, status: str, value: object) -> list[bytes]:
    return respond(start_response, status, json.dumps(value, default=str).encode(), "application/json")


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
                lines, next_n = source.lines_since(max(0, since))
            except SourceError as exc:
                return json_response(start_response, "502 Bad Gateway", {"error": str(exc)})
            return json_response(start_response, "200 OK", {"lines": lines, "next": next_n, "source": source.description})
        return respond(start_response, "404 Not Found", f"no such page: {path}\n".encode(), "text/plain")

    return app


MAX_CONNECTIONS = 64     # handled at once; a connection past them hangs up the one open longest
READ_TIMEOUT_S = 10.0    # a request line, header or body that does not arrive by then ends its connection


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64

    def __init__(self, *args, **kwargs):
        self._open: dict = {}  # connections being handled, oldest first
        self._open_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def process_request(self, request, client_address):
        """Past MAX_CONNECTIONS the connection open longest that is still sending its request is hung up: a
        request arrives in milliseconds, so it is a slow client's (one byte every few seconds resets the read
        timeout, and 64 of them held every slot: no scrape, no budget change got an answer). One the app is
        answering (it called environ[ANSWERING]: a budget change waits for the engine) is never hung up."""
        with self._open_lock:
            if len(self._open) >= MAX_CONNECTIONS:
                reading = next((c for c, answering in self._open.items() if not answering), None)
                if reading is None:  # every one is being answered (an app marked it): this one waits its turn
                    self.shutdown_request(request)
                    return
                del self._open[reading]
                _hang_up(reading)
            self._open[request] = False  # True once the app answers it (ANSWERING): never hung up then
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._forget(request)
            raise

    def handle_error(self, request, client_address):
        if isinstance(sys.exc_info()[1], OSError):  # a slow, gone or hung-up client (timeouts, resets): no traceback
            return
        super().handle_error(request, client_address)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._forget(request)

    def answering(self, request) -> None:
        with self._open_lock:
            if request in self._open:
                self._open[request] = True

    def _forget(self, request) -> None:
        with self._open_lock:
            self._open.pop(request, None)


def _hang_up(connection) -> None:
    """End a connection another thread is reading: its read returns, its handler ends and closes it."""
    try:
        connection.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class _QuietHandler(WSGIRequestHandler):
    timeout = READ_TIMEOUT_S

    def get_environ(self):
        environ = super().get_environ()
        environ[ANSWERING] = lambda: self.server.answering(self.request)
        return environ

    def log_message(self, format, *args):  # noqa: A002 - the stdlib's signature
        pass


class RunningServer:
    """A WSGI app served on a daemon thread; `close()` stops it and frees the port."""

    def __init__(self, app: WsgiApp, host: str, port: int):
        self._server = make_server(host, port, app, server_class=_ThreadingServer, handler_class=_QuietHandler)
        self.host, self.port = self._server.server_address[:2]
        self._thread = threading.Thread(target=self._server.serve_forever, name="tierkv-http", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()


def serve(app: WsgiApp, host: str = "127.0.0.1", port: int = 0) -> RunningServer:
    """Serve `app` on host:port (0: a free port) until `close()`."""
    return RunningServer(app, host, port)
