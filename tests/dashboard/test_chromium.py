"""The dashboard in a real headless Chromium, on a JSONL recorded from a real CPU run: the page
loads (as a static report and served by `tierkv dashboard`'s app), every chart holds exactly the
recorded values, legends show last values, byte axes tick at round binary values, the requests
table shows each request's own number, and a screenshot is kept (tests/artifacts/)."""
from __future__ import annotations

import json
import math
import re

import pytest

from tests.dashboard.chromium import dump_dom, find_chromium, keep_artifact, parse_dom, screenshot
from tests.metrics.workload import read_lines, record_jsonl
from tierkv.dashboard import dashboard_app, serve, write_report
from tierkv.metrics.sources import JsonlSource
from tierkv.units import format_bytes


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    find_chromium()  # fail (CI) or skip before spending time on the run
    tmp = tmp_path_factory.mktemp("recorded")
    path, outputs, stats = record_jsonl(tmp, snapshot_interval_s=0.05)
    return path, outputs, stats


def expected_charts(lines: list[dict]) -> dict:
    """What each chart must hold, read from the JSONL without the page's code: {chart: {label: values}}."""
    tiers = ["gpu", "cpu", "disk"]
    rate = lambda key: [line["rates"].get(key) for line in lines]  # noqa: E731
    total = lambda key: [line["figures"].get(key) for line in lines]  # noqa: E731
    bytes_series = {"H2D (CPU→GPU)": rate("transfer.h2d_bytes_per_s"), "D2H (GPU→CPU)": rate("transfer.d2h_bytes_per_s")}
    for tier in ("cpu", "disk"):
        bytes_series[f"{tier} read"] = rate(f"tier.{tier}.bytes_read_per_s")
        bytes_series[f"{tier} written"] = rate(f"tier.{tier}.bytes_written_per_s")
    return {
        "hitrate": {tier: rate(f"tier.{tier}.hit_rate_interval") for tier in tiers},
        "bytes": bytes_series,
        "stalls": {"late chunks in interval": rate("scheduler.stalls_interval"), "late chunks, total": total("scheduler.stalls"),
                   "stall time in interval": rate("prefetch.stall_s_interval")},
        "gpu": {"resident": total("gpu.resident_bytes"), "staging": total("gpu.staging_bytes"),
                "held": total("gpu.held_bytes"), "budget": total("gpu.budget_bytes"),
                "returned": total("gpu.returned_bytes")},
        "timeline": timeline_of(lines),
        "latency": {f"{t}.{op}": rate(f"latency.{t}.{op}.mean_s_interval") for t in ("cpu", "disk") for op in ("get", "put")},
    }


def timeline_x_and_chunks(lines: list[dict]) -> tuple[list, dict]:
    """The prefetch timeline: every chunk of the run at its time since the run started (x), its layer
    in the on-time or the late series, and its wait."""
    run_start = lines[0]["t"] - lines[0]["elapsed_s"]
    points = sorted((t - run_start, layer, late, wait) for line in lines if line.get("prefetch_chunks")
                    for t, layer, late, wait in zip(*(line["prefetch_chunks"][k] for k in ("t", "layer", "is_late", "wait_s"))))
    return [p[0] for p in points], {"layer of a chunk on time": [None if p[2] else p[1] for p in points],
                                     "layer of a late chunk": [p[1] if p[2] else None for p in points],
                                     "wait": [p[3] for p in points]}


def timeline_of(lines: list[dict]) -> dict:
    return timeline_x_and_chunks(lines)[1]


def byte_ticks(labels: list[str], unit: str) -> list[float]:
    """Tick labels such as "512 MiB/s" back to bytes; each must be a plain number and a binary unit."""
    scale = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
    values = []
    for label in labels:
        match = re.fullmatch(rf"(\d+(?:\.\d+)?) (B|KiB|MiB|GiB|TiB){re.escape(unit)}", label)
        assert match, f"tick label {label!r}"
        values.append(float(match.group(1)) * scale[match.group(2)])
    return values


def check_round_binary_ticks(labels: list[str], unit: str) -> None:
    """Evenly spaced ticks, the step a power of two (bytes), every tick a multiple of it."""
    values = byte_ticks(labels, unit)
    steps = {b - a for a, b in zip(values, values[1:])}
    assert len(values) >= 3 and len(steps) == 1, labels
    step = steps.pop()
    assert step == 2 ** round(math.log2(step)), f"step {step} is not a power of two: {labels}"
    assert all(v % step == 0 for v in values), labels


