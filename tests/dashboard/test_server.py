"""tierkv.dashboard.server on real loopback sockets: close() ends every connection, IPv6 hosts, HEAD, and the
security headers on the errors the stdlib writes itself."""
from __future__ import annotations

import socket
import threading

import pytest

from tierkv.dashboard.guard import SECURITY_HEADERS
from tierkv.dashboard.server import serve


def hello(environ, start_response):
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", "6")])
    return [b"hello\n"]


def exchange(address, data: bytes, family=socket.AF_INET) -> bytes:
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(address)
        s.sendall(data)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    return reply


def handler_threads(server=None) -> list[threading.Thread]:
    """Request handler threads alive now; with `server`, only its own (other tests' servers may still be ending
    theirs in the same process)."""
    return [t for t in threading.enumerate() if "process_request_thread" in repr(getattr(t, "_target", None))
            and (server is None or getattr(t, "_target").__self__ is server._server)]


def test_close_ends_a_half_sent_request_and_frees_the_port():
    server = serve(hello)
    client = socket.create_connection((server.host, server.port), timeout=5)
    client.sendall(b"GET / HT")
    while not handler_threads(server):  # the server took the connection
        threading.Event().wait(0.01)
    server.close()
    assert handler_threads(server) == []
    try:
        client.sendall(b"TP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        assert client.recv(65536) == b""  # closed, never answered
    except (ConnectionResetError, BrokenPipeError):
        pass
    client.close()
    with socket.socket() as s:
        s.bind((server.host, server.port))  # nothing holds the port


def test_a_request_racing_close_gets_no_answer_from_the_closed_app_and_no_traceback(capfd):
    inside, closed = threading.Event(), threading.Event()

    def app(environ, start_response):
        inside.set()
        closed.wait(5)
        raise RuntimeError("this TieredLLM is closed")  # what a closed runtime says

    server = serve(app)
    replies: list[bytes] = []
    client = threading.Thread(target=lambda: replies.append(
        exchange((server.host, server.port), b"GET / HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")))
    client.start()
    assert inside.wait(5)
    closer = threading.Thread(target=server.close)
    closer.start()
    while _accepts(server.port):  # close() has begun: the listener is gone
        threading.Event().wait(0.01)
    closed.set()
    closer.join(10)
    client.join(10)
    assert not closer.is_alive() and not client.is_alive()
    assert replies[0] == b"" or replies[0].startswith(b"HTTP/1.0 503")
    assert "Traceback" not in capfd.readouterr().err


def test_after_close_a_new_request_is_refused():
    server = serve(hello)
    server.close()
    with pytest.raises(OSError):
        exchange((server.host, server.port), b"GET / HTTP/1.0\r\n\r\n")


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
def test_an_ipv6_host_is_served():
    server = serve(hello, "::1", 0)
    try:
        assert server.url.startswith("http://[::1]:")
        reply = exchange(("::1", server.port), b"GET / HTTP/1.0\r\n\r\n", socket.AF_INET6)
        assert reply.startswith(b"HTTP/1.0 200") and reply.endswith(b"hello\n")
    finally:
        server.close()


@pytest.fixture
def server():
    running = serve(hello)
    yield running
    running.close()


def test_head_has_the_headers_and_no_body(server):
    reply = exchange((server.host, server.port), b"HEAD / HTTP/1.0\r\n\r\n")
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200") and b"Content-Length: 6" in head and body == b""


@pytest.mark.parametrize("request_bytes, status", [
    (b"GET\r\n\r\n", b"400"),
    (b"GET /" + b"a" * 70000 + b" HTTP/1.0\r\n\r\n", b"414"),
    (b"GET / HTTP/1.0\r\nX: " + b"a" * 70000 + b"\r\n\r\n", b"431"),
    (b"GET / HTTP/2.0\r\n\r\n", b"505"),
])
def test_errors_of_the_stdlib_have_a_status_line_and_the_security_headers(server, request_bytes, status):
    reply = exchange((server.host, server.port), request_bytes)
    head = reply.partition(b"\r\n\r\n")[0].decode("latin-1")
    assert head.startswith(f"HTTP/1.0 {status.decode()}")
    for key, value in SECURITY_HEADERS:
        assert f"\r\n{key}: {value}" in head


def test_an_app_that_raises_gets_a_500_with_the_security_headers(capfd):
    def broken(environ, start_response):
        raise ValueError("a bug")

    running = serve(broken)
    try:
        head = exchange((running.host, running.port), b"GET / HTTP/1.0\r\n\r\n").partition(b"\r\n\r\n")[0]
    finally:
        running.close()
    assert head.startswith(b"HTTP/1.0 500")
    for key, _ in SECURITY_HEADERS:
        assert f"\r\n{key}: ".encode() in head
    assert "ValueError: a bug" in capfd.readouterr().err  # a real bug still leaves its traceback


def test_the_closing_reply_carries_the_security_headers():
    """The 503 said while close() runs is the server's own reply: it carries the headers every response does."""
    from types import SimpleNamespace

    from tierkv.dashboard.server import _served

    said = []
    body = _served(hello, SimpleNamespace(is_closing=True))({"REQUEST_METHOD": "GET"},
                                                            lambda status, headers, exc_info=None: said.append((status, headers)))
    (status, headers), = said
    assert status.startswith("503") and b"".join(body) == b"this server is closing\n"
    assert set(SECURITY_HEADERS) <= set(headers)
