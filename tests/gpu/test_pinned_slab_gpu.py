"""GPU: a pinned CPU tier locks the host memory it uses, not the next power of two of it
(`tierkv.storage.pinned_slab.exact_pinned`), and copies to and from it are right. Measured in a fresh process, so no earlier pinned
allocation can be reused: its resident memory grows by the slab, 1.25 GiB, not 2 GiB."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (run on the GPU machine)", allow_module_level=True)

PROBE = r"""
import json, os, torch
from tierkv.blocks import BlockLayout
from tierkv.storage.cpu import CpuTier

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

torch.cuda.init()
torch.empty(1, pin_memory=True)  # the allocator and CUDA context exist before the measurement
layout = BlockLayout(8, 64, 128, torch.bfloat16)  # 256 KiB blocks
before = rss()
tier = CpuTier("probe", layout, 5120 * layout.num_bytes, pin_memory=True)  # 1.25 GiB
slab = tier.slab
after = rss()
blocks = torch.randn(4, *layout.shape, device="cuda", dtype=torch.bfloat16)
slab[[7, 5000, 3, 5119]] = blocks.cpu()
back = slab[[7, 5000, 3, 5119]].to("cuda", non_blocking=True)
torch.cuda.synchronize()
copies_equal = bool(torch.equal(back, blocks))
stats = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
print(json.dumps({"copies_equal": copies_equal, "slab_bytes": slab.numel() * slab.element_size(), "is_pinned": slab.is_pinned(),
                  "rss_growth": after - before,
                  "host_stats": {k: v for k, v in stats.items() if "bytes" in k}}))
"""


def test_a_pinned_slab_locks_its_own_size():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    probe = json.loads(done.stdout.strip().splitlines()[-1])
    print(probe)
    assert probe["is_pinned"] and probe["slab_bytes"] == 5 << 28 and probe["copies_equal"]
    # resident growth: the slab's pages (cudaHostAlloc populates them), not its power-of-two round-up
    assert 0.9 * probe["slab_bytes"] <= probe["rss_growth"] <= 1.2 * probe["slab_bytes"], probe
