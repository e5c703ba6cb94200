"""bench_accuracy --quick on the real model: exact mode gives transformers' tokens, dense retrieval finds
the key; the summary counts accuracy and missed depths per mode."""
from __future__ import annotations

import json

import pytest

from benchmarks import bench_accuracy


@pytest.mark.real_model
def test_quick_run_exact_tokens_identical_and_dense_finds_the_key(tmp_path):
    out = tmp_path / "accuracy.json"
    record = bench_accuracy.main(["--quick", "--out", str(out), "--disk-path", str(tmp_path / "disk")])
    assert json.loads(out.read_text()) == record
    assert record["command"] and record["date"] and record["device"].startswith("cpu")
    exact = record["results"]["exact"]
    assert exact and all(row.get("identical") is True for row in exact), exact
    assert all(row["max_abs_logit_diff"] < 1e-2 for row in exact)
    dense = [r for r in record["results"]["retrieval"] if r["mode"] == "dense"]
    assert dense and all(r["correct"] for r in dense), dense
    modes = {r["mode"] for r in record["results"]["retrieval"]}
    assert modes == {"dense", "exact", "sparse"}


def test_summary_counts_accuracy_errors_and_missed_depths():
    base = {"task": "passkey", "context_tokens": 2048, "mode": "sparse", "token_budget": 256, "predictor": "none"}
    rows = [{**base, "depth": 0.0, "correct": True}, {**base, "depth": 0.5, "correct": False},
            {**base, "depth": 1.0, "error": "ValueError: x"}, {**base, "mode": "dense", "depth": 0.5, "correct": True}]
    summary = {r["mode"]: r for r in bench_accuracy.summarize_retrieval(rows)}
    assert summary["sparse"]["accuracy"] == 0.5 and summary["sparse"]["errors"] == 1
    assert summary["sparse"]["missed_depths"] == [0.5] and summary["sparse"]["cases"] == 3
    assert summary["dense"]["accuracy"] == 1.0 and summary["dense"]["missed_depths"] == []


@pytest.mark.parametrize("argv, message", [(["--parts", "exact,speed"], "--parts: got 'speed'"),
                                           (["--tasks", "haystack"], "--tasks: got 'haystack'")])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench_accuracy.parse_args(argv)
    assert message in capsys.readouterr().err
