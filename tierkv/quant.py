"""Quantized block storage: int8 or fp8 (e4m3) codes with a scale per block, K/V and head.

Primitives: `QUANT_FORMATS`, `quantize_blocks`, `dequantize_blocks`, `max_abs_error`,
`packed_layout`, `pack_blocks`, `unpack_blocks`.

    blocks [n, 2, H, T, D] (bf16/fp16/fp32)  ->  codes [n, 2, H, T, D] uint8  +  scales [n, 2, H] float32
    int8:  code = round(x / s) in [-127, 127], s = amax / 127        (stored as its uint8 bit pattern)
    fp8:   code = float8_e4m3fn(x / s),        s = amax / 448
    a [kv, head] group holding NaN or inf: s = NaN, codes 0 (it reads back all NaN, never finite)

Disk and Redis store one tensor per block, so there the scales ride in one extra token row:

    packed [n, 2, H, T + 1, D] in the code dtype (int8 or float8_e4m3fn):
        [..., :T, :]   the codes
        [..., T, :4]   the float32 scale's 4 bytes (rest of the row zero)

The code dtype names the format, so a block written as int8 never decodes as fp8.

The same functions run on the CPU (tier puts and gets) and on the GPU (before a D2H write-back,
after an H2D gather), so PCIe carries the small form.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tierkv.blocks import BlockLayout

QUANT_FORMATS = {"int8": 127.0, "float8_e4m3fn": 448.0}
CODE_DTYPES = {"int8": torch.int8, "float8_e4m3fn": torch.float8_e4m3fn}


def quantize_blocks(blocks: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks [n, 2, H, T, D] -> (codes uint8 [n, 2, H, T, D], scales float32 [n, 2, H])."""
    qmax = QUANT_FORMATS[fmt]
    x = blocks.float()
    amax = x.abs().amax(dim=(-2, -1))                                # [n, 2, H]; NaN or inf if any value is
    finite = torch.isfinite(amax)
    scales = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    # finite values read back finite: a scale that underflowed to 0 (a group of denormals) divided 0 by 0, and one
    # whose qmax-fold rounds past float32's largest value (amax near it) decoded to inf; the first takes amax itself
    # (codes of at most 1), the second the next float32 towards 0 (its codes clamp to qmax)
    scales = torch.where(scales > 0, scales, torch.where(amax > 0, amax, 1.0))
    scales = torch.where(torch.isinf(scales * qmax) & torch.isfinite(amax), torch.nextafter(scales, torch.zeros_like(scales)),
                         scales)
    # a group holding NaN or inf gets a NaN scale: every reader (the fused kernel, in-place CPU reads) multiplies
    # by it, so the group reads back non-finite, never as finite values (a NaN amax gave scale 1 and hid the NaN)
    scales = torch.where(finite, scales, torch.full_like(amax, float("nan")))
    scaled = torch.where(finite[..., None, None], x / scales[..., None, None], 0.0)
    if fmt == "int8":
        codes = scaled.round().clamp(-127, 127).to(torch.int8).view(torch.uint8)
    else:
        codes = scaled.clamp(-qmax, qmax).to(torch.float8_e4m3fn).view(torch.uint8)
    return codes, scales


def dequantize_blocks(codes: torch.Tensor, scales: torch.Tensor, fmt: str, dtype: torch.dtype) -> torch.Tensor:
    """codes uint8 [n, 2, H, T, D], scales [n, 2, H] -> blocks [n, 2, H, T, D] in `dtype`."""
    values = codes.view(torch.int8 if fmt == "int8" else torch.float8_e4m3fn).float()
    return (values * scales[..., None, None].float()).to(dtype)


def max_abs_error(blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    """The format's worst-case error per [n, 2, H] group: half a step (int8) or 2^-4 relative (e4m3)."""
    amax = blocks.float().abs().amax(dim=(-2, -1))
    if fmt == "int8":
        return amax / 127 / 2
    return amax * 2.0**-4  # e4m3 keeps 3 mantissa bits: relative error at most 2^-4 of the value


def packed_layout(layout: "BlockLayout", fmt: str) -> "BlockLayout":
    """The layout of a packed block: one more token row, in the format's code dtype."""
    from tierkv.blocks import BlockLayout

    if layout.head_dim < 4:
        raise ValueError(f"packed {fmt} blocks need head_dim >= 4 for the float32 scale, got {layout.head_dim}")
    return BlockLayout(layout.num_kv_heads, layout.block_tokens + 1, layout.head_dim, CODE_DTYPES[fmt])


def pack_blocks(blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    """blocks [n, 2, H, T, D] -> packed [n, 2, H, T + 1, D] in the code dtype (codes, then the scale row)."""
    codes, scales = quantize_blocks(blocks, fmt)
    extra = torch.zeros((*codes.shape[:-2], 1, codes.shape[-1]), dtype=torch.uint8, device=codes.device)
    extra[..., 0, :4] = scales.contiguous().view(torch.uint8).view(*scales.shape, 4)
    return torch.cat([codes, extra], dim=-2).view(CODE_DTYPES[fmt])


def unpack_blocks(packed: torch.Tensor, fmt: str, dtype: torch.dtype) -> torch.Tensor:
    """packed [n, 2, H, T + 1, D] -> blocks [n, 2, H, T, D] in `dtype`."""
    raw = packed.view(torch.uint8)
    scales = raw[..., -1, :4].contiguous().view(torch.float32).squeeze(-1)  # [n, 2, H]
    return dequantize_blocks(raw[..., :-1, :], scales, fmt, dtype)
