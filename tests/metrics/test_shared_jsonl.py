"""A metrics JSONL another process or user shares is read as untrusted: lines a viewer cannot draw are refused by
name (NaN or Infinity, which the page's JSON.parse refuses; histograms, prefetch detail or times of the wrong
shape; numbers past a float); the file is never followed through a link or waited on as a FIFO, never read or
kept without bound, and read again from its start when rewritten shorter. A report page is never written through
a link planted at its path."""
from __future__ import annotations

import json
import os
import time

import pytest

from tierkv.dashboard.page import write_page
from tierkv.metrics.sources import JsonlSource, SourceError, parse_line
from tierkv.metrics.snapshot import SCHEMA


def line(seq: int, **over) -> dict:
    base = {"schema": SCHEMA, "run_id": "r1", "seq": seq, "kind": "interval", "t": 1.7e9 + seq, "elapsed_s": float(seq),
            "figures": {"tier.cpu.hits": 1}, "rates": {}, "latency": {}, "info": {}}
    return {**base, **over}


def write(path, *lines) -> None:
    with open(path, "a") as f:
        for item in lines:
            f.write((item if isinstance(item, str) else json.dumps(item)) + "\n")


@pytest.mark.parametrize("bad, named", [
    ('{"schema": "%s", "run_id": "r", "seq": 1, "kind": "i", "t": 1, "elapsed_s": 1, "figures": {"x": NaN}, '
     '"rates": {}}' % SCHEMA, "not JSON"),
    (json.dumps(line(1, figures={"x": 10**400})), "a number or null"),
    (json.dumps(line(1, t=1e20)), "out of range"),
    (json.dumps(line(1, latency={"cpu.get": {"count": 1}})), "latency"),
    (json.dumps(line(1, latency=[1])), "latency"),
    (json.dumps(line(1, prefetch_chunks={})), "prefetch_chunks"),
    (json.dumps(line(1, prefetch_chunks={"n": [1], "t": [1.0], "layer": [0], "is_late": [0], "wait_s": []})),
     "equal-length"),
])
def test_a_line_a_viewer_cannot_draw_is_refused_by_name(bad, named):
    with pytest.raises(SourceError, match=named):
        parse_line(bad, "f:2")


def test_a_recorded_line_keeps_nulls_and_a_good_histogram():
    good = line(1, latency={"cpu.get": {"buckets_s": [0.001, 0.01], "counts": [1, 2, 0], "sum_s": 0.02, "count": 3}},
                prefetch_chunks={"n": [0], "t": [1.0], "layer": [0], "is_late": [0], "wait_s": [None]})
    assert parse_line(json.dumps(good), "f:1") == good


def test_the_file_swapped_for_a_link_or_a_fifo_is_refused_without_waiting(tmp_path):
    path = tmp_path / "m.jsonl"
    write(path, line(0))
    source = JsonlSource(path)
    assert len(source.lines_since(0)[0]) == 1
    path.unlink()
    os.symlink("/dev/zero", path)
    with pytest.raises(SourceError, match="cannot read"):  # O_NOFOLLOW: never read /dev/zero without end
        source.lines_since(1)
    path.unlink()
    os.mkfifo(path)
    started = time.monotonic()
    with pytest.raises(SourceError, match="not a regular file"):
        source.lines_since(1)
    assert time.monotonic() - started < 5


def test_reads_and_kept_lines_are_bounded_and_a_rewritten_file_is_read_again(tmp_path, monkeypatch):
    monkeypatch.setattr(JsonlSource, "MAX_LINE_BYTES", 4096)
    monkeypatch.setattr(JsonlSource, "READ_BYTES", 8192)
    monkeypatch.setattr(JsonlSource, "KEEP_LINES", 5)
    path = tmp_path / "m.jsonl"
    write(path, line(0), "x" * 20000)  # a line longer than MAX_LINE_BYTES
    source = JsonlSource(path)
    assert [entry["seq"] for entry in source.lines_since(0)[0]] == [0]  # the long line is not whole yet
    with pytest.raises(SourceError, match="longer than 4096 bytes"):
        source.lines_since(1)
    write(path, *(line(i) for i in range(1, 9)))
    seen = []
    for _ in range(6):  # the long line is skipped in pieces of READ_BYTES, then the lines after it come
        lines, total = source.lines_since(0)
        seen = [entry["seq"] for entry in lines]
    assert total == 9 and seen == [4, 5, 6, 7, 8]  # the newest KEEP_LINES of the 9 read
    path.write_text(json.dumps(line(0, run_id="r2")) + "\n")  # rewritten, shorter
    lines, total = source.lines_since(total)
    assert [entry["run_id"] for entry in lines] == ["r2"] and total == 10


