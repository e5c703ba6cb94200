"""Prefill-sized attention through PyTorch's fused kernels (cuDNN, else flash), which return the
log-sum-exp.

Primitives: `flash_partial_attention`, `gather_blocks`, `can_use_flash`.

Used for large query counts on CUDA (prefill chunks), where the flash kernel is several times
faster than the split-K Triton kernel built for decode. GQA without copying K/V: for
non-causal attention, the query heads of one KV group fold into the query axis

    q [n, H, D] -> [1, Hkv, group * n, D]      (order of queries does not matter without a mask)

For causal attention the fold would break the diagonal, so K/V heads are expanded instead.
Causal here means queries and keys are the same positions (the chunk attending to itself).
"""
from __future__ import annotations

import torch

MIN_QUERIES = 64


def can_use_flash(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and q.shape[0] >= MIN_QUERIES and q.shape[-1] <= 256


def gather_blocks(kv_pool: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_pool [num_slots, 2, Hkv, T, D], slots [nb] -> k, v [nb * T, Hkv, D] (full blocks only)."""
    blocks = kv_pool.index_select(0, slots)                         # [nb, 2, Hkv, T, D]
    kv = blocks.permute(1, 0, 3, 2, 4).reshape(2, -1, *blocks.shape[2:3], blocks.shape[-1])
    return kv[0], kv[1]                                             # [nb*T, Hkv, D] each


def flash_partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                            causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, H, D]; k, v [m, Hkv, D] (m == n when causal) -> float32 out [n, H, D], lse [n, H]."""
    n, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    if causal:
        if k.shape[0] != n:
            raise ValueError(f"causal flash attention needs as many keys as queries, got {k.shape[0]} and {n}")
        qh = q.transpose(0, 1).unsqueeze(0)                                       # [1, H, n, D]
        kh = k.transpose(0, 1).repeat_interleave(group, dim=0).unsqueeze(0)        # [1, H, n, D]
        vh = v.transpose(0, 1).repeat_interleave(group, dim=0).unsqueeze(0)
        out, lse = _flash(qh, kh, vh, scale, True)
        return out[0].transpose(0, 1).float(), lse[0, :, :n].transpose(0, 1)
    # fold the group into the query axis: [n, Hkv, g, D] -> [1, Hkv, g*n, D]
    qf = q.view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(1, num_kv_heads, group * n, head_dim)
    out, lse = _flash(qf, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), scale, False)
    out = out[0].view(num_kv_heads, group, n, head_dim).permute(2, 0, 1, 3).reshape(n, num_heads, head_dim)
    lse = lse[0, :, : group * n].reshape(num_kv_heads, group, n).permute(2, 0, 1).reshape(n, num_heads)
    return out.float(), lse.float()


_CUDNN_OK: dict[torch.device, bool] = {}


def _flash(q, k, v, scale: float, causal: bool):
    """(out [1, H, n, D], lse [1, H, >=n]) from cuDNN's fused attention where it runs, else flash.

    On the H200 cuDNN's kernel is 1.7x faster than PyTorch's flash kernel for these shapes and
    returns the same LSE (`benchmarks/results/attention-backends-h200.json`); it is what
    `F.scaled_dot_product_attention` picks there, so the all-in-GPU baseline uses it too.
    """
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if _CUDNN_OK.get(q.device, True):
        try:
            result = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                                        scale=scale)
            _CUDNN_OK[q.device] = True
            return result[0], result[1].squeeze(-1)
        except (RuntimeError, NotImplementedError):  # no cuDNN attention for this GPU or build: flash from now on
            _CUDNN_OK[q.device] = False
    result = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return result[0], result[1]
