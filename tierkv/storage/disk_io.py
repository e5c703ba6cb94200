"""The disk tier's system calls on segment files: vectored writes and reads, page-cache probes, holes.

Primitives: `write_at`, `ReadModes`, `read_cached`, `cached_bytes`, `read_at`, `punch`,
`punch_records`, `sync_directory`, `IOV_MAX`.

Every call takes an open fd and offsets that disk_segments' format fixes (records start on ALIGN
boundaries). A kernel or filesystem that lacks a way of reading (RWF_NOWAIT, O_DIRECT, cachestat)
switches it off in `ReadModes` for the life of the tier; one that cannot punch holes gets the
record's header zeroed instead (`punch_records`).
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os

from tierkv.storage.disk_segments import ALIGN

IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


def write_at(fd: int, views: list[memoryview], offset: int) -> None:
    """Write `views` in order from `offset` with os.pwritev, at most IOV_MAX buffers a call."""
    views = [v for v in views if v.nbytes]
    while views:
        written = os.pwritev(fd, views[:IOV_MAX], offset)
        if written == 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        offset += written
        _advance(views, written)


class ReadModes:
    """Which ways of reading this kernel and filesystem support; a mode that fails with ENOSYS,
    EINVAL or EOPNOTSUPP is switched off for the life of the tier."""

    def __init__(self) -> None:
        self.is_nowait_ok = hasattr(os, "RWF_NOWAIT")
        self.is_direct_ok = hasattr(os, "O_DIRECT")
        self.is_cachestat_ok = _syscall is not None


def read_cached(fd: int, views: list[memoryview], offset: int, modes: ReadModes) -> int:
    """Fill `views` from `offset` with what the page cache holds (preadv RWF_NOWAIT); returns the
    bytes read: all of them when the range is cached, else fewer (0 where RWF_NOWAIT is unsupported).

    Ask `cached_bytes` first where it works: RWF_NOWAIT on a page cache miss still starts
    readahead, I/O that would race an O_DIRECT read of the same range that follows.
    """
    if not modes.is_nowait_ok:
        return 0
    try:
        return os.preadv(fd, views[:IOV_MAX], offset, os.RWF_NOWAIT)
    except BlockingIOError:
        return 0
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        modes.is_nowait_ok = False
        return 0


def cached_bytes(fd: int, offset: int, num_bytes: int, modes: ReadModes) -> int | None:
    """Bytes of the page-aligned range held in the page cache, asked without reading (cachestat,
    Linux 6.5+); None where the kernel lacks it."""
    if not modes.is_cachestat_ok:
        return None
    page = mmap.PAGESIZE
    first = offset // page * page
    span = _CachestatRange(first, offset + num_bytes - first)
    stat = _Cachestat()
    if _syscall(_SYS_CACHESTAT, fd, ctypes.byref(span), ctypes.byref(stat), 0) != 0:
        if ctypes.get_errno() not in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM):
            return None  # a passing failure: let RWF_NOWAIT decide this time
        modes.is_cachestat_ok = False
        return None
    return min(num_bytes, stat.nr_cache * page - (offset - first))


def read_at(fd: int, views: list[memoryview], offset: int, modes: ReadModes, direct_fd: int | None) -> int:
    """Fill `views` in order from `offset`, waiting for the device; returns the bytes read (fewer only at end of file).

    With `direct_fd` (an O_DIRECT fd of the same file; the caller passes it only when every
    buffer's address and size and `offset` are multiples of ALIGN) the bytes bypass the page
    cache, else they go through it; O_DIRECT refused with EINVAL is switched off in `modes`.
    """
    views, num_read = list(views), 0
    while views:
        use_direct = direct_fd is not None and modes.is_direct_ok and num_read % ALIGN == 0
        try:
            n = os.preadv(direct_fd if use_direct else fd, views[:IOV_MAX], offset + num_read)
        except OSError as exc:
            if not use_direct or exc.errno != errno.EINVAL:
                raise
            modes.is_direct_ok = False
            continue
        if n == 0:
            break
        num_read += n
        _advance(views, n)
    return num_read


def _advance(views: list[memoryview], num_bytes: int) -> None:
    while views and num_bytes >= views[0].nbytes:
        num_bytes -= views.pop(0).nbytes
    if num_bytes:
        views[0] = views[0][num_bytes:]


_libc = ctypes.CDLL(None, use_errno=True)
_fallocate = getattr(_libc, "fallocate", None)
if _fallocate is not None:
    _fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)


_SYS_CACHESTAT = 451  # the same on every architecture (asm-generic numbers from 424 on)
_syscall = getattr(_libc, "syscall", None) if os.uname().sysname == "Linux" else None
if _syscall is not None:
    _syscall.restype = ctypes.c_long
    _syscall.argtypes = (ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint)


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in
                ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]  # fmt: skip


def punch(fd: int, offset: int, num_bytes: int) -> None:
    """Free the bytes of a removed record (they read as zeros after); raises OSError,
    errno EOPNOTSUPP where the filesystem cannot punch holes."""
    if _fallocate is None:
        raise OSError(errno.EOPNOTSUPP, "fallocate is not available")
    if _fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, num_bytes) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def punch_records(fd: int, records: list[tuple[int, int, int]]) -> None:
    """Free removed records, (offset, record bytes, header region bytes) each, so that no scan finds
    them: punched out, or where the filesystem cannot punch holes, their headers zeroed (the space
    returns when the whole segment dies). Raises OSError."""
    for offset, record_num_bytes, header_num_bytes in records:
        try:
            punch(fd, offset, record_num_bytes)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            os.pwrite(fd, bytes(header_num_bytes), offset)


def sync_directory(directory: str) -> None:
    """fsync a directory: the files made or removed in it survive a power loss."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
