"""After `warm_far_kernels`, far-path launches of 1..63 queries compile nothing (tierkv.attention.warmup).

Counts the far kernels' compiled variants in Triton's own cache (`JITFunction.device_caches`, or
`.cache` in older Triton) before and after launches shaped as the far path makes them; clears nothing.
"""
from __future__ import annotations

import pytest
import torch

from tierkv.attention import reference
from tierkv.blocks import BlockLayout

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")


def _num_compiled(kernel) -> int:
    caches = getattr(kernel, "device_caches", None)
    if caches is not None:  # device -> (kernel cache, key cache, target, backend, binder)
        return sum(len(entry[0]) for entry in caches.values())
    return sum(len(cache) for cache in kernel.cache.values())


@pytest.mark.parametrize("rows", [False, True])
@pytest.mark.parametrize("num_heads, layout", [(32, BlockLayout(8, 64, 128, torch.bfloat16)),
                                               (14, BlockLayout(2, 16, 64, torch.float16))])
def test_no_compile_after_warm_up(num_heads, layout, rows):
    from tierkv.attention import triton_kernels, triton_paged
    from tierkv.attention.warmup import warm_far_kernels
    device = torch.device("cuda")
    assert warm_far_kernels(num_heads, layout, device, rows=rows) > 0
    kernels = (triton_kernels.partial_attention_kernel, triton_kernels.merge_splits_kernel)
    before = [_num_compiled(k) for k in kernels]
    H, T, D = layout.num_kv_heads, layout.block_tokens, layout.head_dim
    pool = torch.randn((48, 2, H, T, D), dtype=layout.dtype, device=device)
    slots = torch.randperm(48, device=device)
    starts, fills = torch.arange(48, device=device) * T, torch.full((48,), T, device=device)
    q_step = torch.randn(70, num_heads, D, dtype=layout.dtype, device=device)
    for num_q in range(1, 64):
        for first, num_blocks in ((0, 1), (1, 3), (3, 17), (5, 40)):
            end = first + num_blocks
            triton_paged.paged_partial_attention(q_step[first : first + num_q], pool, slots[first:end],
                                                 starts[first:end], fills[first:end], scale=0.1)
    parts = [(torch.randn(5, num_heads, D, device=device), torch.randn(5, num_heads, device=device))
             for _ in range(70)]
    for num_parts in (2, 3, 17, 33, 70):
        out, lse = triton_paged.merge_partials(parts[:num_parts])
        ref_out, ref_lse = reference.merge_partials(parts[:num_parts])
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    if rows:
        for num_rows, k in ((1, 1), (3, 5), (8, 6)):
            lists = [t[: num_rows * k].view(num_rows, k) for t in (slots, starts, fills)]
            triton_paged.paged_rows_attention(q_step[:num_rows], pool, *lists, scale=0.1)
    torch.cuda.synchronize()
    assert [_num_compiled(k) for k in kernels] == before
