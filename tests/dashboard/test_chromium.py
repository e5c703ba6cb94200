"""The dashboard in a real headless Chromium, on a JSONL recorded from a real CPU run: the page
loads (as a static report and served by `tierkv dashboard`'s app), every chart holds exactly the
recorded values, and a screenshot is kept (tests/artifacts/)."""
from __future__ import annotations

import json

import pytest

from tests.dashboard.chromium import dump_dom, find_chromium, keep_artifact, parse_dom, screenshot
from tests.metrics.workload import read_lines, record_jsonl
from tierkv.dashboard import dashboard_app, serve, write_report
from tierkv.metrics.sources import JsonlSource


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


def timeline_of(lines: list[dict]) -> dict:
    """The per-layer prefetch timeline of the last snapshot that has one (the streamer reports it)."""
    layers = [line["prefetch_layers"] for line in lines if line.get("prefetch_layers")][-1]
    return {"chunks on time": [c - late for c, late in zip(layers["chunks"], layers["late_chunks"])],
            "late chunks": layers["late_chunks"], "wait": layers["wait_s"]}


def check_page(html: str, lines: list[dict]) -> None:
    dom = parse_dom(html)
    assert dom.body.get("data-ready") == "true", "the page's scripts did not finish drawing"
    assert dom.body.get("data-snapshots") == str(len(lines))
    expected = expected_charts(lines)
    assert set(dom.figures) == set(expected)
    for chart, series in expected.items():
        drawn = json.loads(dom.figures[chart]["data-series"])
        assert drawn["labels"] == list(series), chart
        x_values = list(range(len(next(iter(series.values()))))) if chart == "timeline" else [line["t"] for line in lines]
        assert drawn["data"][0] == x_values, f"{chart}: x values"  # the timeline's x axis is the layer
        for label, values, drawn_values in zip(series, series.values(), drawn["data"][1:]):
            assert drawn_values == values, f"{chart} / {label}"
    gpu_hit_rate = lines[-1]["figures"]["tier.gpu.hit_rate"]
    assert f"{100 * gpu_hit_rate:.1f}%" in dom.cards  # the GPU hit-rate card
    assert "n/a" in dom.cards  # prefetch precision: nothing reported in exact mode


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


def test_per_layer_timeline_and_stall_time_once_the_scheduler_reports_them(tmp_path):
    """No scheduler reports per-layer events yet: a recorder fed by a PrefetchRecorder shows the chart."""
    from tierkv.dashboard import static_page
    from tierkv.metrics import MetricsRecorder, PrefetchRecorder

    prefetch = PrefetchRecorder(num_layers=4)
    clock = iter(float(t) for t in range(100, 200))
    recorder = MetricsRecorder(lambda: {"scheduler": {"stalls": 0}, "prefetch": prefetch.snapshot()},
                               clock=lambda: next(clock))
    recorder.snapshot("start")
    for layer, late, wait in ((0, False, 0.0), (1, True, 0.002), (3, True, 0.004), (3, False, 0.0)):
        prefetch.record_chunk(layer, is_late=late, wait_s=wait)
    recorder.snapshot()
    lines, _ = recorder.lines_since(0)
    page = tmp_path / "layers.html"
    page.write_text(static_page(lines))
    dom = parse_dom(dump_dom(page.as_uri(), tmp_path / "profile"))
    timeline = json.loads(dom.figures["timeline"]["data-series"])
    assert timeline["labels"] == ["chunks on time", "late chunks", "wait"]
    assert timeline["data"] == [[0, 1, 2, 3], [1, 0, 0, 1], [0, 1, 0, 1], [0.0, 0.002, 0.0, 0.004]]
    stalls = json.loads(dom.figures["stalls"]["data-series"])
    assert stalls["labels"][-1] == "stall time in interval"
    assert stalls["data"][-1] == [None, pytest.approx(0.006)]


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
