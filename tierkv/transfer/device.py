"""Device tensor helpers shared by both engines.

Primitives: `to_device_no_sync`, `append_at`, `pin_if_cuda`.
"""
from __future__ import annotations

import torch


def to_device_no_sync(values: list[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """int64 tensor on `device`; on CUDA staged through pinned memory, so the host never waits."""
    if isinstance(values, torch.Tensor) and values.is_cuda and device.type == "cuda":
        return values.to(device, torch.int64, non_blocking=True)  # already on a GPU (a fetch's staging slots)
    host = torch.as_tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


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


def pin_if_cuda(t: torch.Tensor) -> torch.Tensor:
    """`t` in pinned memory when CUDA is available (a copy unless already pinned), else `t`."""
    if t.device.type != "cpu":
        raise ValueError(f"t: expected a CPU tensor, got one on {t.device}")
    if torch.cuda.is_available() and not t.is_pinned():
        return t.pin_memory()
    return t
