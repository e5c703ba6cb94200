"""Local-disk tier: one checksummed file per block (NVMe in production).

Primitives: `DiskTier`.

    <path>/<fan>/<quoted key>.blk                      a block, written by codec.encode_block
    <path>/<fan>/<quoted key>.<pid>.<n>.tierkv-tmp     being written, or being evicted
    fan = the key's first two hex digits (other keys: a byte of their crc32)
    quoted key = key with % / NUL escaped as %25 %2F %00: "<64 hex>/L3" -> "<64 hex>%2FL3"

Crash safety: a put writes a temp file next to its final name and renames it over that name
(os.replace), so a reader or a restarted process sees the old file or the new one, never a
torn one; temp files left by a crash are deleted on start. No fsync by default: this is a
cache, a power loss may lose recent blocks, and a file the kernel had not written back reads
short or zeroed, which the checksum catches (a miss, counted, the file removed).
`fsync=True` syncs each file before its rename and the directory after: a device flush per put.

A put of a key the tier holds, whose stored header equals the new one (same key, shape, dtype
and CRC-32 of the payload: the usual case, keys being content hashes), writes nothing: the
block only becomes the most recent (a rename over an existing file costs several creates on
ext4). The stored payload is not read back: a damaged file still fails its checksum on the next
read. Different bytes under a held key are rewritten, except in the 2^-32 case of an equal
CRC-32, which keeps the older block (still self-consistent, so never served torn).

The index (key, LRU order) lives in memory and is rebuilt on start by scanning the directory,
oldest mtime first; a get (or a put that finds the block) refreshes the file's mtime when it is
over a minute old, so the order survives a restart to within a minute without making every read
a metadata write (the idea of relatime). Capacity,
used_bytes and the byte counters count block bytes (layout.num_bytes per block; the ~100-byte
header is not counted). One DiskTier owns a directory: two live tiers on one path would evict
each other's files (and still never serve wrong bytes: reads check the stored key and checksum).
"""
from __future__ import annotations

import errno
import itertools
import logging
import os
import time
import zlib
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence
from urllib.parse import unquote

import torch

from tierkv.blocks import BlockLayout
from tierkv.storage.base import PutResult, StorageTier, TierError
from tierkv.storage.codec import CorruptBlock, encode_block, header_num_bytes, verify_block

logger = logging.getLogger(__name__)

_BLOCK_SUFFIX = ".blk"
_TMP_SUFFIX = ".tierkv-tmp"
_HEX = frozenset("0123456789abcdef")
_MAX_NAME_BYTES = 200  # quoted key + suffix; leaves room for the temp suffix under NAME_MAX
_TOUCH_INTERVAL_S = 60.0  # a used block's mtime is rewritten at most this often