def check_legends(dom, lines: list[dict]) -> None:
    """No legend shows a dash: each shows its series' last value (or "none" when it has none)."""
    for chart, legend in dom.legends.items():
        assert legend, chart
        for label, value in legend.items():
            assert value not in ("–", "--", ""), f"{chart} / {label}: {value!r}"
    held = [line["figures"]["gpu.held_bytes"] for line in lines]
    assert dom.legends["gpu"]["held"] == format_bytes(held[-1])
    for chart, series in expected_charts(lines).items():
        for label, values in series.items():
            if not any(v is not None for v in values):
                assert dom.legends[chart][label] == "none", (chart, label)


def check_page(html: str, lines: list[dict]) -> None:
    dom = parse_dom(html)
    assert dom.body.get("data-ready") == "true", "the page's scripts did not finish drawing"
    assert dom.body.get("data-snapshots") == str(len(lines))
    expected = expected_charts(lines)
    assert set(dom.figures) == set(expected)
    for chart, series in expected.items():
        drawn = json.loads(dom.figures[chart]["data-series"])
        assert drawn["labels"] == list(series), chart
        x_values = timeline_x_and_chunks(lines)[0] if chart == "timeline" else [line["t"] for line in lines]
        assert drawn["data"][0] == x_values, f"{chart}: x values"  # the timeline's: seconds since the run started
        for label, values, drawn_values in zip(series, series.values(), drawn["data"][1:]):
            assert drawn_values == values, f"{chart} / {label}"
    gpu_hit_rate = lines[-1]["figures"]["tier.gpu.hit_rate"]
    assert f"{100 * gpu_hit_rate:.1f}%" in dom.cards  # the GPU hit-rate card
    assert "n/a" in dom.cards  # prefetch precision: nothing reported in exact mode
    check_legends(dom, lines)
    check_round_binary_ticks(json.loads(dom.figures["bytes"]["data-ticks"]), "/s")
    check_round_binary_ticks(json.loads(dom.figures["gpu"]["data-ticks"]), "")
    check_requests_table(dom, lines)


def check_requests_table(dom, lines: list[dict]) -> None:
    """The last 20 requests, numbered as the run counted them; reused blocks as words, not JSON."""
    requests = [line for line in lines if line.get("request")]
    rows = dom.tables["requests"][1:]
    assert [row[0] for row in rows] == [str(line["figures"]["requests.requests"]) for line in requests][-20:]
    for row, line in zip(rows, requests[-20:]):
        by_tier = line["request"]["prefix_blocks_by_tier"]
        assert row[3] == (", ".join(f"{tier} {n} block{'s' * (n != 1)}" for tier, n in by_tier.items()) or "none")


def test_the_recorded_run_has_values_worth_charting(recorded):
    path, _, _ = recorded
    lines = read_lines(path)
    assert [line["kind"] for line in lines].count("request") == 3 and lines[-1]["kind"] == "final"
    assert lines[-1]["figures"]["tier.gpu.lookups"] > 0 and lines[-1]["figures"]["tier.disk.hits"] > 0
    assert any(expected_charts(lines)["bytes"]["H2D (CPU→GPU)"])
    # the hit-rate chart's GPU values, counted again from the running totals
    with_gpu = [line for line in lines if "tier.gpu.hits" in line["figures"]]
    for before, line in zip(with_gpu, with_gpu[1:]):
        hits = line["figures"]["tier.gpu.hits"] - before["figures"]["tier.gpu.hits"]
        lookups = line["figures"]["tier.gpu.lookups"] - before["figures"]["tier.gpu.lookups"]
        assert line["rates"]["tier.gpu.hit_rate_interval"] == (hits / lookups if lookups else None)


def test_static_report_in_chromium_holds_the_recorded_values(recorded, tmp_path):
    path, _, _ = recorded
    report = tmp_path / "dashboard-report.html"
    assert write_report(path, report) == len(read_lines(path))
    html = dump_dom(report.as_uri(), tmp_path / "profile")
    check_page(html, read_lines(path))


