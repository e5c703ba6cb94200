"""One HTTP exchange with a deadline its socket carries: what `tierkv budget` and `EndpointSource` send.

Primitives: `exchange` (a request and its reply, at most `max_body_bytes` + 1 bytes of body read), `HttpReply`.

urllib's timeout bounds each socket operation only (a server sending a byte a second holds the caller for ever),
and a thread run past a deadline is left behind with its socket. Here the socket itself has the deadline: each
connect, send and read waits at most `timeout_s`, none starts past the deadline (TimeoutError then), and the socket
is closed whatever happens, so nothing outlives the call. The endpoint is talked to directly: no proxy from the
environment sees a bearer token meant for it, and a redirect is a reply like any other (never followed).
"""
from __future__ import annotations

import http.client
import io
import time
import urllib.parse
from dataclasses import dataclass


@dataclass(frozen=True)
class HttpReply:
    status: int
    reason: str
    headers: http.client.HTTPMessage
    body: bytes  # at most max_body_bytes + 1: longer means the reply was cut


def exchange(method: str, url: str, *, body: bytes | None = None, headers: dict[str, str] | None = None,
             timeout_s: float, total_s: float, max_body_bytes: int) -> HttpReply:
    """`method` `url` (http or https) with `body` and `headers`, within `total_s` in all (each socket operation at
    most `timeout_s`): the reply, whatever its status. TimeoutError past the deadline; OSError (a refused
    connection, a TLS failure) or http.client.HTTPException (a reply that is not HTTP) as they come."""
    deadline = time.monotonic() + total_s
    parts = urllib.parse.urlsplit(url)
    connection_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    connection = connection_class(parts.hostname, parts.port, timeout=min(timeout_s, total_s))
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    sock = None
    try:
        connection.connect()
        sock = connection.sock
        connection.sock = _DeadlineSocket(sock, deadline, timeout_s)
        connection.request(method, target, body=body, headers={**(headers or {}), "Connection": "close"})
        response = connection.getresponse()
        reply_body = response.read(max_body_bytes + 1)
        return HttpReply(response.status, response.reason, response.headers, reply_body)
    finally:
        connection.close()
        if sock is not None:
            sock.close()


class _DeadlineSocket:
    """A connected socket whose every send and read waits at most `timeout_s` and none starts past `deadline`
    (time.monotonic()): TimeoutError then. Given to http.client in place of its socket."""

    def __init__(self, sock, deadline: float, timeout_s: float):
        self._sock, self._deadline, self._timeout_s = sock, deadline, timeout_s

    def _arm(self) -> None:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no complete reply within the deadline")
        self._sock.settimeout(min(self._timeout_s, left))

    def sendall(self, data) -> None:
        self._arm()
        self._sock.sendall(data)

    def recv_into(self, buffer, nbytes: int = 0) -> int:
        self._arm()
        return self._sock.recv_into(buffer, nbytes)

    def makefile(self, mode: str = "rb", *args, **kwargs):
        return io.BufferedReader(_DeadlineReader(self))

    def close(self) -> None:
        pass  # http.client closes its socket before the body is read: `exchange` closes the real one after


class _DeadlineReader(io.RawIOBase):
    def __init__(self, sock: _DeadlineSocket):
        self._sock = sock

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        return self._sock.recv_into(buffer)
