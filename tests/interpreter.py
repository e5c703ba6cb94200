"""Run a test file's ``test_interp_*`` tests in a fresh CPU-only process with the Triton interpreter.

triton picks interpreter or compiler per ``@triton.jit`` function at import time, so a process that
imported triton compiled (or has CUDA) cannot interpret; the child can. ``child_flag``: an
environment variable set to "1" in the child, by which its tests know where they run.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_interpreter_tests(test_file: str, child_flag: str, timeout: int = 900) -> str:
    """The child's pytest summary line; AssertionError when it failed or ran no test, or skipped one."""
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", **{child_flag: "1"})
    command = [sys.executable, "-m", "pytest", test_file, "-q", "-p", "no:cacheprovider", "-k", "test_interp_"]
    result = subprocess.run(command, cwd=Path(__file__).parents[1], env=env, capture_output=True, text=True,
                            timeout=timeout)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, f"child pytest failed ({summary}):\n{result.stdout[-8000:]}{result.stderr[-2000:]}"
    assert " passed" in summary and "skipped" not in summary, f"child ran no interpreter test: {summary}"
    return summary
