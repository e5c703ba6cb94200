"""benchmarks/run_gpu.py, the GPU session's entry, on CPU without running anything: every step and
group resolves, an unknown step is refused naming the known ones, and every command a step would run
names a script or test path that exists in the checkout."""
from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import run_gpu

ROOT = Path(__file__).resolve().parent.parent


def test_groups_expand_to_known_steps_in_order():
    args = run_gpu.parse_args(["tests", "remeasure"])
    assert args.names[:2] == ["tests", "tests"] and set(args.names) <= set(run_gpu.STEPS)
    assert run_gpu.parse_args([]).names == run_gpu.GROUPS["default"]


def test_an_unknown_step_is_refused_naming_the_steps(capsys):
    with pytest.raises(SystemExit):
        run_gpu.parse_args(["exact", "no-such-step"])
    err = capsys.readouterr().err
    assert "unknown step(s) no-such-step" in err and "vllm-batch-ab" in err


@pytest.mark.parametrize("name", sorted(run_gpu.STEPS))
def test_every_step_runs_scripts_and_tests_that_exist(name, tmp_path, monkeypatch):
    commands = []

    def record(self, cmd, log, timeout_s, tail=15, keep=None, env=None):
        commands.append(cmd)
        return 0

    monkeypatch.setattr(run_gpu.Session, "run", record)
    listing = "tests/gpu/test_far_graphs_gpu.py::test_one\n2 tests collected\n"  # what pytest --collect-only lists
    monkeypatch.setattr(run_gpu.subprocess, "run", lambda *a, **k: type("R", (), {"stdout": listing})())
    rc = run_gpu.STEPS[name](run_gpu.Session(run_gpu.parse_args(["--out", str(tmp_path), name])))
    assert rc == 0 and commands, f"{name} ran nothing"
    for cmd in commands:
        paths = [a.split("::")[0] for a in cmd if a.startswith(("benchmarks/", "tests"))]
        assert paths, f"{name}: {cmd} names no script or test"
        assert all((ROOT / p).exists() for p in paths), f"{name}: {cmd}"
