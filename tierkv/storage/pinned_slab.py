"""The CPU tier's slab in pinned host memory, locking no more than it uses.

Primitives: `allocate_slab`, `pinned_bytes`, `slab_locked_bytes`, `unrounded_pinning`, `exact_pinned`.

PyTorch's pinned allocator rounds an allocation up to a power of two, so a 40 GiB slab would lock
64 GiB. `allocate_slab` takes an exact allocation (`exact_pinned`, cudaHostAlloc through cupy) or lowers the
allocator's rounding threshold for it (`unrounded_pinning`) where rounding would cost more than a
quarter; `slab_locked_bytes` says what a slab of a size will lock, without allocating.
"""
from __future__ import annotations

import ctypes
import logging
import math
import os
import re
import weakref

import numpy as np
import torch

logger = logging.getLogger(__name__)


def _allocator_settings() -> str:
    """The allocator settings in effect: PyTorch's own where it can read them back, else the
    PYTORCH_CUDA_ALLOC_CONF and PYTORCH_ALLOC_CONF variables, comma-separated."""
    get = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if get is not None:
        return get()
    return ",".join(v for v in (os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), os.environ.get("PYTORCH_ALLOC_CONF")) if v)


def _rounding_is_costly(num_bytes: int, locked: int) -> bool:
    """Whether locking `locked` bytes for a slab of `num_bytes` wastes more than a quarter of it."""
    return locked - num_bytes > num_bytes // 4


def pinned_bytes(num_bytes: int) -> int:
    """Host bytes PyTorch's pinned allocator locks for `num_bytes`: the next power of two, or
    exactly `num_bytes` above a `pinned_max_round_threshold_mb` in the allocator settings."""
    settings = ",".join([_allocator_settings(), os.environ.get("PYTORCH_ALLOC_CONF", ""),
                         os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")])
    thresholds = [int(mb) << 20 for mb in re.findall(r"pinned_max_round_threshold_mb:(\d+)", settings)]
    if num_bytes <= 0 or (thresholds and num_bytes > min(thresholds)):
        return num_bytes
    return 1 << (num_bytes - 1).bit_length()


def unrounded_pinning(num_bytes: int) -> bool:
    """Ask PyTorch's pinned allocator not to round allocations of `num_bytes` up to a power of two
    (its `pinned_max_round_threshold_mb` setting, lowered just below them; smaller allocations
    keep their rounding). The settings in effect (the allocator's own where PyTorch can read
    them back, else the PYTORCH_*ALLOC_CONF variables) are passed again with it, so none is reset.
    True when the settings now say so, False where this PyTorch has no such setting."""
    if pinned_bytes(num_bytes) == num_bytes:
        return True
    if num_bytes <= 2 << 20:  # the threshold is in whole MiB, above 0
        return False
    set_settings = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if set_settings is None:
        return False
    kept = [item for item in _allocator_settings().split(",")
            if item and not item.startswith("pinned_max_round_threshold_mb")]
    try:
        set_settings(",".join([*kept, f"pinned_max_round_threshold_mb:{max(1, (num_bytes >> 20) - 1)}"]))
    except (RuntimeError, ValueError) as e:
        logger.info("PyTorch refused pinned_max_round_threshold_mb (%s)", e)
        return False
    return pinned_bytes(num_bytes) == num_bytes


def slab_locked_bytes(num_bytes: int) -> int:
    """Host bytes a pinned slab of `num_bytes` locks (`allocate_slab`'s choice, without allocating): its own
    size where rounding would cost more than a quarter and cupy can pin it exactly, else what
    PyTorch's allocator asks for (`pinned_bytes`)."""
    import importlib.util

    rounded = pinned_bytes(num_bytes)
    if _rounding_is_costly(num_bytes, rounded) and importlib.util.find_spec("cupy") is not None:
        return num_bytes
    return rounded


def exact_pinned(shape: tuple, dtype: torch.dtype, name: str) -> torch.Tensor | None:
    """A pinned tensor of exactly its bytes, from cudaHostAlloc through cupy (PyTorch's pinned
    allocator would round it up to a power of two), given back to CUDA when its last view goes;
    None without cupy."""
    try:
        import cupy  # optional dependency (extra "gpu")
    except ImportError:
        return None
    num_bytes = math.prod(shape) * dtype.itemsize
    try:
        pointer = cupy.cuda.runtime.hostAlloc(num_bytes, 0)
    except cupy.cuda.runtime.CUDARuntimeError as e:
        raise RuntimeError(f"{name}: could not pin {num_bytes} bytes of host memory for the CPU tier: "
                           f"lower capacity_bytes ({e})") from e
    owner = np.ctypeslib.as_array((ctypes.c_uint8 * num_bytes).from_address(pointer))
    weakref.finalize(owner, cupy.cuda.runtime.freeHost, pointer).atexit = False  # at exit the process frees it
    return torch.from_numpy(owner).view(dtype).view(shape)


def allocate_slab(shape: tuple, dtype: torch.dtype, pin_memory: bool, name: str) -> torch.Tensor:
    """The tier's slab. PyTorch's pinned allocator rounds an allocation up to a power of two, so
    a pinned slab could lock up to twice its bytes: where that would cost more than a quarter,
    the slab comes from `exact_pinned`, else from PyTorch with `unrounded_pinning`; where neither
    can, that is said once here, and named in the error when the host cannot lock that much."""
    if not pin_memory:
        return torch.empty(shape, dtype=dtype)
    num_bytes = math.prod(shape) * dtype.itemsize
    locked = pinned_bytes(num_bytes)
    if _rounding_is_costly(num_bytes, locked):
        exact = exact_pinned(shape, dtype, name)
        if exact is not None:
            return exact
        if unrounded_pinning(num_bytes):
            locked = num_bytes
    if _rounding_is_costly(num_bytes, locked):
        logger.warning("%s: its %.1f GiB slab locks %.1f GiB of host memory (PyTorch's pinned allocator "
                       "rounds to a power of two); a capacity of %.1f GiB would lock only what it uses",
                       name, num_bytes / 2**30, locked / 2**30, (locked >> 1) / 2**30)
    try:
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    except RuntimeError as e:
        rounding = f" (PyTorch's pinned allocator asks for {locked}, the next power of two)" if locked > num_bytes else ""
        raise RuntimeError(f"{name}: could not pin {num_bytes} bytes of host memory for the CPU tier{rounding}: "
                           f"lower capacity_bytes ({e})") from e
