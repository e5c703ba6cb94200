"""`tierkv` itself: help, version, bad commands, the console-script entry point."""
from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tierkv.cli import main

REPO = Path(__file__).resolve().parents[2]


def test_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for command in ("run", "plan", "config", "bench", "top", "dashboard"):
        assert command in out


@pytest.mark.parametrize("argv,message", [
    ([], "the following arguments are required: COMMAND"),
    (["fly"], "invalid choice: 'fly'"),
    (["config"], "the following arguments are required: ACTION"),
    (["config", "lint"], "invalid choice: 'lint'"),
    (["plan", "--context", "1k", "--model-config"], "expected one argument"),
])
def test_usage_errors_exit_2_with_a_message(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.startswith("tierkv ")


def test_console_script_points_at_main():
    scripts = [ep for ep in importlib.metadata.entry_points(group="console_scripts") if ep.name == "tierkv"]
    assert scripts and scripts[0].value == "tierkv.cli:main"


def test_python_dash_m_runs_it_and_passes_the_exit_code():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-m", "tierkv.cli", "plan", "--model-config", "nope", "--context", "1k"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "tierkv plan: error: --model-config: 'nope' is neither a preset" in done.stderr
