"""Read buffers for the disk tier: page-aligned, already-faulted uint8 tensors, recycled when freed.

Primitives: `ReadBufferPool`, `slab_bytes`.

A fresh torch.empty costs a page fault and a zeroed page per 4 KiB the first time it is written,
which for a read out of the page cache costs more than the copy itself. And O_DIRECT into 4 KiB
pages scattered in physical memory is cut into device requests of at most the queue's
max_segments pages (254 on virtio-blk: about 1 MiB), a third of the speed of 4 MiB requests.
So reads land in slabs: private anonymous mmaps with transparent huge pages asked for (2 MiB physically
contiguous), populated when made. A tensor handed out keeps its slab; when the last view of it
is gone the slab goes back to the pool, which keeps up to max_free_bytes of them for the next read.

    slab:  | tensor handed out (num_bytes, rounded up to the slab size) |
           ^ page-aligned (mmap), so O_DIRECT can read into any 4096-aligned offset
"""
from __future__ import annotations

import mmap
import threading
import weakref
from collections import deque

import numpy
import torch

_HUGE_PAGE_BYTES = 2 << 20
_MIN_SLAB_BYTES = 64 << 10
_MADV_POPULATE_WRITE = 23  # Linux 5.14+; older kernels refuse it and the pages are touched instead
_PAGE_BYTES = mmap.PAGESIZE


def slab_bytes(num_bytes: int) -> int:
    """The slab size that serves num_bytes: a multiple of 2 MiB from 2 MiB up, else a power of two >= 64 KiB."""
    if num_bytes >= _HUGE_PAGE_BYTES:
        return -(-num_bytes // _HUGE_PAGE_BYTES) * _HUGE_PAGE_BYTES
    return max(_MIN_SLAB_BYTES, 1 << (num_bytes - 1).bit_length())


class ReadBufferPool:
    """Hands out [num_bytes] uint8 CPU tensors whose memory is page-aligned and already faulted in.

    Thread-safe. The caller owns a tensor until it and every view of it are gone; then its slab
    is kept for reuse (the oldest kept slabs are unmapped past max_free_bytes).
    """

    def __init__(self, max_free_bytes: int):
        if max_free_bytes < 0:
            raise ValueError(f"max_free_bytes={max_free_bytes!r}; must be >= 0")
        self.max_free_bytes = max_free_bytes
        self._free: deque[mmap.mmap] = deque()  # oldest first
        self._free_bytes = 0
        self._lock = threading.Lock()

    def empty(self, num_bytes: int) -> torch.Tensor:
        """An uninitialised [num_bytes] uint8 tensor; its data starts on a page boundary."""
        size = slab_bytes(max(num_bytes, 1))
        slab = self._take(size) or _new_slab(size)
        array = numpy.frombuffer(slab, dtype=numpy.uint8)
        finalizer = weakref.finalize(array, self._give_back, slab)  # runs once the tensor's storage lets go of it
        finalizer.atexit = False
        return torch.from_numpy(array)[:num_bytes]

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return self._free_bytes

    def clear(self) -> None:
        """Unmap every kept slab (slabs still handed out come back later and are kept again)."""
        with self._lock:
            self._free.clear()
            self._free_bytes = 0

    def _take(self, size: int) -> mmap.mmap | None:
        with self._lock:
            for i, slab in enumerate(self._free):
                if len(slab) == size:
                    del self._free[i]
                    self._free_bytes -= size
                    return slab
        return None

    def _give_back(self, slab: mmap.mmap) -> None:
        with self._lock:
            self._free.append(slab)
            self._free_bytes += len(slab)
            while self._free_bytes > self.max_free_bytes:
                self._free_bytes -= len(self._free.popleft())


def _new_slab(size: int) -> mmap.mmap:
    """An anonymous mapping of `size` bytes, huge pages asked for, every page faulted in."""
    slab = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # shared would be shmem: no THP
    if size >= _HUGE_PAGE_BYTES and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            slab.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass  # THP off: 4 KiB pages
    try:
        slab.madvise(_MADV_POPULATE_WRITE)
    except (OSError, ValueError):
        numpy.frombuffer(slab, dtype=numpy.uint8)[::_PAGE_BYTES] = 0  # one write per page faults it in
    return slab