def test_a_report_page_is_never_written_through_a_planted_link(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    page = tmp_path / "report.html"
    os.symlink(victim, page)
    with pytest.raises(OSError):
        write_page(page, "<!doctype html>")
    assert victim.read_text() == "keep me"
    page.unlink()
    write_page(page, "<!doctype html>")
    assert page.read_text() == "<!doctype html>"


def test_the_recorder_writes_a_non_finite_figure_as_null(tmp_path):
    from tierkv.metrics.recorder import _finite

    assert json.dumps(_finite({"a": [float("nan"), 1.5], "b": {"c": float("inf")}}), allow_nan=False) == \
        '{"a": [null, 1.5], "b": {"c": null}}'


def test_a_report_and_top_once_read_a_file_past_one_polls_bytes_to_its_newest_line(tmp_path, capsys):
    """One poll reads at most READ_BYTES: the report of a long JSONL showed only its first 8 MiB (an older run)."""
    from tierkv.cli import main
    from tierkv.dashboard.page import write_report

    path = tmp_path / "long.jsonl"
    text = json.dumps(line(0, run_id="OLDRUN")) + "\n"
    with open(path, "w") as f:
        f.write(text * (JsonlSource.READ_BYTES // len(text) + 2000))
    write(path, line(1, run_id="NEWRUN"))
    report = tmp_path / "r.html"
    assert write_report(path, report) == JsonlSource.READ_BYTES // len(text) + 2001
    assert "NEWRUN" in report.read_text()
    assert main(["top", "--jsonl", str(path), "--once"]) == 0
    assert "NEWRUN" in capsys.readouterr().out


def test_a_torn_line_is_skipped_by_readers_and_a_new_run_starts_a_line_of_its_own(tmp_path, capsys):
    """A run killed mid-line left a torn tail: the next run's recorder starts on a new line, and a report, a
    dashboard page and `top --once` read past the torn line (saying so) instead of failing."""
    from tierkv.cli import main
    from tierkv.dashboard.page import write_report
    from tierkv.metrics.recorder import MetricsRecorder

    path = tmp_path / "m.jsonl"
    write(path, line(0, run_id="first"))
    with open(path, "a") as f:
        f.write(json.dumps(line(1, run_id="first"))[:40])  # torn: no newline
    recorder = MetricsRecorder(lambda: {"gpu": {"budget_bytes": 1}}, jsonl_path=path)
    recorder.snapshot("final")
    recorder.close()
    errors = []
    lines = JsonlSource(path).read_to_end(errors.append)
    assert [item["run_id"] for item in lines][0] == "first" and lines[-1]["run_id"] == recorder.run_id
    assert len(errors) == 1 and "m.jsonl:2: not JSON" in str(errors[0])  # the torn piece, a line of its own
    with open(path, "a") as f:
        f.write("{torn\n")
    write(path, line(2, run_id="after"))
    errors = []
    lines = JsonlSource(path).read_to_end(errors.append)
    assert len(errors) == 2 and lines[-1]["run_id"] == "after"  # the 40-byte piece and "{torn"
    assert write_report(path, tmp_path / "r.html", on_error=lambda exc: None) == len(lines)
    assert main(["dashboard", "--jsonl", str(path), "--html", str(tmp_path / "d.html")]) == 0
    assert main(["top", "--jsonl", str(path), "--once"]) == 0
    captured = capsys.readouterr()
    assert "after" in captured.out and "skipped" in captured.err


def test_json_nested_too_deep_is_a_bad_line_not_a_recursion_error(tmp_path):
    path = tmp_path / "deep.jsonl"
    write(path, line(0), "[" * 200_000 + "]" * 200_000, line(1))
    errors = []
    lines = JsonlSource(path).read_to_end(errors.append)
    assert [item["seq"] for item in lines] == [0, 1]
    assert len(errors) == 1 and "nested too deep" in str(errors[0])
