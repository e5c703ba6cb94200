"""The dashboard's page and app without a browser: the static report, the snapshots API, sources."""
from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import pytest

from tierkv.dashboard import dashboard_app, serve, static_page, write_report
from tierkv.metrics import MetricsRecorder
from tierkv.metrics.server import start_metrics_server
from tierkv.metrics.sources import EndpointSource, JsonlSource, SourceError, open_source


def recorder_with_lines(n: int, path=None) -> MetricsRecorder:
    recorder = MetricsRecorder(lambda: {"transfer": {"h2d_bytes": 1, "note": "</script><!--"}}, jsonl_path=path)
    for _ in range(n):
        recorder.snapshot()
    return recorder


def get_json(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_static_page_inlines_everything_and_escapes_the_data(tmp_path):
    recorder = recorder_with_lines(2)
    lines, _ = recorder.lines_since(0)
    html = static_page(lines, source="a </script> source")
    assert "<script src=" not in html and '<link rel="stylesheet"' not in html  # one file, nothing fetched
    assert html.count("</script>") == html.count("<script")  # no early end of a script element
    data = html.split('<script type="application/json" id="tierkv-data">', 1)[1].split("</script>", 1)[0]
    assert json.loads(data) == json.loads(json.dumps(lines))
    assert "uPlot" in html and "Leon Sorokin" not in html  # the library, not its license text, is inlined


def test_write_report_reads_a_jsonl(tmp_path):
    recorder = recorder_with_lines(3, tmp_path / "m.jsonl")
    recorder.close()
    assert write_report(tmp_path / "m.jsonl", tmp_path / "out" / "r.html") == 4
    assert (tmp_path / "out" / "r.html").read_text().startswith("<!doctype html>")
    with pytest.raises(SourceError, match="no such file"):
        write_report(tmp_path / "missing.jsonl", tmp_path / "r.html")


def test_jsonl_source_reads_only_complete_lines_and_names_bad_ones(tmp_path):
    path = tmp_path / "m.jsonl"
    recorder = recorder_with_lines(2, path)
    source = JsonlSource(path)
    lines, next_n = source.lines_since(0)
    assert len(lines) == 2 and next_n == 2
    whole = json.dumps({**lines[0], "seq": 9})
    with open(path, "a") as f:
        f.write(whole[:40])  # a line still being written
    assert source.lines_since(2) == ([], 2)
    with open(path, "a") as f:
        f.write(whole[40:] + "\n")
    assert source.lines_since(2)[0] == [{**lines[0], "seq": 9}]
    with open(path, "a") as f:
        f.write('{"something": "else"}\n')
    with pytest.raises(SourceError, match=r"m.jsonl:4: not a tierkv metrics snapshot"):
        source.lines_since(0)
    # said once, then read past: the lines before it are not read (and kept) again at every poll
    with open(path, "a") as f:
        f.write(json.dumps({**lines[0], "seq": 10}) + "\n")
    assert [line["seq"] for line in source.lines_since(3)[0]] == [10] and source.lines_since(0)[1] == 4
    for bad, named in (({"figures": None}, "'figures' is None"), ({"elapsed_s": "3"}, "'elapsed_s' is '3'"),
                       ({"figures": {"tier.cpu.hits": "x"}}, "figures['tier.cpu.hits'] is 'x'"),
                       ({"request": {"prefill_s": "x"}}, "request['prefill_s'] is 'x'"),  # it stopped the page drawing
                       ({"request": [1]}, "'request' is [1]"),
                       ({"request": {"prefix_blocks_by_tier": {"disk": "x"}}}, "prefix_blocks_by_tier")):
        broken = tmp_path / "broken.jsonl"
        broken.write_text(json.dumps({**lines[0], **bad}) + "\n")
        with pytest.raises(SourceError, match=re.escape(named)):
            JsonlSource(broken).lines_since(0)
    recorder.close()
    with pytest.raises(SourceError, match="give exactly one"):
        open_source()
    with pytest.raises(SourceError, match="expected http"):
        EndpointSource("localhost:9400")


def test_snapshots_api_of_a_jsonl_and_of_an_endpoint_through_the_dashboard(tmp_path):
    path = tmp_path / "m.jsonl"
    recorder = recorder_with_lines(3, path)
    metrics = start_metrics_server(recorder, 0)
    from_file = serve(dashboard_app(JsonlSource(path)))
    through = serve(dashboard_app(EndpointSource(metrics.url)))
    try:
        status, body = get_json(f"{from_file.url}/api/snapshots?since=1")
        assert status == 200 and [line["seq"] for line in body["lines"]] == [1, 2] and body["next"] == 3
        status, body = get_json(f"{through.url}/api/snapshots?since=0")
        assert status == 200 and [line["seq"] for line in body["lines"]] == [0, 1, 2] and body["next"] == 3
        recorder.snapshot()
        status, body = get_json(f"{through.url}/api/snapshots?since=3")
        assert [line["seq"] for line in body["lines"]] == [3] and body["next"] == 4
        metrics.close()
        status, body = get_json(f"{through.url}/api/snapshots?since=4")
        assert status == 502 and "Connection refused" in body["error"]
        path.unlink()
        status, body = get_json(f"{from_file.url}/api/snapshots?since=0")
        assert status == 502 and "m.jsonl" in body["error"]
    finally:
        for server in (metrics, from_file, through):
            server.close()
        recorder.close()
