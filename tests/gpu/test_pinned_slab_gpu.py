"""GPU: the CPU tier's slab is page-locked in place, exactly its own bytes (the caching host
allocator behind `pin_memory=True` rounds to a power of two: an 81 GiB slab asked it for 128 GiB
and failed on the GPU machine), and blocks copy through it both ways, asynchronously."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (run on the GPU machine)", allow_module_level=True)

from tierkv.blocks import BlockLayout  # noqa: E402
from tierkv.storage.cpu import CpuTier  # noqa: E402


def test_slab_is_pinned_in_place_and_copies_round_trip():
    layout = BlockLayout(8, 16, 128, torch.bfloat16)
    capacity = 3 * layout.num_bytes * 1000 + 123  # not a power of two
    tier = CpuTier("cpu", layout, capacity, pin_memory=True)
    assert tier.slab.is_pinned() and tier.slab.numel() * tier.slab.element_size() == 3000 * layout.num_bytes
    blocks = torch.randn(64, *layout.shape, device="cuda").to(torch.bfloat16)
    part = tier.slab[100:164]
    part.copy_(blocks, non_blocking=True)  # device -> registered host memory, asynchronous
    back = part.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    torch.testing.assert_close(back, blocks, rtol=0, atol=0)
    torch.testing.assert_close(part, blocks.cpu(), rtol=0, atol=0)
