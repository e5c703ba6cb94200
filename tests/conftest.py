"""Fixtures shared by the whole suite."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_torch_thread():
    """torch on one intra-op thread for the test: on tensors of a few hundred elements more threads only
    contend for the shared CPU (6x slower measured in tests/sparse/test_short_sequences.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
