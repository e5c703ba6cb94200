"""Blocks for the storage tests: a seeded random block of a layout, and bit-exact comparison."""
from __future__ import annotations

import torch


def make_block(layout, seed: int) -> torch.Tensor:
    """A block of `layout` (random normal values in its dtype), the same for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(layout.shape, generator=gen).to(layout.dtype)


def same(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    """`a` is there and holds exactly `b`'s bits (NaNs and signed zeros included)."""
    return a is not None and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
