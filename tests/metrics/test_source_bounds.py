"""What a viewer's source keeps: an endpoint's lines bounded as a JSONL's are, and a JSONL line over
MAX_LINE_BYTES skipped (with an error) even when it is whole in one read."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.metrics.snapshot import SCHEMA
from tierkv.metrics.sources import EndpointSource, JsonlSource, SourceError


def line(seq: int, **over) -> dict:
    base = {"schema": SCHEMA, "run_id": "r1", "seq": seq, "kind": "interval", "t": 1.7e9 + seq, "elapsed_s": float(seq),
            "figures": {"tier.cpu.hits": 1}, "rates": {}}
    return {**base, **over}


class _Replies:
    """Stands in for the server: each fetch answers the next `per_poll` lines after `since`."""

    def __init__(self, per_poll: int):
        self.per_poll = per_poll
        self.bad_at: int | None = None  # a line number answered malformed

    def __call__(self, url: str) -> bytes:
        since = int(url.rsplit("since=", 1)[1])
        lines = [line(i) for i in range(since, since + self.per_poll)]
        if self.bad_at is not None and since <= self.bad_at < since + self.per_poll:
            lines[self.bad_at - since] = line(self.bad_at, t=float("inf"))
        return json.dumps({"lines": lines, "next": since + self.per_poll}).encode()


def test_an_endpoint_keeps_only_the_newest_lines(monkeypatch):
    monkeypatch.setattr(EndpointSource, "KEEP_LINES", 50, raising=False)
    source = EndpointSource("http://127.0.0.1:9")
    monkeypatch.setattr(source, "_fetch", _Replies(per_poll=20))
    n = 0
    for poll in range(30):  # what `top --endpoint` and the dashboard do: ask for what is new since the last
        new, next_n = source.lines_since(n)
        assert [entry["seq"] for entry in new] == list(range(n, n + 20)) and next_n == n + 20
        n = next_n
        assert len(source._lines) <= 50
    oldest, total = source.lines_since(0)  # older than kept: from the oldest kept, numbered as before
    assert total == 620 and [entry["seq"] for entry in oldest] == list(range(570, 620))


def test_an_endpoints_bad_line_keeps_none_of_its_reply(monkeypatch):
    """A bad line used to keep the lines before it, fetched and added again at every poll."""
    source = EndpointSource("http://127.0.0.1:9")
    replies = _Replies(per_poll=5)
    replies.bad_at = 3
    monkeypatch.setattr(source, "_fetch", replies)
    for _ in range(3):
        with pytest.raises(SourceError, match="line 3"):
            source.lines_since(0)
    replies.bad_at = None
    lines, total = source.lines_since(0)
    assert [entry["seq"] for entry in lines] == [0, 1, 2, 3, 4] and total == 5


def test_a_whole_line_over_the_limit_is_skipped_not_read(tmp_path, monkeypatch):
    monkeypatch.setattr(JsonlSource, "MAX_LINE_BYTES", 4096)
    path = tmp_path / "m.jsonl"
    big = json.dumps(line(1, info={"x": "y" * 20000}))  # valid JSON, whole in one read (READ_BYTES is 8 MiB)
    path.write_text("\n".join([json.dumps(line(0)), big, json.dumps(line(2))]) + "\n")
    source = JsonlSource(path)
    with pytest.raises(SourceError, match="longer than 4096 bytes"):
        source.lines_since(0)
    lines, total = source.lines_since(0)
    assert [entry["seq"] for entry in lines] == [0, 2] and total == 2
    errors = []
    assert [entry["seq"] for entry in JsonlSource(path).read_to_end(errors.append)] == [0, 2]
    assert len(errors) == 1 and "longer than 4096" in str(errors[0])


def test_a_line_of_exactly_the_limit_is_read(tmp_path, monkeypatch):
    text = json.dumps(line(0))
    monkeypatch.setattr(JsonlSource, "MAX_LINE_BYTES", len(text))
    path = tmp_path / "m.jsonl"
    path.write_text(text + "\n")
    assert [entry["seq"] for entry in JsonlSource(path).lines_since(0)[0]] == [0]


def test_tops_endpoint_source_keeps_only_the_line_it_draws(monkeypatch):
    source = EndpointSource("http://127.0.0.1:9", keep_lines=1)
    monkeypatch.setattr(source, "_fetch", _Replies(per_poll=20))
    n = 0
    for _ in range(5):
        new, n = source.lines_since(n)
        assert [entry["seq"] for entry in new] == [n - 1] and len(source._lines) == 1


@settings(max_examples=60)
@given(st.lists(st.sampled_from(["good", "blank", "not json", "not metrics", "long", "crlf"]), max_size=14),
       st.integers(1, 64))
def test_a_skipped_line_is_named_by_its_line_in_the_file(tmp_path_factory, kinds, read_bytes):
    """Blank lines, bad lines and lines over MAX_LINE_BYTES count as the file counts them, in any read size."""
    texts = {"blank": "", "not json": "not json", "not metrics": '{"a": 2}', "long": "x" * 300}
    rows, expected_bad = [], []
    for number, kind in enumerate(kinds, start=1):
        text = json.dumps(line(number)) if kind in ("good", "crlf") else texts[kind]
        rows.append(text + ("\r" if kind == "crlf" else ""))
        if kind in ("not json", "not metrics", "long"):
            expected_bad.append(number)
    path = tmp_path_factory.mktemp("jsonl") / "m.jsonl"
    path.write_text("".join(row + "\n" for row in rows), newline="")
    source = JsonlSource(path)
    source.MAX_LINE_BYTES, source.READ_BYTES = 200, 200 + read_bytes  # a long line split across reads too
    errors: list = []
    kept = source.read_to_end(errors.append)
    named = [int(str(exc).rsplit("line ", 1)[1].rstrip(")")) if "longer than" in str(exc)
             else int(str(exc).split(":", 2)[1]) for exc in errors]
    assert named == expected_bad
    assert [entry["seq"] for entry in kept] == [n for n, k in enumerate(kinds, start=1) if k in ("good", "crlf")]
