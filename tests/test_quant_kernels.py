"""The fused dequantization kernel gives exactly the values of the PyTorch form (float32 product,
one rounding), run on CPU through the Triton interpreter in a child process; bf16 output is
checked on the GPU (`tests/gpu/test_quant_gpu.py`): the interpreter does not round to bf16 as
the GPU does."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = r"""
import torch
from tierkv.quant import quantize_blocks, dequantize_blocks
from tierkv.quant_kernels import dequantize_into_slots
print("seed", __import__("sys").argv[1], flush=True)  # a failure names its draw
torch.manual_seed(int(__import__("sys").argv[1]))
for fmt in ("int8", "float8_e4m3fn"):
    for dtype in (torch.float32, torch.float16):
        blocks = torch.randn(6, 2, 3, 16, 8) * torch.rand(6, 2, 3, 1, 1) * 4
        blocks[1, 0, 2] = 0
        blocks[3, 1, 1, 4, 5] = float("nan")  # a non-finite group: a NaN scale, read back all NaN
        codes, scales = quantize_blocks(blocks, fmt)
        dst = torch.full((10, 2, 3, 16, 8), float("nan"), dtype=dtype)
        slots = torch.tensor([7, 0, 3, 9, 5, 2])
        dequantize_into_slots(codes, scales, fmt, dst, slots)
        want = torch.full_like(dst, float("nan"))
        want.index_copy_(0, slots, dequantize_blocks(codes, scales, fmt, dtype))
        assert torch.equal(dst.view(torch.int16 if dtype == torch.float16 else torch.int32),
                           want.view(torch.int16 if dtype == torch.float16 else torch.int32)), (fmt, dtype)
        assert torch.isnan(dst[9, 1, 1]).all() and torch.isfinite(dst[9, 0]).all()  # block 3 went to slot 9
        untouched = [s for s in range(10) if s not in slots.tolist()]
        assert torch.isnan(dst[untouched]).all()
        # a negative slot skips its block (a far-block cache's held blocks), in the kernel and the PyTorch form
        skipping = torch.tensor([7, -1, 3, -1, 5, 2])
        for run in (dequantize_into_slots, __import__("tierkv.block_io").block_io.dequantize_into):
            got = torch.full_like(dst, float("nan"))
            run(codes, scales, fmt, got, skipping)
            assert torch.equal(got[skipping[skipping >= 0]].view(torch.int16 if dtype == torch.float16 else torch.int32),
                               dst[skipping[skipping >= 0]].view(torch.int16 if dtype == torch.float16 else torch.int32))
            assert torch.isnan(got[[0, 1, 4, 6, 8, 9]]).all(), run
print("FUSED DEQUANT OK")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed (pip install triton)")
def test_fused_dequantization_equals_the_pytorch_form_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    # a new draw on each run here; under CI (CI=true) the same one, as for the hypothesis tests (tests/conftest.py)
    ci = os.environ.get("CI", "").lower() in ("1", "true")
    seed = 0 if ci else int.from_bytes(os.urandom(4), "little")
    done = subprocess.run([sys.executable, "-c", CHILD, str(seed)], cwd=Path(__file__).parents[1], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "FUSED DEQUANT OK" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]


def test_shape_errors_are_named():
    import torch

    from tierkv.quant_kernels import dequantize_into_slots

    with pytest.raises(ValueError, match="shapes do not match"):
        dequantize_into_slots(torch.zeros(2, 2, 3, 4, 8, dtype=torch.uint8), torch.zeros(2, 2, 3),
                              "int8", torch.zeros(5, 2, 3, 4, 4), torch.tensor([0, 1]))
