"""Device tensor helpers shared by both engines.

Primitives: `append_at`.
"""
from __future__ import annotations

import torch


def append_at(buffer: torch.Tensor, start: int, values: torch.Tensor) -> torch.Tensor:
    """buffer[start : start + n] = values (n = values.numel()), in a new buffer of twice the size when
    it is too small; returns the buffer."""
    end = start + values.numel()
    if end > buffer.numel():
        grown = torch.empty(max(end, 2 * buffer.numel(), 256), dtype=buffer.dtype, device=buffer.device)
        grown[:start] = buffer[:start]
        buffer = grown
    buffer[start:end] = values
    return buffer
