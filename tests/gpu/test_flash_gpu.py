"""GPU: the flash prefill path returns the same (out, lse) as the reference, GQA and causal included."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (run on the GPU machine)", allow_module_level=True)

from tierkv.attention import reference  # noqa: E402
from tierkv.attention.flash import flash_partial_attention, gather_blocks  # noqa: E402


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_flash_matches_reference(group, causal):
    n, kv_heads, dim = 1000, 8 // group if group > 1 else 8, 128
    heads = kv_heads * group
    q = torch.randn(n, heads, dim, device="cuda", dtype=torch.bfloat16)
    m = n if causal else 1500
    k = torch.randn(m, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(m, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    out, lse = flash_partial_attention(q, k, v, scale=dim**-0.5, causal=causal)
    positions = torch.arange(n, device="cuda") if causal else None
    ref_out, ref_lse = reference.contiguous_partial_attention(
        q.float(), k.float(), v.float(), scale=dim**-0.5, q_positions=positions, k_positions=positions)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert rel(out, ref_out) < 1e-2
    assert (lse - ref_lse).abs().max().item() < 2e-2


def test_gather_blocks_orders_tokens_by_slot_list():
    pool = torch.randn(10, 2, 2, 4, 8, device="cuda")
    slots = torch.tensor([7, 2, 5], device="cuda")
    k, v = gather_blocks(pool, slots)
    assert k.shape == (12, 2, 8)
    assert torch.equal(k[4:8], pool[2, 0].transpose(0, 1))
    assert torch.equal(v[8:12], pool[5, 1].transpose(0, 1))


@pytest.mark.parametrize("causal", [True, False])
def test_cudnn_and_flash_kernels_agree(causal, monkeypatch):
    """Both fused kernels the prefill path may use give the same output and LSE (1000 tokens)."""
    from tierkv.attention import flash

    q = torch.randn(1000, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1000 if causal else 1700, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    results = {}
    for use_cudnn in (True, False):
        monkeypatch.setitem(flash._CUDNN_OK, q.device, use_cudnn)
        results[use_cudnn] = flash_partial_attention(q, k, v, scale=128**-0.5, causal=causal)
        if use_cudnn:  # else this compares the flash kernel with itself
            assert flash._CUDNN_OK[q.device], "cuDNN attention did not run on this GPU (it does on the H200)"
    (out_c, lse_c), (out_f, lse_f) = results[True], results[False]
    assert rel(out_c, out_f) < 1e-2
    assert (lse_c - lse_f).abs().max().item() < 1e-2
