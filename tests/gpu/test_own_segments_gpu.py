"""GPU: buffers made under `own_segments` (what a run-time resize replaces: vLLM's KV tensors, the hot window's
staging) go back to the driver whole once dropped, even when a tensor allocated after them outlives them; the
same buffers from the caching allocator's shared pool keep their segment."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (run on the GPU machine)", allow_module_level=True)

from tierkv.storage.gpu import own_segments  # noqa: E402

MIB = 1 << 20


def _returned_after_drop(private: bool) -> tuple[int, int]:
    """Bytes the process's reservation shrinks by when four 3 MiB buffers are dropped while a 2 MiB tensor made
    after them lives on, and the bytes the buffers held. (The caching allocator serves allocations of 1-10 MiB
    from 20 MiB segments, so the shared pool puts the survivor in the buffers' segment; at 1 MiB or less it
    would go to the small pool's own segments.)"""
    device = torch.device("cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    if private:
        with own_segments(device) as segments:
            buffers = [torch.zeros(3 * MIB, dtype=torch.uint8, device=device) for _ in range(4)]
    else:
        segments, buffers = None, [torch.zeros(3 * MIB, dtype=torch.uint8, device=device) for _ in range(4)]
    survivor = torch.zeros(2 * MIB, dtype=torch.uint8, device=device)  # shares their segment unless they have their own
    held = sum(b.numel() for b in buffers)
    before = torch.cuda.memory_reserved(device)
    del buffers, segments
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    returned = before - torch.cuda.memory_reserved(device)
    assert survivor.sum().item() == 0  # alive to here
    return returned, held


def test_buffers_of_their_own_segments_go_back_whole_beside_a_survivor():
    returned, held = _returned_after_drop(private=True)
    assert returned >= held, f"{returned} of {held} bytes went back to the driver"


def test_the_shared_pool_keeps_a_segment_a_survivor_holds():
    """The mechanism `own_segments` avoids (if the allocator ever stops sharing small segments, this test says
    so and the reason for `own_segments` is gone)."""
    returned, held = _returned_after_drop(private=False)
    assert returned < held, f"{returned} of {held} bytes went back without own_segments"



def test_an_allocator_without_pools_allocates_as_usual(monkeypatch):
    """PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync has no pools (MemPool raises): the buffers are made as
    usual (that allocator returns freed memory itself) and no pool is yielded."""
    def no_pools(*args, **kwargs):
        raise RuntimeError("cudaMallocAsync does not yet support createOrIncrefPool")

    monkeypatch.setattr(torch.cuda, "MemPool", no_pools)
    with own_segments("cuda") as segments:
        t = torch.zeros(4, device="cuda")
    assert segments is None and t.is_cuda
