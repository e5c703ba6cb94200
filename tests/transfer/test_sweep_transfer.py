"""benchmarks/sweep_transfer.py on the CPU: arguments, the variant grid, the best-variant pick,
the table, and the message without CUDA."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def sweep(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the script imports its sibling modules by name
    return importlib.import_module("sweep_transfer")


def test_defaults_are_the_grid_of_the_question(sweep):
    args = sweep.parse_args([])
    assert args.block_kib == [16, 64, 256] and args.total_mib == 1024
    assert args.words_per_thread == [4, 8, 16] and args.threads == [128, 256, 512]
    assert args.cta_multiples == [1, 2, 4] and not args.no_memcpy_batch
    assert args.out == Path("benchmarks/results/sweep_transfer.json")


def test_arguments_are_parsed(sweep, tmp_path):
    args = sweep.parse_args(["--out", str(tmp_path / "s.json"), "--block-kib", "64", "--reps", "3",
                             "--threads", "256", "--no-memcpy-batch", "--budget-s", "90"])
    assert args.out == tmp_path / "s.json" and args.block_kib == [64] and args.reps == 3
    assert args.threads == [256] and args.no_memcpy_batch and args.budget_s == 90.0


@pytest.mark.parametrize("flag", ["--reps", "--total-mib", "--num-checked"])
def test_non_positive_counts_are_rejected(sweep, flag, capsys):
    with pytest.raises(SystemExit):
        sweep.parse_args([flag, "0"])
    assert flag in capsys.readouterr().err


def test_variants_cover_the_grid_once_with_todays_kernel_marked(sweep):
    variants = sweep.build_variants(sweep.parse_args([]), num_sms=132)
    kernels = [v for v in variants if v.backend == "cupy"]
    assert len(kernels) == 27 and variants[-1].backend == "memcpy_batch" and len(variants) == 28
    assert len({v.name for v in variants}) == 28
    assert {v.max_ctas for v in kernels} == {132, 264, 528}
    (default,) = [v for v in variants if v.is_default]
    assert (default.words_per_thread, default.threads_per_cta, default.max_ctas) == (4, 256, 132)
    assert default.name == "kernel w4 t256 c132 (today)"
    no_batch = sweep.build_variants(sweep.parse_args(["--no-memcpy-batch"]), num_sms=132)
    assert all(v.backend == "cupy" for v in no_batch)


def test_checked_pairs_include_the_first_and_last(sweep):
    picked = sweep.checked_pairs(1000, 64, seed=3)
    assert picked[0] == 0 and picked[-1] == 999 and 62 <= picked.numel() <= 64
    assert picked.unique().numel() == picked.numel()
    assert sweep.checked_pairs(1, 64, seed=3).tolist() == [0]


def _row(block_kib, direction, variant, ratio, *, is_exact=True, error=None, is_default=False):
    return {"block_kib": block_kib, "direction": direction, "variant": variant, "is_default": is_default,
            "gb_s": None if error else 50.0 * ratio, "over_ceiling": None if error else ratio,
            "is_exact": None if error else is_exact, "error": error}


ROWS = [
    _row(64, "h2d", "kernel w4 t256 c132 (today)", 0.89, is_default=True),
    _row(64, "h2d", "kernel w8 t256 c264", 0.93),
    _row(64, "h2d", "kernel w16 t512 c528", 0.99, is_exact=False),  # wrong bytes never win
    _row(64, "h2d", "memcpy_batch", 0.0, error="MemcpyBatchUnavailable: no symbol"),
    _row(64, "d2h", "kernel w4 t256 c132 (today)", 0.90, is_default=True),
    _row(64, "d2h", "kernel w8 t256 c264", 0.88),
    _row(64, "d2h", "memcpy_batch", 0.0, error="MemcpyBatchUnavailable: no symbol"),
]
CEILINGS = [{"block_kib": 64, "direction": "h2d", "ceiling_gb_s": 55.4},
            {"block_kib": 64, "direction": "d2h", "ceiling_gb_s": 55.0}]


def test_best_variant_is_the_fastest_exact_one_per_direction(sweep):
    assert sweep.best_variants(ROWS) == {64: {"h2d": "kernel w8 t256 c264", "d2h": "kernel w4 t256 c132 (today)"}}
    assert sweep.best_variants([ROWS[3]]) == {}


def test_table_marks_the_best_and_shows_errors(sweep, capsys):
    sweep.print_table(ROWS, CEILINGS)
    lines = capsys.readouterr().out.splitlines()
    assert "h2d GB/s" in lines[0]
    assert any("ceiling" in line and "55.4" in line for line in lines)
    (best,) = [line for line in lines if "kernel w8 t256 c264" in line]
    assert "0.93*" in best and "0.88 " in best
    (today,) = [line for line in lines if "(today)" in line]
    assert "0.90*" in today
    (batch,) = [line for line in lines if "memcpy_batch" in line]
    assert batch.count("error") == 2
    assert not any("w16 t512" in line for line in lines)  # neither best nor today's


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message printed without CUDA")
def test_without_cuda_main_says_so_and_writes_nothing(sweep, tmp_path, capsys):
    out = tmp_path / "sweep.json"
    assert sweep.main(["--out", str(out)]) == 2
    assert "sweep_transfer.py needs CUDA: run it on the GPU machine." in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message printed without CUDA")
def test_script_without_cuda_exits_2(tmp_path):
    completed = subprocess.run(
        [sys.executable, str(BENCHMARKS / "sweep_transfer.py"), "--out", str(tmp_path / "s.json")],
        capture_output=True, text=True, timeout=120,
    )
    assert completed.returncode == 2
    assert "needs CUDA" in completed.stderr


def test_contended_is_off_by_default_and_recorded(sweep, tmp_path):
    assert sweep.parse_args([]).contended is False
    args = sweep.parse_args(["--contended", "--out", str(tmp_path / "x.json")])
    assert args.contended is True
    assert sweep.summarize(args, 132, 1 << 30, [], [], [], 0.0)["contended"] is True
