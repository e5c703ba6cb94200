"""`tierkv dashboard`: a static report, a real server process that stops cleanly, bad arguments."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tierkv.cli import main
from tierkv.metrics import MetricsRecorder

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def jsonl(tmp_path) -> Path:
    path = tmp_path / "m.jsonl"
    recorder = MetricsRecorder(lambda: {"transfer": {"h2d_bytes": 1, "d2h_bytes": 2}}, jsonl_path=path)
    recorder.snapshot("start")
    recorder.close()
    return path


def test_html_writes_a_static_report(jsonl, tmp_path, capsys):
    out = tmp_path / "report.html"
    assert main(["dashboard", "--jsonl", str(jsonl), "--html", str(out)]) == 0
    assert '"mode": "static"' in out.read_text()
    assert "wrote" in capsys.readouterr().err


def test_serves_until_terminated_and_frees_its_port(jsonl):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-m", "tierkv.cli", "dashboard", "--jsonl", str(jsonl), "--port", "0"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline()  # blocks until the server prints where it listens
        assert first.startswith("tierkv dashboard: ") and "(Ctrl-C to stop)" in first, proc.stderr.read()
        url = first.split(" at ")[1].split()[0].rstrip("/")
        with urllib.request.urlopen(f"{url}/api/snapshots?since=0", timeout=10) as response:
            body = json.loads(response.read())
        assert [line["kind"] for line in body["lines"]] == ["start", "final"]
        with urllib.request.urlopen(f"{url}/", timeout=10) as response:
            assert b"chart-hitrate" in response.read()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    port = int(url.rsplit(":", 1)[1])
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_a_port_in_use_is_a_runtime_failure(jsonl, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["dashboard", "--jsonl", str(jsonl), "--port", str(port)]) == 1
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["dashboard", "--jsonl", "/no/such.jsonl"], "no such file"),
    (["dashboard", "--endpoint", "localhost:9400"], "expected http://host:port"),
    (["dashboard", "--jsonl", "x", "--port", "70000"], "--port: got 70000"),
])
def test_bad_arguments_exit_2(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("tierkv dashboard: error:") and message in err


def test_exactly_one_source(capsys):
    for argv in (["dashboard"], ["dashboard", "--jsonl", "a", "--endpoint", "http://b"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2


def test_unusable_sources_and_outputs_exit_2_naming_them(jsonl, tmp_path, capsys):
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(b"binary\x00\xff")
    cases = [(["dashboard", "--jsonl", str(binary), "--html", str(tmp_path / "o.html")], "no snapshot lines to report"),
             (["dashboard", "--jsonl", str(jsonl), "--html", str(tmp_path)], "--html: cannot write"),
             (["dashboard", "--jsonl", str(tmp_path), "--html", str(tmp_path / "o.html")], "a directory (expected a JSONL"),
             (["top", "--jsonl", str(tmp_path), "--once"], "a directory (expected a JSONL")]
    for argv, message in cases:
        assert main(argv) == 2
        assert message in capsys.readouterr().err
