"""Quantized block storage: int8 or fp8 (e4m3) codes with a scale per block, K/V and head.

Primitives: `QUANT_FORMATS`, `quantize_blocks`, `dequantize_blocks`, `max_abs_error`.

    blocks [n, 2, H, T, D] (bf16/fp16/fp32)  ->  codes [n, 2, H, T, D] uint8  +  scales [n, 2, H] float32
    int8:  code = round(x / s) in [-127, 127], s = amax / 127        (stored as its uint8 bit pattern)
    fp8:   code = float8_e4m3fn(x / s),        s = amax / 448

The same functions run on the CPU (tier puts and gets) and on the GPU (before a D2H write-back,
after an H2D gather), so PCIe carries the small form.
"""
from __future__ import annotations

import torch

QUANT_FORMATS = {"int8": 127.0, "float8_e4m3fn": 448.0}


def quantize_blocks(blocks: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks [n, 2, H, T, D] -> (codes uint8 [n, 2, H, T, D], scales float32 [n, 2, H])."""
    qmax = QUANT_FORMATS[fmt]
    x = blocks.float()
    amax = x.abs().amax(dim=(-2, -1))                                # [n, 2, H]
    scales = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    scaled = x / scales[..., None, None]
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
