"""A fused Triton kernel for the quantized gather's last step: codes + scales -> model dtype, written
straight into the destination pool slots.

Primitives: `dequantize_into_slots`.

    dst[slots[i]][kv, h] = codes[i][kv, h].as(int8 | e4m3) * scales[i][kv, h]   (fp32 math, one rounding)

The PyTorch form (`quant.dequantize_blocks` then `index_copy_`) moves about 23 bytes of memory per
value through fp32 temporaries; this moves 3 (one code byte read, two output bytes written). The
arithmetic is the same, a float32 product rounded once to the output dtype, so both give the same
values. Imports triton on first use.
"""
from __future__ import annotations

import torch

_KERNEL = None
BLOCK = 1024


def _kernel():
    global _KERNEL
    if _KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def dequantize_kernel(codes_ptr, scales_ptr, dst_ptr, slots_ptr, groups_per_block, group_elems,
                              IS_FP8: tl.constexpr, BLOCK: tl.constexpr):
            group = tl.program_id(0)                  # (block i, kv, head) flattened: i * groups_per_block + g
            part = tl.program_id(1)
            i = group // groups_per_block
            g = group % groups_per_block
            slot = tl.load(slots_ptr + i).to(tl.int64)
            scale = tl.load(scales_ptr + group)
            offs = part * BLOCK + tl.arange(0, BLOCK)
            mask = offs < tl.where(slot >= 0, group_elems, 0)  # a negative slot: block i is not written
            slot = tl.maximum(slot, 0)
            raw = tl.load(codes_ptr + group.to(tl.int64) * group_elems + offs, mask=mask, other=0)
            if IS_FP8:
                values = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            else:
                values = raw.to(tl.int8, bitcast=True).to(tl.float32)
            out = (values * scale).to(dst_ptr.dtype.element_ty)
            tl.store(dst_ptr + (slot * groups_per_block + g) * group_elems + offs, out, mask=mask)

        _KERNEL = (triton, dequantize_kernel)
    return _KERNEL


def dequantize_into_slots(codes: torch.Tensor, scales: torch.Tensor, fmt: str, dst: torch.Tensor,
                          slots: torch.Tensor) -> None:
    """codes uint8 [n, 2, H, T, D], scales float32 [n, 2, H], dst [S, 2, H, T, D] (contiguous),
    slots int64 [n] on dst's device: dst[slots[i]] = the dequantized block i, none where slots[i] < 0
    (its codes are not read)."""
    n = codes.shape[0]
    if n == 0:
        return
    if not (codes.is_contiguous() and scales.is_contiguous() and dst.is_contiguous()):
        raise ValueError("dequantize_into_slots needs contiguous codes, scales and dst")
    if tuple(codes.shape[1:]) != tuple(dst.shape[1:]) or tuple(scales.shape) != tuple(codes.shape[:3]):
        raise ValueError(f"shapes do not match: codes {tuple(codes.shape)}, scales {tuple(scales.shape)}, "
                         f"dst {tuple(dst.shape)}")
    triton, kernel = _kernel()
    groups_per_block = codes.shape[1] * codes.shape[2]
    group_elems = codes.shape[3] * codes.shape[4]
    grid = (n * groups_per_block, triton.cdiv(group_elems, BLOCK))
    kernel[grid](codes, scales, dst, slots, groups_per_block, group_elems, IS_FP8=fmt == "float8_e4m3fn", BLOCK=BLOCK)
