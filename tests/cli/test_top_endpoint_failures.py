"""`tierkv top --endpoint` when the endpoint fails after a good answer, or trickles its reply."""
from __future__ import annotations

import json
import socket
import threading
import time
from types import SimpleNamespace

import pytest

from tierkv.cli import top
from tierkv.dashboard.server import serve
from tierkv.metrics.recorder import MetricsRecorder
from tierkv.metrics.sources import EndpointSource, SourceError


def test_an_endpoint_that_stops_answering_is_said_with_the_age_of_the_figures(monkeypatch, capsys):
    line = MetricsRecorder(lambda: {}).snapshot()
    polls = []

    def app(environ, start_response):
        polls.append(1)
        if len(polls) > 1:
            start_response("502 Bad Gateway", [("Content-Type", "application/json")])
            return [b'{"error": "engine gone"}']
        body = json.dumps({"lines": [line], "next": 1}).encode()
        start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
        return [body]

    server = serve(app)
    sleeps = []

    def sleep(s):
        sleeps.append(s)
        if len(sleeps) >= 2:
            raise KeyboardInterrupt

    # `top`'s own clock only: patching the time module's sleep would hand the interrupt to any other thread of the
    # run that sleeps (a subprocess wait of an earlier test's fixture), and `top` would then poll for ever
    monkeypatch.setattr(top, "time", SimpleNamespace(sleep=sleep, monotonic=time.monotonic))
    args = type("Args", (), {"endpoint": server.url, "jsonl": None, "interval": 0.1, "once": False})()
    try:
        assert top.run_top(args) == 0
    finally:
        server.close()
    out = capsys.readouterr()
    second_frame = out.out.split("tierkv top: error:")
    assert len(second_frame) == 2 and "Bad Gateway" in second_frame[1] and "s old" in second_frame[1]
    assert "tierkv top: error:" in out.err


@pytest.fixture
def trickler():
    """A server that takes a connection and sends one byte of a reply every 50 ms, for as long as it stays open."""
    listener = socket.create_server(("127.0.0.1", 0))
    ended = []  # one per connection the client closed

    def trickle(conn):
        with conn:
            conn.recv(65536)
            try:
                for byte in b"HTTP/1.0 200 OK\r\n" + b"X: " + b"a" * 100000:
                    conn.sendall(bytes([byte]))
                    threading.Event().wait(0.05)
            except OSError:
                ended.append(1)

    def accept():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=trickle, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield listener.getsockname()[1], ended
    listener.close()


def test_a_trickling_endpoint_ends_the_poll_and_leaves_no_thread_or_socket(trickler):
    port, ended = trickler
    source = EndpointSource(f"http://127.0.0.1:{port}", timeout_s=0.2)
    before = threading.active_count()
    with pytest.raises(SourceError):
        source.lines_since(0)
    assert threading.active_count() <= before + 1  # (the trickler's own thread for this connection)
    for _ in range(100):  # the client closed its socket: the trickler's next send fails
        if ended:
            break
        threading.Event().wait(0.05)
    assert ended