class DiskTier(StorageTier):
    """Blocks as files under `path`, at most capacity_bytes // layout.num_bytes of them, LRU.

    return_evicted: PutResult.evicted carries (key, block) for blocks pushed out, read back
        from disk (one file read each) so a chain can spill them; False deletes them unread,
        right when no tier sits below this one. A plain attribute the chain may set.
    fsync: sync every block to the device before put returns (see the module docstring).
    num_io_threads: get_many/put_many spread blocks over this many threads (file I/O and the
        checksum release the GIL); 1 keeps them sequential.
    """

    kind = "disk"

    def __init__(
        self,
        name: str,
        layout: BlockLayout,
        capacity_bytes: int,
        path: str | os.PathLike,
        *,
        return_evicted: bool = True,
        fsync: bool = False,
        num_io_threads: int = 4,
    ):
        if not isinstance(capacity_bytes, int) or capacity_bytes < layout.num_bytes:
            raise ValueError(
                f"{name}: capacity_bytes={capacity_bytes!r}; must be at least one block ({layout.num_bytes})"
            )
        if num_io_threads < 1:
            raise ValueError(f"{name}: num_io_threads={num_io_threads!r}; must be >= 1")
        super().__init__(name, layout, capacity_bytes)
        self.path = Path(path)
        self.return_evicted = return_evicted
        self.fsync = fsync
        self.max_blocks = capacity_bytes // layout.num_bytes
        self._num_io_threads = num_io_threads
        self._lru: OrderedDict[str, None] = OrderedDict()  # oldest first
        self._made_dirs: set[str] = set()
        self._tmp_ids = itertools.count()
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False
        self._open_directory()
        self._rebuild_index()

    # -- StorageTier ---------------------------------------------------------------------
    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._lru

    def get(self, key: str) -> torch.Tensor | None:
        return self.get_many([key])[0]

    def put(self, key: str, block: torch.Tensor) -> PutResult:
        self._check_block(key, block)
        self._check_open()
        with self.counters.timed("put"):
            final = self._file_path(key)
            if len(os.path.basename(final).encode()) > _MAX_NAME_BYTES:
                raise ValueError(f"{self.name}: key {key[:80]!r}... is too long for a file name")
            parts = encode_block(key, block)  # [header with the CRC-32, payload]
            if self._refresh_if_stored(key, final, parts[0]):
                self.counters.add(puts=1)
                return PutResult(True)
            tmp = self._tmp_path(final)
            try:
                self._write_file(tmp, parts)
                with self._lock:
                    os.replace(tmp, final)
                    victims = self._commit(key)
            except OSError as exc:
                _unlink_quietly(tmp)
                return self._put_failed(key, exc)
            if self.fsync:
                self._sync_directory(os.path.dirname(final))
            self.counters.add(puts=1, bytes_written=self.layout.num_bytes)
            return PutResult(True, evicted=self._collect_victims(victims))

    def remove(self, key: str) -> bool:
        with self._lock:
            if key not in self._lru:
                return False
            del self._lru[key]
            self._unlink(self._file_path(key))
        self.counters.add(removes=1)
        return True

    def get_many(self, keys: Sequence[str]) -> list[torch.Tensor | None]:
        """Hits are rows of one fresh [num_known, *layout.shape] tensor the caller owns; None for a miss.

        Files are read on the I/O threads, each straight into its row; one lock, one timer and
        one counter update for the batch.
        """
        self._check_open()
        with self.counters.timed("get"):
            with self._lock:
                known = [i for i, key in enumerate(keys) if key in self._lru]
                for i in known:
                    self._lru.move_to_end(keys[i])
            batch = self.layout.empty(len(known))  # [num_known, *layout.shape], one allocation
            payloads = _payload_views(batch)

            def read(i: int, payload: memoryview) -> bool:
                return self._read_into(keys[i], self._file_path(keys[i]), payload, touch=True)

            is_read = self._run_spread(read, known, payloads)
            blocks: list[torch.Tensor | None] = [None] * len(keys)
            for i, row, ok in zip(known, batch.unbind(0), is_read):
                blocks[i] = row if ok else None
            num_hits = sum(is_read)
            self.counters.record_lookups(num_hits, len(keys) - num_hits, num_hits * self.layout.num_bytes)
        return blocks

    def put_many(self, keys: Sequence[str], blocks: Sequence[torch.Tensor]) -> list[PutResult]:
        if len(keys) != len(blocks):
            raise ValueError(f"put_many: {len(keys)} keys but {len(blocks)} blocks")
        for key, block in zip(keys, blocks):
            self._check_block(key, block)  # all or nothing: fail before the first write
        return self._run_spread(self.put, keys, blocks)

    def close(self) -> None:
        with self._lock:
            self._closed, pool, self._pool = True, self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return len(self._lru) * self.layout.num_bytes

    # -- files -----------------------------------------------------------------------------
    def _file_path(self, key: str) -> str:
        fan = key[:2] if key[:1] in _HEX and key[1:2] in _HEX else f"{zlib.crc32(key.encode()) & 0xFF:02x}"
        quoted = key.replace("%", "%25").replace("/", "%2F").replace("\0", "%00")
        return os.path.join(self.path, fan, quoted + _BLOCK_SUFFIX)

    def _tmp_path(self, final: str) -> str:
        return f"{final[: -len(_BLOCK_SUFFIX)]}.{os.getpid()}.{next(self._tmp_ids)}{_TMP_SUFFIX}"

    def _write_file(self, tmp: str, parts: list) -> None:
        directory = os.path.dirname(tmp)
        if directory not in self._made_dirs:
            os.makedirs(directory, exist_ok=True)
            self._made_dirs.add(directory)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            _write_all(fd, parts)
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def _read(self, key: str, path: str, touch: bool) -> torch.Tensor | None:
        """The verified block in `path` in a new tensor, or None (see `_read_into`)."""
        block = self.layout.empty(1)
        return block[0] if self._read_into(key, path, _payload_views(block)[0], touch) else None

    def _read_into(self, key: str, path: str, payload: memoryview, touch: bool) -> bool:
        """Read the block file at `path` into `payload` (layout.num_bytes) and verify it; False for a miss.

        A corrupt file is counted and removed. The header and the payload are read apart (one
        preadv), the payload straight into the caller's buffer: no copy after the read.
        """
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:  # removed or evicted since the index said it was here
            self._forget_if_gone(key, path)
            return False
        except OSError as exc:
            self._io_error("open", path, exc)
            return False
        header = bytearray(header_num_bytes(key, len(self.layout.shape)))
        try:
            stat = os.fstat(fd)
            is_whole = stat.st_size == len(header) + payload.nbytes
            num_read = _read_all(fd, [header, payload]) if is_whole else None
            if touch:
                _touch(fd, stat)
        except OSError as exc:
            self._io_error("read", path, exc)
            return False
        finally:
            os.close(fd)
        try:
            if not is_whole or num_read != stat.st_size:
                expected = len(header) + payload.nbytes
                raise CorruptBlock(f"block {key}: file is {stat.st_size} bytes (read {num_read}), not {expected}")
            dtype, shape = verify_block(key, header, payload)
            if shape != self.layout.shape or dtype != self.layout.dtype:
                raise CorruptBlock(f"block {key}: shape {shape} {dtype} is not this tier's layout")
        except CorruptBlock as exc:
            self._drop_corrupt(key, path, stat, exc)
            return False
        return True

    def _refresh_if_stored(self, key: str, final: str, header: bytes) -> bool:
        """True when `final` holds this block already; it becomes the most recent instead of being rewritten.

        Same header means the same key, shape, dtype and CRC-32 of the payload. The file itself is
        not read: a damaged one still fails its checksum on the next read (a miss, counted).
        """
        with self._lock:  # no eviction, removal or rename of `final` while we look
            if key not in self._lru:
                return False
            try:
                fd = os.open(final, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    stat = os.fstat(fd)
                    is_same = stat.st_size == len(header) + self.layout.num_bytes
                    is_same = is_same and os.pread(fd, len(header), 0) == header
                    if is_same:
                        _touch(fd, stat)
                finally:
                    os.close(fd)
            except OSError:  # gone or unreadable: write it anew
                return False
            if is_same:
                self._lru.move_to_end(key)
            return is_same

    def _put_failed(self, key: str, exc: OSError) -> PutResult:
        code = errno.errorcode.get(exc.errno or 0, "OSError")
        error = f"{self.name}: put {key} under {self.path} failed: {code}: {exc.strerror or exc}"
        logger.warning("%s", error)
        self.counters.add(put_failures=1, errors=1)
        return PutResult(False, error)

    def _sync_directory(self, directory: str) -> None:
        """Make the rename durable; the block is in place either way, so a failure is only counted."""
        try:
            fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            self._io_error("fsync", directory, exc)

    def _unlink(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            self._io_error("unlink", path, exc)

    def _io_error(self, op: str, path: str, exc: OSError) -> None:
        logger.warning("%s: %s %s failed: %s", self.name, op, path, exc)
        self.counters.add(errors=1)

    # -- index -----------------------------------------------------------------------------
    def _commit(self, key: str) -> list[tuple[str, str]]:
        """Index a renamed-in block and evict LRU blocks over capacity. Caller holds the lock.

        A victim whose data is wanted is renamed to a temp name (so a concurrent put of the
        same key cannot collide with it) and read after the lock is released; else unlinked.
        """
        self._lru[key] = None
        self._lru.move_to_end(key)
        victims = []
        while len(self._lru) > self.max_blocks:
            victim, _ = self._lru.popitem(last=False)
            path = self._file_path(victim)
            self.counters.add(evictions=1)
            if not self.return_evicted:
                self._unlink(path)
                continue
            hold = self._tmp_path(path)
            try:
                os.replace(path, hold)
                victims.append((victim, hold))
            except FileNotFoundError:
                pass
            except OSError as exc:
                self._io_error("evict", path, exc)
        return victims

    def _collect_victims(self, victims: list[tuple[str, str]]) -> list[tuple[str, torch.Tensor]]:
        evicted = []
        for key, hold in victims:
            block = self._read(key, hold, touch=False)
            _unlink_quietly(hold)
            if block is not None:
                self.counters.add(bytes_read=self.layout.num_bytes)
                evicted.append((key, block))
        return evicted

    def _forget_if_gone(self, key: str, path: str) -> None:
        with self._lock:
            if key in self._lru and path == self._file_path(key) and not os.path.exists(path):
                del self._lru[key]  # deleted behind our back
                self.counters.add(errors=1)

    def _drop_corrupt(self, key: str, path: str, stat: os.stat_result, exc: Exception) -> None:
        logger.warning("%s: dropping corrupt block file %s: %s", self.name, path, exc)
        self.counters.add(corrupt_blocks=1)
        with self._lock:
            try:
                current = os.stat(path)
            except OSError:
                return
            if (current.st_ino, current.st_dev) != (stat.st_ino, stat.st_dev):
                return  # a fresh put replaced the file since we read it
            self._unlink(path)
            if path == self._file_path(key):
                self._lru.pop(key, None)

    # -- start-up --------------------------------------------------------------------------
    def _open_directory(self) -> None:
        probe = os.path.join(self.path, f"probe.{os.getpid()}{_TMP_SUFFIX}")
        try:
            os.makedirs(self.path, exist_ok=True)
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644))
            os.unlink(probe)
        except OSError as exc:
            raise TierError(f"{self.name}: cannot store blocks under {str(self.path)!r}: {exc}") from exc

    def _rebuild_index(self) -> None:
        """Index the block files already on disk, oldest first; delete temp files left by a crash."""
        found = []
        try:
            for entry in _scan_two_levels(self.path):
                if entry.name.endswith(_TMP_SUFFIX):
                    _unlink_quietly(entry.path)
                elif entry.name.endswith(_BLOCK_SUFFIX):
                    key = unquote(entry.name[: -len(_BLOCK_SUFFIX)])
                    if self._file_path(key) == entry.path:
                        found.append((entry.stat(follow_symlinks=False).st_mtime_ns, key))
        except OSError as exc:
            raise TierError(f"{self.name}: cannot scan {str(self.path)!r}: {exc}") from exc
        for _, key in sorted(found):
            self._lru[key] = None
        while len(self._lru) > self.max_blocks:  # capacity shrank since the last run
            key, _ = self._lru.popitem(last=False)
            self._unlink(self._file_path(key))
            self.counters.add(evictions=1)

    def _run_spread(self, fn: Callable[[Any, Any], Any], xs: Sequence, ys: Sequence) -> list:
        """[fn(x, y) for x, y in zip(xs, ys)], in num_io_threads contiguous runs on the I/O threads.

        One task per thread rather than per block: a task hand-off costs about what a small
        file's syscalls do, and the threads would queue on the GIL for it.
        """
        num_runs = min(self._num_io_threads, len(xs))
        if num_runs < 2:
            return list(map(fn, xs, ys))
        bounds = [len(xs) * run // num_runs for run in range(num_runs + 1)]
        runs = [(xs[a:b], ys[a:b]) for a, b in zip(bounds, bounds[1:])]
        return [r for results in self._io_pool().map(lambda run: list(map(fn, *run)), runs) for r in results]

    def _io_pool(self) -> ThreadPoolExecutor:
        with self._lock:
            self._check_open()
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._num_io_threads, thread_name_prefix=f"tierkv-{self.name}")
            return self._pool

    def _check_open(self) -> None:
        if self._closed:
            raise TierError(f"{self.name}: tier is closed")


