"""Batched block copies on the copy engines: CUDA's `cudaMemcpyBatchAsync`, no SMs used.

One call enqueues every block of a batch as a pointer-to-pointer copy; the driver spreads them
over the DMA copy engines. The pointer and size arrays live on the host, so slot lists must be
on the host too (device slot tensors cost a host sync), and the call cannot be captured in a
CUDA graph.

Primitives:
    batch_copy_arrays       (dsts, srcs, sizes) uint64 host arrays for dst[dst_slots] = src[src_slots],
                            consecutive slot pairs merged into one copy (numpy, no Python loop)
    run_starts              where those runs of consecutive slot pairs begin
    MemcpyBatch             `cudaMemcpyBatchAsync` of the CUDA runtime torch loaded, through ctypes
    MemcpyBatchUnavailable  raised by MemcpyBatch.load() when the runtime lacks the call

Signatures (the runtime's major version picks one; 12.8 and 12.9 have failIdx, 13 dropped it):

    12.8+: cudaMemcpyBatchAsync(dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, failIdx, stream)
    13.0+: cudaMemcpyBatchAsync(dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, stream)

One attribute entry covers the whole batch: the source is read in stream order.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import torch

FIRST_VERSION = 12080  # cudaRuntimeGetVersion of CUDA 12.8
VERSION_WITHOUT_FAIL_INDEX = 13000
_SRC_ACCESS_ORDER_STREAM = 1  # cudaMemcpySrcAccessOrderStream


class MemcpyBatchUnavailable(RuntimeError):
    """The loaded CUDA runtime has no usable `cudaMemcpyBatchAsync`."""


def batch_copy_arrays(
    src_address: int, src_slots: np.ndarray, dst_address: int, dst_slots: np.ndarray, block_bytes: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Host arrays (dsts, srcs, sizes), uint64 [num_runs] each, for dst[dst_slots[i]] = src[src_slots[i]].

    src_address, dst_address: bases of [num_slots, block_bytes] slabs; src_slots, dst_slots: int
    [n] slot numbers, assumed in range. A run of pairs where both slots advance by one becomes
    one copy of run_length * block_bytes bytes:

        src_slots  [4, 5, 6, 9]      srcs   [src + 4b, src + 9b]
        dst_slots  [0, 1, 2, 7]  ->  dsts   [dst + 0b, dst + 7b]      (b = block_bytes)
                                     sizes  [3b, 1b]
    """
    src_slots = np.asarray(src_slots, dtype=np.int64).reshape(-1)
    dst_slots = np.asarray(dst_slots, dtype=np.int64).reshape(-1)
    if src_slots.shape != dst_slots.shape:
        raise ValueError(f"dst_slots: {dst_slots.size} slots but src_slots has {src_slots.size}")
    num_pairs = src_slots.size
    if num_pairs == 0:
        empty = np.empty(0, dtype=np.uint64)
        return empty, empty.copy(), empty.copy()
    starts = run_starts(src_slots, dst_slots)
    run_lengths = np.diff(np.append(starts, num_pairs)).astype(np.uint64)
    block = np.uint64(block_bytes)
    srcs = np.uint64(src_address) + src_slots[starts].astype(np.uint64) * block
    dsts = np.uint64(dst_address) + dst_slots[starts].astype(np.uint64) * block
    return dsts, srcs, run_lengths * block


def run_starts(src_slots: np.ndarray, dst_slots: np.ndarray) -> np.ndarray:
    """Indices where a run of pairs begins (both slots advancing by one continues a run);
    int64 [n], non-empty for n > 0."""
    is_run_start = np.ones(src_slots.size, dtype=bool)
    is_run_start[1:] = (np.diff(src_slots) != 1) | (np.diff(dst_slots) != 1)
    return np.flatnonzero(is_run_start)


class _MemLocation(ctypes.Structure):  # cudaMemLocation: a hint, ignored for pinned/device memory
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):  # cudaMemcpyAttributes
    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


