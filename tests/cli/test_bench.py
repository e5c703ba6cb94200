"""`tierkv bench`: lists the real benchmarks, runs scripts with their arguments and exit codes."""
from __future__ import annotations

import textwrap

import pytest

from tierkv.cli import main

FAKE = '''"""{doc}"""
import os, sys
print("args:", sys.argv[1:])
{body}
sys.exit({code})
'''


def fake_benchmarks(tmp_path, body: str = "", code: int = 0):
    folder = tmp_path / "benchmarks"
    folder.mkdir()
    (folder / "bench_echo.py").write_text(FAKE.format(doc="Does echo echo?", body=body, code=code))
    (folder / "bench_other.py").write_text(FAKE.format(doc="Another question.", body="", code=0))
    (folder / "helper.py").write_text("")
    return folder


def test_lists_the_repository_benchmarks_with_their_questions(capsys):
    assert main(["bench"]) == 0
    out = capsys.readouterr().out
    for name in ("exact", "storage", "transfer"):
        assert any(line.startswith(name) for line in out.splitlines())
    assert "Llama-3.1-8B-shaped" in out


def test_runs_one_passing_its_arguments_and_exit_code(tmp_path, capfd):
    folder = fake_benchmarks(tmp_path, code=3)
    assert main(["bench", "--dir", str(folder), "echo", "--contexts", "4", "--flag"]) == 3
    captured = capfd.readouterr()
    assert "args: ['--contexts', '4', '--flag']" in captured.out
    assert "tierkv bench: bench_echo.py --contexts 4 --flag" in captured.err
    assert main(["bench", "--dir", str(folder), "bench_other.py"]) == 0


def test_all_runs_every_one_and_returns_the_first_failure(tmp_path, capfd):
    folder = fake_benchmarks(tmp_path, code=4)
    assert main(["bench", "--dir", str(folder), "all"]) == 4
    out = capfd.readouterr().out
    assert out.count("args: []") == 2


def test_report_from_a_benchmark_that_records_metrics(tmp_path, capfd):
    body = textwrap.dedent("""
        from tierkv.config import load_config
        from tierkv.metrics import MetricsRecorder
        config = load_config(None)   # reads TIERKV_METRICS__JSONL_PATH, as any TieredLLM's config does
        recorder = MetricsRecorder(lambda: {"transfer": {"h2d_bytes": 7}}, jsonl_path=config.metrics.jsonl_path)
        recorder.snapshot("start")
        recorder.close()
    """)
    folder = fake_benchmarks(tmp_path, body=body)
    report = tmp_path / "report.html"
    assert main(["bench", "--dir", str(folder), "--report", str(report), "echo"]) == 0
    assert report.read_text().startswith("<!doctype html>")
    assert "report of 2 snapshots written to" in capfd.readouterr().err


def test_report_from_a_benchmark_that_records_nothing_fails(tmp_path, capfd):
    folder = fake_benchmarks(tmp_path)
    assert main(["bench", "--dir", str(folder), "--report", str(tmp_path / "r.html"), "other"]) == 1
    assert "recorded no metrics" in capfd.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["bench", "nope"], "no benchmark 'nope'"),
    (["bench", "--dir", "/no/such/dir"], "no benchmarks folder at /no/such/dir"),
])
def test_bad_arguments_exit_2(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("tierkv bench: error:") and message in err


def test_all_takes_no_arguments(tmp_path, capsys):
    assert main(["bench", "--dir", str(fake_benchmarks(tmp_path)), "all", "--x"]) == 2
    assert "pass arguments to one benchmark at a time" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [[], ["all"], ["echo"]])
def test_a_folder_without_benchmarks_exits_2_naming_it(tmp_path, capsys, argv):
    (tmp_path / "helper.py").write_text("")
    assert main(["bench", "--dir", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert f"no benchmarks in {tmp_path}" in err and "bench_*.py" in err
