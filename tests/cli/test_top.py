"""`tierkv top`: one frame of a recorded JSONL and of a live endpoint; errors."""
from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.metrics.workload import record_jsonl
from tierkv.cli import main
from tierkv.metrics import MetricsRecorder
from tierkv.metrics.server import start_metrics_server


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    path, _, stats = record_jsonl(tmp_path_factory.mktemp("top"))
    return path, stats


def test_once_on_a_recorded_run_shows_the_figures(recorded, capsys):
    path, stats = recorded
    assert main(["top", "--jsonl", str(path), "--once"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()}
    tiers = {t["tier"]: t for t in stats["tiers"]}
    for tier in ("cpu", "disk"):
        assert rows[tier][3:6] == [str(tiers[tier]["lookups"]), str(tiers[tier]["hits"]), str(tiers[tier]["misses"])]
    assert rows["gpu"][1].endswith("%")
    assert "snapshot 4 (final)" in out
    assert "late chunks (stalls) 0" in out and "stall time 0.000 s" in out  # exact mode on CPU: none late
    assert "precision -, recall - (no predictor has reported: exact mode)" in out
    assert "requests  3: 609 prompt tokens (200 reused), 12 generated" in out


def test_once_on_a_live_endpoint(capsys):
    recorder = MetricsRecorder(lambda: {"transfer": {"h2d_bytes": 5, "d2h_bytes": 0}})
    recorder.snapshot("start")
    server = start_metrics_server(recorder, 0)
    try:
        assert main(["top", "--endpoint", server.url, "--once"]) == 0
        assert f"tierkv top - {server.url} - run {recorder.run_id}" in capsys.readouterr().out
    finally:
        server.close()
        recorder.close()
    assert main(["top", "--endpoint", server.url, "--once"]) == 1
    assert "tierkv top: error:" in capsys.readouterr().err


def test_an_empty_jsonl_has_nothing_to_show(tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text("")
    assert main(["top", "--jsonl", str(tmp_path / "empty.jsonl"), "--once"]) == 1
    assert "no snapshots in" in capsys.readouterr().err


def test_a_file_that_is_not_metrics_is_named(tmp_path, capsys):
    (tmp_path / "x.jsonl").write_text('{"a": 1}\n')
    assert main(["top", "--jsonl", str(tmp_path / "x.jsonl"), "--once"]) == 2  # bad input, as for `dashboard`
    assert "x.jsonl:1: not a tierkv metrics snapshot" in capsys.readouterr().err


@pytest.mark.skipif(not os.path.exists("/proc/self/mem"), reason="needs Linux's /proc")
def test_a_file_that_opens_but_cannot_be_read_is_named(capsys):
    assert main(["top", "--jsonl", "/proc/self/mem", "--once"]) == 2  # a regular file; reading it gives EIO
    err = capsys.readouterr().err
    assert "/proc/self/mem: cannot read (" in err and "OSError" not in err, err


@pytest.mark.parametrize("argv,message", [
    (["top", "--jsonl", "/no/such.jsonl", "--once"], "no such file"),
    (["top", "--endpoint", "127.0.0.1:1", "--once"], "expected http://host:port"),
    (["top", "--jsonl", "x", "--interval", "0"], "--interval: got 0.0"),
    (["top", "--jsonl", "x", "--interval", "nan"], "--interval: got nan; must be a finite number > 0"),
])
def test_bad_arguments_exit_2(capsys, argv, message):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_a_source_is_required(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["top", "--once"])
    assert exit_info.value.code == 2


def _line_with_big_figures() -> dict:
    tiers = [{"tier": name, "lookups": 123456789, "hits": 98765432, "misses": 24691357, "hit_rate": 0.8,
              "bytes_read": 3 * 2**40, "bytes_written": 5 * 2**39, "latency": {}} for name in ("cpu", "disk", "redis")]
    clock = iter(float(t) for t in range(100, 200))
    totals = {"n": 0}
    recorder = MetricsRecorder(lambda: {"tiers": [dict(t, lookups=t["lookups"] + totals["n"]) for t in tiers],
                                        "transfer": {"h2d_bytes": 2**40 + totals["n"], "d2h_bytes": 2**39},
                                        "gpu": {"resident_bytes": 2**33, "staging_bytes": 2**30, "budget_bytes": 2**34}},
                               clock=lambda: next(clock))
    recorder.snapshot("start")
    totals["n"] = 10**9
    return recorder.snapshot()


@settings(max_examples=60, deadline=None)
@given(st.integers(20, 240))
def test_a_frame_never_exceeds_the_console_width(width):
    from tierkv.cli.top import COLUMN_PRIORITY, TIER_COLUMNS, render

    frame = render(_line_with_big_figures(), "http://127.0.0.1:9400", width=width)
    lines = frame.splitlines()
    assert all(len(line) <= width for line in lines), [line for line in lines if len(line) > width]
    header = next(line for line in lines if line.split()[:1] == ["tier"])
    shown = [h.strip() for h in header.split("  ") if h.strip()]
    assert shown == [h for h, _ in TIER_COLUMNS if h in shown]  # display order kept
    assert shown == sorted(COLUMN_PRIORITY[:len(shown)], key=[h for h, _ in TIER_COLUMNS].index)  # most useful kept
    if width >= 80:  # the counts a user looks for first stay on an 80-column terminal
        assert all(h in header for h in ("hit rate", "lookups", "hits", "misses"))
    if width >= 160:
        assert all(h in header for h, _ in TIER_COLUMNS)
    assert "requests" in frame and "GPU KV" in frame  # the summary lines wrap, never vanish


def test_top_fits_the_terminal_width_from_columns(recorded, capsys, monkeypatch):
    path, _ = recorded
    monkeypatch.setenv("COLUMNS", "60")
    assert main(["top", "--jsonl", str(path), "--once"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 60 and "lookups" in out


def test_names_and_ids_from_the_jsonl_never_reach_the_terminal_as_escape_codes():
    """Whoever can write a shared JSONL chose tier names, run ids and kinds that `top` printed raw: a screen
    clear, colours, a window title. Every control character but the newline is shown as '?'."""
    from tierkv.cli.top import render

    line = _line_with_big_figures()
    line["figures"] = {k.replace("tier.disk.", "tier.di\x1b[31mRED\x1b[0msk."): v for k, v in line["figures"].items()}
    line["run_id"], line["kind"] = "r\x1b]0;title\x07", "k\x1b[2J\x9b"
    frame = render(line, "shared.jsonl", width=200)
    assert not any(c in frame for c in "\x1b\x07\x9b") and "di?[31mRED?[0msk" in frame and "k?[2J?" in frame
