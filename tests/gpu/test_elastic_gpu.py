"""GPU: shrinking the budget from 8 GiB to 1 GiB frees the memory for the driver and other processes."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (run on the GPU machine)", allow_module_level=True)

from tierkv.config import load_config  # noqa: E402
from tierkv.engine.runtime import KVRuntime  # noqa: E402

GiB = 1 << 30


def test_shrink_8_to_1_gib_is_free_within_a_second_and_another_process_can_take_it():
    config = load_config({
        "cache": {"block_tokens": 64, "gpu_budget_bytes": 8 * GiB, "sink_tokens": 64, "window_tokens": 1024},
        "tiers": [{"kind": "cpu", "capacity_bytes": "1GiB"}],
        "scheduler": {"staging_bytes": "256MiB"},
    }, env={})
    runtime = KVRuntime(config, num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                        device="cuda", model_id="elastic-gpu")
    try:
        torch.cuda.synchronize()
        free, _ = torch.cuda.mem_get_info()
        # Fill the card so that only what the shrink releases is left for another process.
        filler = torch.empty(free - GiB // 2, dtype=torch.uint8, device="cuda")
        free_before, _ = torch.cuda.mem_get_info()
        start = time.perf_counter()
        runtime.set_gpu_budget(1 * GiB)
        free_after, _ = torch.cuda.mem_get_info()
        elapsed = time.perf_counter() - start
        released = free_after - free_before
        print(f"released {released / GiB:.2f} GiB in {elapsed:.3f} s")
        assert elapsed < 1.0
        assert released >= 0.95 * 7 * GiB
        probe = (f"import torch; x = torch.empty({int(0.95 * 7 * GiB)}, dtype=torch.uint8, device='cuda'); "
                 "torch.cuda.synchronize(); print('allocated', x.numel())")
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert runtime.stats()["gpu"]["returned_bytes"] >= 7 * GiB - (256 << 20)
        del filler
    finally:
        runtime.close()
