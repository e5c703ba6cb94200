"""Fixtures shared by the whole suite."""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings

# No per-example deadline (a shared 2-core machine runs an example 10x slower at times: a timing is no property), and
# under CI (CI=true) the same examples on every run, so a run's result is the code's, not the draw's; a run here
# draws new examples each time. A test's own @settings override these.
settings.register_profile("tierkv", deadline=None)
settings.register_profile("tierkv-ci", deadline=None, derandomize=True)
settings.load_profile("tierkv-ci" if os.environ.get("CI", "").lower() in ("1", "true") else "tierkv")


@pytest.fixture
def one_torch_thread():
    """torch on one intra-op thread for the test: on tensors of a few hundred elements more threads only
    contend for the shared CPU (6x slower measured in tests/sparse/test_short_sequences.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