def _scan_two_levels(root: Path):
    """Files in `root` and in its subdirectories (the fan-out level), as os.DirEntry."""
    for entry in os.scandir(root):
        if entry.is_dir(follow_symlinks=False):
            yield from (sub for sub in os.scandir(entry.path) if sub.is_file(follow_symlinks=False))
        elif entry.is_file(follow_symlinks=False):
            yield entry


def _write_all(fd: int, parts: list) -> None:
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        written = os.writev(fd, views)
        if written == 0:
            raise OSError(errno.EIO, "writev wrote nothing")
        while views and written >= views[0].nbytes:
            written -= views.pop(0).nbytes
        if written:
            views[0] = views[0][written:]


def _read_all(fd: int, buffers: list) -> int:
    """Fill `buffers` in order from the start of the file; fewer bytes only at end of file."""
    views = [memoryview(b).cast("B") for b in buffers]
    num_read = 0
    while views:
        n = os.preadv(fd, views, num_read)
        if n == 0:
            break
        num_read += n
        while views and n >= views[0].nbytes:
            n -= views.pop(0).nbytes
        if n:
            views[0] = views[0][n:]
    return num_read


def _payload_views(blocks: torch.Tensor) -> list[memoryview]:
    """A writable byte view of each block of `blocks` ([num_blocks, ...], contiguous, CPU)."""
    flat = memoryview(blocks.view(torch.uint8).reshape(-1).numpy())
    step = blocks[0].numel() * blocks.element_size() if len(blocks) else 0
    return [flat[i * step : (i + 1) * step] for i in range(len(blocks))]


def _touch(fd: int, stat: os.stat_result) -> None:
    """Mark a block file used now, unless its mtime is already recent (see the module docstring)."""
    if time.time() - stat.st_mtime >= _TOUCH_INTERVAL_S:
        os.utime(fd)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
