"""GPU: the hot window's load ring (`store_loads._LoadRing`) reused while the compute stream lags: a copy into
a buffer waits on the device for the write out of the layer that used it last, so with the compute stream
kept busy before every write (the host far ahead of it, as in a long prefix hit) each block still lands exactly
as the tiers hold it. Without that wait the copy of layer L + lookahead + 1 overwrites layer L's blocks first."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (run on the GPU machine)", allow_module_level=True)

from tests.integrations.vllm.test_load_ring import LAYERS, check_ring  # noqa: E402


@pytest.mark.parametrize("lookahead", [1, 2])
def test_ring_reuse_waits_for_the_write_out(tmp_path, lookahead):
    steps = [([(0, 4)], None), ([(3, 2), (9, 2)], None), ([(5, 3)], 2), ([(0, 12)], None), ([(7, 4)], None)]
    check_ring(tmp_path, lookahead, steps, device="cuda", slow=lambda: torch.cuda._sleep(20_000_000))
    assert LAYERS > lookahead + 1  # every buffer is reused within a step