def test_served_dashboard_in_chromium_holds_the_recorded_values_and_is_screenshotted(recorded, tmp_path):
    path, _, _ = recorded
    server = serve(dashboard_app(JsonlSource(path), poll_ms=500), "127.0.0.1", 0)
    try:
        html = dump_dom(f"{server.url}/", tmp_path / "profile-dom")
        check_page(html, read_lines(path))
        shot = screenshot(f"{server.url}/", tmp_path / "profile-shot", tmp_path / "dashboard-cpu-run.png")
    finally:
        server.close()
    keep_artifact(shot)
    keep_artifact(path)


def test_timeline_in_time_stall_time_request_numbers_and_binary_ticks_of_a_long_run(tmp_path):
    """A recorder fed by a PrefetchRecorder and a source of growing totals: the prefetch timeline
    puts each chunk at its time since the run started (chunks joined across lines, each line
    carrying only its new ones); 25 requests show as 6..25; gigabytes per second tick at round
    binary values; legends show the last values."""
    from tierkv.dashboard import static_page
    from tierkv.metrics import MetricsRecorder, PrefetchRecorder

    ticks = iter(float(t) for t in range(100, 400))
    clock = lambda: next(ticks)  # noqa: E731 - one clock for both: snapshots and chunks interleave
    prefetch = PrefetchRecorder(num_layers=4, clock=clock)
    totals = {"requests": 0, "h2d": 0}
    recorder = MetricsRecorder(lambda: {"scheduler": {"stalls": 0}, "prefetch": prefetch.snapshot(),
                                        "transfer": {"h2d_bytes": totals["h2d"], "d2h_bytes": 0},
                                        "requests": {"requests": totals["requests"]}}, clock=clock)
    recorder.snapshot("start")                                              # t=101 (the run started at 100)
    for layer, late, wait in ((0, False, 0.0), (1, True, 0.002)):           # t=102, 103
        prefetch.record_chunk(layer, is_late=late, wait_s=wait)
    totals["h2d"] += 3 * 10**9
    recorder.snapshot()                                                     # t=104
    for layer, late, wait in ((3, True, 0.004), (3, False, 0.0)):           # t=105, 106
        prefetch.record_chunk(layer, is_late=late, wait_s=wait)
    for i in range(25):
        totals["requests"] += 1
        totals["h2d"] += 2 * 10**9 + 10**8 * i
        recorder.record_request({"prompt_tokens": 100, "prefix_tokens": 64 * (i % 2),
                                 "prefix_blocks_by_tier": {"cpu": 8, "disk": 1} if i % 2 else {}})
    lines, _ = recorder.lines_since(0)
    assert [len(line.get("prefetch_chunks", {}).get("n", [])) for line in lines[:3]] == [0, 2, 2]
    page = tmp_path / "long.html"
    page.write_text(static_page(lines))
    dom = parse_dom(dump_dom(page.as_uri(), tmp_path / "profile"))
    timeline = json.loads(dom.figures["timeline"]["data-series"])
    assert timeline["labels"] == ["layer of a chunk on time", "layer of a late chunk", "wait"]
    assert timeline["data"] == [[2.0, 3.0, 5.0, 6.0], [0, None, None, 3], [None, 1, 3, None], [0.0, 0.002, 0.004, 0.0]]
    assert dom.legends["timeline"] == {"since the run started": "6 s", "layer of a chunk on time": "3",
                                       "layer of a late chunk": "3", "wait": "0.0 µs"}
    stalls = json.loads(dom.figures["stalls"]["data-series"])
    assert stalls["labels"][-1] == "stall time in interval"
    assert stalls["data"][-1][:3] == [None, pytest.approx(0.002), pytest.approx(0.004)]
    check_round_binary_ticks(json.loads(dom.figures["bytes"]["data-ticks"]), "/s")
    check_requests_table(dom, lines)
    assert [row[0] for row in dom.tables["requests"][1:]] == [str(n) for n in range(6, 26)]
    assert dom.tables["requests"][1][3] == "cpu 8 blocks, disk 1 block" and dom.tables["requests"][2][3] == "none"


def test_missing_chromium_fails_under_ci_and_skips_elsewhere(monkeypatch):
    import tests.dashboard.chromium as chromium

    monkeypatch.setattr(chromium.shutil, "which", lambda name: None)
    monkeypatch.setattr(chromium.os, "access", lambda path, mode: False)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="chromium is not installed"):
        find_chromium()
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception):
        find_chromium()
