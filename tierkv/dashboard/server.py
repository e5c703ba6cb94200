"""A small threaded server to run any WSGI app on an IPv4 or IPv6 address, and stop it for good.

Primitives: `serve(app, host, port) -> RunningServer`, `MAX_CONNECTIONS`, `READ_TIMEOUT_S`, `CLOSE_WAIT_S`.

    serve(app, "::1", 0).close()     listener and every open connection shut, handler threads joined, port free

Every response carries tierkv.dashboard.guard's SECURITY_HEADERS, the errors the stdlib writes itself too
(400, 414, 431, 505, 500); HEAD gets the headers of GET and no body; once `close()` starts nothing more
reaches the app (503), so nothing is answered from a runtime closed after it.
"""
from __future__ import annotations

import socket
import sys
import threading
import time
from socketserver import ThreadingMixIn
from typing import Callable, Iterable
from wsgiref.simple_server import ServerHandler, WSGIRequestHandler, WSGIServer

from tierkv.dashboard.guard import SECURITY_HEADERS
from tierkv.metrics.control import ANSWERING

WsgiApp = Callable[[dict, Callable], Iterable[bytes]]

MAX_CONNECTIONS = 64     # handled at once; a connection past them hangs up the one open longest
READ_TIMEOUT_S = 10.0    # a request line, header or body that does not arrive by then ends its connection
CLOSE_WAIT_S = 5.0       # close() waits this long in all for handler threads (one may be in the app)


class _Connection:
    __slots__ = ("is_answering", "thread")

    def __init__(self, thread: threading.Thread):
        self.is_answering = False  # True once the app answers it (ANSWERING): never hung up then
        self.thread = thread


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64

    def __init__(self, *args, **kwargs):
        self._open: dict = {}  # connection -> _Connection, oldest first
        self._open_lock = threading.Lock()
        self.is_closing = False
        super().__init__(*args, **kwargs)

    def process_request(self, request, client_address):
        """Past MAX_CONNECTIONS the connection open longest that is still sending its request is hung up: a
        request arrives in milliseconds, so it is a slow client's (one byte every few seconds resets the read
        timeout, and 64 of them held every slot: no scrape, no budget change got an answer). One the app is
        answering (it called environ[ANSWERING]: a budget change waits for the engine) is never hung up."""
        thread = threading.Thread(target=self.process_request_thread, args=(request, client_address), daemon=True)
        with self._open_lock:
            if self.is_closing:
                self.shutdown_request(request)
                return
            if len(self._open) >= MAX_CONNECTIONS:
                reading = next((c for c, conn in self._open.items() if not conn.is_answering), None)
                if reading is None:  # every one is being answered (an app marked it): this one waits its turn
                    self.shutdown_request(request)
                    return
                del self._open[reading]
                _hang_up(reading)
            self._open[request] = _Connection(thread)
        try:
            thread.start()
        except BaseException:
            self._forget(request)
            self.shutdown_request(request)
            raise

    def handle_error(self, request, client_address):
        if self.is_closing or isinstance(sys.exc_info()[1], OSError):  # a gone client, or one cut off by close()
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
                self._open[request].is_answering = True

    def _forget(self, request) -> None:
        with self._open_lock:
            self._open.pop(request, None)

    def close_connections(self, wait_s: float) -> None:
        """Shut every open connection (its handler's read or write returns at once), wait up to `wait_s` for the
        handler threads, then close the sockets of any still running (their fds are not handed out again until
        the thread lets go of them: shutdown first, close last)."""
        with self._open_lock:
            self.is_closing = True
            open_now = dict(self._open)
        for request in open_now:
            _hang_up(request)
        deadline = time.monotonic() + wait_s
        for conn in open_now.values():
            conn.thread.join(max(0.0, deadline - time.monotonic()))
        with self._open_lock:
            left = list(self._open)
        for request in left:
            try:
                request.close()
            except OSError:
                pass


class _ThreadingServer6(_ThreadingServer):
    address_family = socket.AF_INET6


