"""Argument checks of one transfer; each error names the argument, what it got and what is allowed.

Primitives:
    check_transfer     validate src, dst and their slot tensors; returns block_bytes
    check_slot_list    every slot of a Python list in [0, num_slots)
    check_slot_range   every slot of a numpy array in [0, num_slots)
"""

from __future__ import annotations

import math

import numpy as np
import torch


def check_transfer(direction, src, src_slots, dst, dst_slots, device: torch.device) -> int:
    """Validate one transfer's arguments; returns block_bytes. Raises naming the argument."""
    named = (("src", src), ("dst", dst), ("src_slots", src_slots), ("dst_slots", dst_slots))
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    host_name = "src" if direction == "h2d" else "dst"
    for name, t in named[:2]:
        expected = torch.device("cpu") if name == host_name else device
        if t.device != expected:
            raise ValueError(f"{name}: expected a tensor on {expected}, got one on {t.device}")
        if t.dim() < 1:
            raise ValueError(f"{name}: expected shape [num_slots, *block_shape], got a 0-d tensor")
        if not t.is_contiguous():
            raise ValueError(f"{name}: must be contiguous")
        if name == host_name and device.type == "cuda" and not t.is_pinned():
            raise ValueError(f"{name}: the CPU slab must be in pinned memory (see pin_if_cuda)")
    if dst.dtype != src.dtype:
        raise ValueError(f"dst: dtype {dst.dtype} does not match src dtype {src.dtype}")
    if dst.shape[1:] != src.shape[1:]:
        raise ValueError(
            f"dst: block shape {tuple(dst.shape[1:])} does not match src block shape {tuple(src.shape[1:])}"
        )
    for name, slots in named[2:]:
        if slots.dtype != torch.int64 or slots.dim() != 1:
            raise ValueError(f"{name}: expected int64 [n], got {slots.dtype} of shape {tuple(slots.shape)}")
        if slots.device.type != "cpu" and slots.device != device:
            raise ValueError(f"{name}: expected a tensor on cpu or {device}, got one on {slots.device}")
    if dst_slots.numel() != src_slots.numel():
        raise ValueError(f"dst_slots: {dst_slots.numel()} slots but src_slots has {src_slots.numel()}")
    for name, slots, pool in (("src_slots", src_slots, src), ("dst_slots", dst_slots, dst)):
        if slots.device.type == "cpu" and slots.numel():
            low, high = int(slots.min()), int(slots.max())
            if low < 0 or high >= pool.shape[0]:
                bad = low if low < 0 else high
                raise ValueError(f"{name}: slot {bad} is out of range [0, {pool.shape[0]})")
    return math.prod(src.shape[1:]) * src.element_size()


def check_slot_list(name: str, slots: list[int], num_slots: int) -> None:
    for slot in slots:
        if not 0 <= slot < num_slots:
            raise ValueError(f"{name}: slot {slot} is out of range [0, {num_slots})")


def check_slot_range(name: str, slots: np.ndarray, num_slots: int) -> None:
    """Raise ValueError naming `name` when a slot lies outside [0, num_slots)."""
    if slots.size == 0:
        return
    low, high = int(slots.min()), int(slots.max())
    if low < 0 or high >= num_slots:
        bad = low if low < 0 else high
        raise ValueError(f"{name}: slot {bad} is out of range [0, {num_slots})")
