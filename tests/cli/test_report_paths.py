"""A report never overwrites the metrics JSONL it is made from; `run --report` keeps the config's jsonl_path."""
from __future__ import annotations

import json
import os

import pytest

from tierkv.cli import main
from tierkv.metrics import MetricsRecorder


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "m.jsonl"
    recorder = MetricsRecorder(lambda: {"transfer": {"h2d_bytes": 1, "d2h_bytes": 2}}, jsonl_path=path)
    recorder.snapshot("start")
    recorder.close()
    return path


def config(tmp_path, metrics: str = "") -> str:
    path = tmp_path / "run.yaml"
    path.write_text(f"""
model: {{name: cli-report-test}}
cache: {{block_tokens: 16, gpu_budget_bytes: 384KiB, sink_tokens: 16, window_tokens: 32}}
tiers:
  - {{kind: cpu, capacity_bytes: 4MiB}}
scheduler: {{lookahead_layers: 1, staging_bytes: 128KiB, prefill_chunk_tokens: 64}}
{metrics}""")
    return str(path)


def run(config_path: str, *flags: str) -> int:
    return main(["run", "--demo", "--config", config_path, "--prompt-tokens", "40", "--max-new-tokens", "2", "--quiet",
                 *flags])


def test_dashboard_html_onto_its_own_jsonl_is_refused(jsonl, tmp_path, capsys):
    before = jsonl.read_bytes()
    os.link(jsonl, tmp_path / "hard.html")
    os.symlink(jsonl, tmp_path / "soft.html")
    for out in (jsonl, tmp_path / "." / "m.jsonl", tmp_path / "hard.html", tmp_path / "soft.html"):
        assert main(["dashboard", "--jsonl", str(jsonl), "--html", str(out)]) == 2
        err = capsys.readouterr().err
        assert "--html" in err and "--jsonl" in err and "same file" in err
    assert jsonl.read_bytes() == before


@pytest.mark.parametrize("flags", [["--report", "{d}/r.jsonl"], ["--jsonl", "{d}/f", "--report", "{d}/f"],
                                   ["--jsonl", "{d}/f.jsonl", "--report", "{d}/sub/../f.jsonl"]])
def test_run_with_a_report_onto_its_snapshots_is_refused_before_running(tmp_path, capsys, flags):
    flags = [flag.format(d=tmp_path) for flag in flags]
    assert run(config(tmp_path), *flags) == 2
    err = capsys.readouterr().err
    assert "--report" in err and "--jsonl" in err and "same file" in err
    assert not any((tmp_path / name).exists() for name in ("r.jsonl", "f", "f.jsonl"))  # refused before running


def test_run_report_onto_the_configs_jsonl_path_is_refused(tmp_path, capsys):
    snapshots = tmp_path / "snapshots.jsonl"
    assert run(config(tmp_path, f"metrics: {{jsonl_path: {snapshots}}}"), "--report", str(snapshots)) == 2
    err = capsys.readouterr().err
    assert "--report" in err and "metrics.jsonl_path" in err and not snapshots.exists()


def test_run_report_keeps_the_configs_jsonl_path(tmp_path):
    snapshots, report = tmp_path / "kept" / "snapshots.jsonl", tmp_path / "r.html"
    assert run(config(tmp_path, f"metrics: {{jsonl_path: {snapshots}}}"), "--report", str(report)) == 0
    kinds = [json.loads(line)["kind"] for line in snapshots.read_text().splitlines()]
    assert kinds[0] == "start" and kinds[-1] == "final"
    assert not (tmp_path / "r.jsonl").exists() and report.read_text().startswith("<!doctype html>")
    assert "snapshots.jsonl" in report.read_text()  # the report is made from them


def test_run_report_without_a_jsonl_path_records_next_to_the_report(tmp_path):
    report = tmp_path / "r.html"
    assert run(config(tmp_path), "--report", str(report)) == 0
    assert (tmp_path / "r.jsonl").read_text() and report.read_text().startswith("<!doctype html>")