def _hang_up(connection) -> None:
    """End a connection another thread is reading: its read returns, its handler ends and closes it."""
    try:
        connection.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class _GuardedServerHandler(ServerHandler):
    """wsgiref's handler; the 500 it writes for an app that raised carries the security headers, and an app cut
    off by close() (its runtime closed under it) leaves no traceback."""

    error_headers = [("Content-Type", "text/plain"), ("Cache-Control", "no-store"), *SECURITY_HEADERS]

    def log_exception(self, exc_info):
        if not self.request_handler.server.is_closing:
            super().log_exception(exc_info)


class _QuietHandler(WSGIRequestHandler):
    timeout = READ_TIMEOUT_S

    def handle(self):
        """WSGIRequestHandler.handle, with _GuardedServerHandler."""
        self.raw_requestline = self.rfile.readline(65537)
        if len(self.raw_requestline) > 65536:
            self.requestline, self.request_version, self.command = "", "", ""
            self.send_error(414)
            return
        if not self.parse_request():  # it sent the error
            return
        handler = _GuardedServerHandler(self.rfile, self.wfile, self.get_stderr(), self.get_environ(),
                                        multithread=False)
        handler.request_handler = self
        handler.run(self.server.get_app())

    def send_error(self, code, message=None, explain=None):
        """An error the stdlib writes itself (400, 414, 431, 505): with a status line and headers even when the
        request line was unreadable (the stdlib took it for HTTP/0.9 and wrote the body alone)."""
        if not self.request_version.startswith("HTTP/1."):
            self.request_version = "HTTP/1.0"
        super().send_error(code, message, explain)

    def end_headers(self):
        # only send_error's headers come through here (the app's go through _GuardedServerHandler)
        for key, value in SECURITY_HEADERS:
            self.send_header(key, value)
        super().end_headers()

    def get_environ(self):
        environ = super().get_environ()
        environ[ANSWERING] = lambda: self.server.answering(self.request)
        return environ

    def log_message(self, format, *args):  # noqa: A002 - the stdlib's signature
        pass


def _closing(start_response, exc_info=None) -> list[bytes]:
    body = b"this server is closing\n"
    start_response("503 Service Unavailable", [("Content-Type", "text/plain"), ("Content-Length", str(len(body))),
                                               *SECURITY_HEADERS], exc_info)
    return [body]


def _served(app: WsgiApp, server: _ThreadingServer) -> WsgiApp:
    """`app` as the server runs it: 503 once close() started; HEAD with GET's headers and no body."""

    def served_app(environ, start_response):
        if server.is_closing:
            return _closing(start_response)
        try:
            result = app(environ, start_response)
        except Exception:
            if not server.is_closing:
                raise
            return _closing(start_response, sys.exc_info())  # what closed under it (the runtime) is no bug to log
        if environ.get("REQUEST_METHOD") != "HEAD":
            return result
        if hasattr(result, "close"):
            result.close()
        return []

    return served_app


class RunningServer:
    """A WSGI app served on a daemon thread; `close()` stops it, ends every connection and frees the port."""

    def __init__(self, app: WsgiApp, host: str, port: int):
        server_class = _ThreadingServer6 if ":" in host else _ThreadingServer
        self._server = server_class((host, port), _QuietHandler)
        self._server.set_app(_served(app, self._server))
        self.host, self.port = self._server.server_address[:2]
        self._thread = threading.Thread(target=self._server.serve_forever, name="tierkv-http", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def close(self) -> None:
        """Refuse new requests (503), stop accepting, shut every open connection and wait for its handler."""
        self._server.is_closing = True
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()
        self._server.close_connections(CLOSE_WAIT_S)


def serve(app: WsgiApp, host: str = "127.0.0.1", port: int = 0) -> RunningServer:
    """Serve `app` on host:port (0: a free port; an IPv6 address such as '::1' or '::' too) until `close()`."""
    return RunningServer(app, host, port)
