"""GET /api/snapshots from a recorder: capped at MAX_REPLY_LINES, and the recorder's lock held only to copy."""
from __future__ import annotations

import json
import threading

from tierkv.dashboard import app as dashboard
from tierkv.metrics import history
from tierkv.metrics.recorder import MetricsRecorder
from tierkv.metrics.sources import RecorderSource


def call(app, query: str) -> dict:
    replies = []
    body = b"".join(app({"REQUEST_METHOD": "GET", "PATH_INFO": "/api/snapshots", "QUERY_STRING": query},
                        lambda status, headers, exc_info=None: replies.append(status)))
    assert replies == ["200 OK"]
    return json.loads(body)


def test_a_reply_holds_the_newest_max_reply_lines(monkeypatch):
    monkeypatch.setattr(dashboard, "MAX_REPLY_LINES", 5)
    recorder = MetricsRecorder(lambda: {})
    for _ in range(12):
        recorder.snapshot()
    reply = call(dashboard.dashboard_app(RecorderSource(recorder)), "since=0")
    assert [line["seq"] for line in reply["lines"]] == [7, 8, 9, 10, 11] and reply["next"] == 12
    assert [line["seq"] for line in call(dashboard.dashboard_app(RecorderSource(recorder)), "since=10")["lines"]] \
        == [10, 11]


def test_a_poll_decodes_nothing_while_holding_the_recorder_lock(monkeypatch):
    recorder = MetricsRecorder(lambda: {})
    for _ in range(20):
        recorder.snapshot()
    held = threading.local()

    class WatchedLock:
        def __init__(self, lock):
            self._lock = lock

        def __enter__(self):
            self._lock.acquire()
            held.depth = getattr(held, "depth", 0) + 1

        def __exit__(self, *exc):
            held.depth -= 1
            self._lock.release()

    decoded_under_lock = []
    real_loads = json.loads

    def loads(*args, **kwargs):
        decoded_under_lock.append(getattr(held, "depth", 0) > 0)
        return real_loads(*args, **kwargs)

    recorder._lock = WatchedLock(recorder._lock)
    monkeypatch.setattr(history.json, "loads", loads)  # (the json module: every decode is seen)
    assert len(recorder.lines_since(0)[0]) == 20
    call(dashboard.dashboard_app(RecorderSource(recorder)), "since=0")
    assert decoded_under_lock and not any(decoded_under_lock)