class MemcpyBatch:
    """`cudaMemcpyBatchAsync` of one loaded CUDA runtime; `load()` finds torch's."""

    def __init__(self, library: ctypes.CDLL, path: str, version: int) -> None:
        if version < FIRST_VERSION:
            raise MemcpyBatchUnavailable(
                f"cudaMemcpyBatchAsync needs CUDA runtime 12.8+, {path} is {_version_text(version)}"
            )
        try:
            function = library.cudaMemcpyBatchAsync
        except AttributeError as exc:
            raise MemcpyBatchUnavailable(f"{path} ({_version_text(version)}) has no cudaMemcpyBatchAsync") from exc
        self.path = path
        self.version = version
        self.has_fail_index = version < VERSION_WITHOUT_FAIL_INDEX
        pointers = [ctypes.c_void_p] * 3 + [ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        function.argtypes = pointers + ([ctypes.c_void_p] if self.has_fail_index else []) + [ctypes.c_void_p]
        function.restype = ctypes.c_int
        self._function = function
        self._error_string = library.cudaGetErrorString
        self._error_string.argtypes = [ctypes.c_int]
        self._error_string.restype = ctypes.c_char_p
        self._attributes = _MemcpyAttributes(srcAccessOrder=_SRC_ACCESS_ORDER_STREAM)
        self._attribute_index = ctypes.c_size_t(0)

    @classmethod
    def load(cls) -> MemcpyBatch:
        """The call in the CUDA runtime torch uses; MemcpyBatchUnavailable says why not."""
        if not torch.cuda.is_available():
            raise MemcpyBatchUnavailable("CUDA is not available")
        torch.cuda.init()  # torch loads its runtime lazily
        path = loaded_cudart_path()
        if path is None:
            raise MemcpyBatchUnavailable("no libcudart is loaded in this process (torch without CUDA?)")
        library = ctypes.CDLL(path)  # already loaded: the same handle torch uses
        version = ctypes.c_int(0)
        library.cudaRuntimeGetVersion(ctypes.byref(version))
        return cls(library, path, version.value)

    def enqueue(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: torch.cuda.Stream) -> None:
        """Enqueue copies srcs[i] -> dsts[i] of sizes[i] bytes (uint64 host arrays) on `stream`.

        Returns once enqueued (no host sync); RuntimeError with CUDA's message on failure.
        """
        count = sizes.size
        if count == 0:
            return
        if not (dsts.dtype == srcs.dtype == sizes.dtype == np.uint64 and dsts.size == srcs.size == count):
            raise ValueError("dsts, srcs, sizes: expected uint64 arrays of one length")
        arrays = [np.ascontiguousarray(a) for a in (dsts, srcs, sizes)]
        args = [a.ctypes.data for a in arrays]
        args += [count, ctypes.addressof(self._attributes), ctypes.addressof(self._attribute_index), 1]
        fail_index = ctypes.c_size_t(0)  # 12.8 and 12.9 only; alive until the call returns
        if self.has_fail_index:
            args.append(ctypes.addressof(fail_index))
        status = self._function(*args, ctypes.c_void_p(stream.cuda_stream))
        if status != 0:
            message = self._error_string(status).decode(errors="replace")
            raise RuntimeError(f"cudaMemcpyBatchAsync of {count} copies failed: error {status}, {message}")


def loaded_cudart_path() -> str | None:
    """Path of the libcudart mapped into this process whose major version matches torch's CUDA."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    paths = sorted({line.split()[-1] for line in maps.splitlines() if "/libcudart.so" in line})
    major = (torch.version.cuda or "").split(".")[0]
    matching = [p for p in paths if Path(p).name.startswith(f"libcudart.so.{major}")]
    return (matching or paths or [None])[0]


def _version_text(version: int) -> str:
    return f"CUDA {version // 1000}.{version % 1000 // 10}"
