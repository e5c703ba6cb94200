"""GPU: the CPU tier's slab is page-locked in place, exactly its own bytes (the caching host
allocator behind `pin_memory=True` rounds to a power of two: an 81 GiB slab asked it for 128 GiB
and failed on the GPU machine), and blocks copy through it both ways, asynchronously."""
from __future__ import annotations

import gc

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (run on the GPU machine)", allow_module_level=True)

from tierkv.blocks import BlockLayout  # noqa: E402
from tierkv.storage.cpu import CpuTier  # noqa: E402


def test_slab_is_pinned_in_place_and_copies_round_trip():
    layout = BlockLayout(8, 16, 128, torch.bfloat16)
    num_blocks = (3 << 30) // (2 * layout.num_bytes)  # 1.5 GiB: page-locked in place, not rounded to 2 GiB
    tier = CpuTier("cpu", layout, num_blocks * layout.num_bytes + 123, pin_memory=True)
    assert tier.slab.is_pinned() and tier.slab.numel() * tier.slab.element_size() == num_blocks * layout.num_bytes
    blocks = torch.randn(64, *layout.shape, device="cuda").to(torch.bfloat16)
    part = tier.slab[100:164]
    part.copy_(blocks, non_blocking=True)  # device -> page-locked host memory, asynchronous
    back = part.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    torch.testing.assert_close(back, blocks, rtol=0, atol=0)
    torch.testing.assert_close(part, blocks.cpu(), rtol=0, atol=0)
    # other tiers come and go (their slabs unregistered when collected): this one stays pinned
    for _ in range(3):
        other = CpuTier("other", layout, num_blocks * layout.num_bytes, pin_memory=True)
        assert other.slab.is_pinned()
        del other
        gc.collect()
    assert tier.slab.is_pinned()
