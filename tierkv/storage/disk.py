"""Local-disk tier: blocks appended to segment files, indexed in memory (NVMe in production).

Primitives: `DiskTier`.

    <path>/<16 hex digits>.seg   a segment: records appended in order (format: disk_segments)
    <path>/lru.order             the LRU order at the last close; a hint for the next start

Writes. A put_many appends its blocks to the active segment (pwritev at offsets known up
front; a batch of a MiB or more in parts on the I/O threads) and then indexes them; a segment
past segment_bytes is closed and a new one begun. A crash mid-append leaves torn records only
in the range being appended: at the end of a segment, which the scan at start drops (the file
is cut after the last whole record), or, when parts were written at once, before a later part's
whole records, where a torn record fails its checksum when read (a miss, counted, dropped);
a failed append (a full disk) is cut away at once. No fsync by default: this is a cache, and
a record that a power loss kept from the device fails its checksum when read (a miss, counted,
dropped). fsync=True: one fdatasync per put_many, before it returns.

Reads (disk_reads). get_many sorts its hits by segment and offset into slots of one recycled,
pre-faulted slab (disk_buffers), each slot the record as on disk, and reads each run of adjacent
records with one preadv: from the page cache where it holds them (cachestat, then RWF_NOWAIT),
over the I/O threads, else from the device with O_DIRECT on the calling thread, in pieces, an
I/O thread checking each piece while the next is read. Each block's header and payload
checksums are checked (XXH3-64; CRC-32 in records of format version 1; both release the GIL);
a block that fails is a miss, counted, dropped.

Remove and evict punch a hole over the record (fallocate PUNCH_HOLE): the space is free at once
and no later scan finds it; a segment with no live record left is deleted. Where the
filesystem cannot punch holes the header is zeroed instead, and the space returns when the
whole segment dies. A put of bytes the tier holds under that key (same checksum, the usual case
for content-addressed keys) writes nothing and only refreshes the block's LRU position.

Trust and loss (disk_files, disk_scan). The directory must be this user's and not writable by
group or others (else TierError); it is 0700, files 0600, created O_EXCL and opened O_NOFOLLOW.
Every record the start-up scan drops is logged and counted (scan_dropped_records, by reason). A
segment deleted or replaced while the tier runs (a tmp cleaner) is forgotten with its blocks
(lost_blocks, by reason), found before each append and on reads; appends go to a new segment,
in a directory made again (and checked) if it is gone.

Index: key -> (segment, offset, sizes, payload checksum), LRU-ordered, rebuilt on start from
the segment headers in write order (a later record of a key wins) and then reordered by
lru.order when the last run closed cleanly (else write order stands). Capacity, used_bytes and
the byte counters count block bytes (layout.num_bytes each); a record on disk also holds its
4 KiB header region and padding to 4 KiB. One DiskTier should own a directory: two live tiers
on one path (tensor-parallel ranks) each append to segments of their own, see the other's
blocks only as found at start, and never serve wrong bytes (reads check key and checksum).
"""
from __future__ import annotations

import ctypes
import errno
import itertools
import logging
import os
import tempfile
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Callable, Sequence

import torch

from tierkv.blocks import dtype_name
from tierkv.blocks import BlockLayout
from tierkv.storage import disk_files as files
from tierkv.storage import disk_scan
from tierkv.storage import disk_segments as seg
from tierkv.storage.base import PutResult, StorageTier, TierError
from tierkv.storage.disk_buffers import ReadBufferPool
from tierkv.storage.disk_reads import SEGMENT_GONE, SEGMENT_REPLACED, BatchReader, Entry

logger = logging.getLogger(__name__)

_SEGMENT_SUFFIX = ".seg"
_ORDER_FILE = "lru.order"
_SPREAD_MIN_BYTES = 1 << 20  # smaller batches stay on the caller's thread
_CHUNK_BYTES = 1 << 20  # checksummed, then written, at a time: stays in the CPU cache
_MAX_IO_THREADS = 4
_READ_BUFFER_BYTES = 64 << 20  # freed get_many results kept for the next reads


class DiskTier(StorageTier):
    """Blocks in segment files under `path`, at most capacity_bytes // layout.num_bytes of them, LRU.

    return_evicted: PutResult.evicted carries (key, block) for blocks pushed out, read back
        from disk so a chain can spill them; False drops them unread, right when no tier sits
        below this one. A plain attribute the chain may set.
    fsync: sync each put_many's records to the device before it returns.
    num_io_threads: large put_many batches and page-cache reads are split over this many threads,
        and device reads are checked on them behind the reading thread; None: one per CPU this
        process may run on, at most 4 (more threads than cores only add GIL hand-offs).
    segment_bytes: a segment takes appends until it is this long; None: capacity / 8,
        clamped to [1 MiB, 1 GiB].
    read_buffer_bytes: get_many results land in pre-faulted slabs (disk_buffers); up to this
        many bytes of slabs whose tensors were freed are kept for later reads.
    """

    kind = "disk"

    def __init__(
        self, name: str, layout: BlockLayout, capacity_bytes: int, path: str | os.PathLike, *,
        return_evicted: bool = True, fsync: bool = False, num_io_threads: int | None = None,
        segment_bytes: int | None = None, read_buffer_bytes: int = _READ_BUFFER_BYTES,
    ):  # fmt: skip
        if not isinstance(capacity_bytes, int) or capacity_bytes < layout.num_bytes:
            raise ValueError(
                f"{name}: capacity_bytes={capacity_bytes!r}; must be at least one block ({layout.num_bytes})"
            )
        if num_io_threads is not None and num_io_threads < 1:
            raise ValueError(f"{name}: num_io_threads={num_io_threads!r}; must be >= 1 or None")
        if segment_bytes is not None and segment_bytes < 1:
            raise ValueError(f"{name}: segment_bytes={segment_bytes!r}; must be >= 1 or None")
        super().__init__(name, layout, capacity_bytes)
        self.path = Path(path).expanduser()
        self.return_evicted = return_evicted
        self.fsync = fsync
        self.max_blocks = capacity_bytes // layout.num_bytes
        self.segment_bytes = segment_bytes or min(1 << 30, max(1 << 20, capacity_bytes // 8))
        self._num_io_threads = num_io_threads or min(_MAX_IO_THREADS, _num_usable_cpus())
        self._dtype_name, self._shape = dtype_name(layout.dtype), tuple(layout.shape)
        self._pad = memoryview(bytearray(seg.round_up(layout.num_bytes) - layout.num_bytes))
        self._chunk_records = max(1, _CHUNK_BYTES // (seg.ALIGN + seg.round_up(layout.num_bytes)))
        self._index: OrderedDict[str, Entry] = OrderedDict()  # oldest first
        self._num_live: dict[int, int] = {}  # segment id -> records not yet dropped
        self._identities: dict[int, files.FileIdentity] = {}  # segment id -> (device, inode) we wrote or scanned
        self._append_lock = threading.Lock()  # the active segment: its fd, size and rollover
        self._active_id: int | None = None
        self._active_fd: int | None = None
        self._active_size = 0
        self._next_segment_id = 0
        self._modes = seg.ReadModes()
        self._buffers = ReadBufferPool(read_buffer_bytes)
        self._pool: ThreadPoolExecutor | None = None
        self._reader = BatchReader(layout, self._open_segment, self._buffers, self._modes, self._spread, self._checker)
        self._closed = False
        self._open_directory()
        self._rebuild_index()

    # -- StorageTier ---------------------------------------------------------------------
    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._index

    def get(self, key: str) -> torch.Tensor | None:
        return self.get_many([key])[0]

    def put(self, key: str, block: torch.Tensor) -> PutResult:
        return self.put_many([key], [block])[0]

    def remove(self, key: str) -> bool:
        return self.remove_many([key])[0]

    def remove_many(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            entries = [self._index.pop(key, None) for key in keys]
        removed = [e for e in entries if e is not None]
        self._drop_records(removed)
        self.counters.add(removes=len(removed))
        return [e is not None for e in entries]

    def get_many(self, keys: Sequence[str]) -> list[torch.Tensor | None]:
        """Hits are [*layout.shape] views of one fresh read buffer the caller owns; None for a miss."""
        self._check_open()
        with self.counters.timed("get"):
            with self._lock:
                found = [(i, self._index[key]) for i, key in enumerate(keys) if key in self._index]
                for i, _ in found:
                    self._index.move_to_end(keys[i])
            rows, failures = self._read_blocks([keys[i] for i, _ in found], [e for _, e in found])
            blocks: list[torch.Tensor | None] = [None] * len(keys)
            for (i, _), row, failure in zip(found, rows, failures):
                blocks[i] = row if failure is None else None
            num_hits = failures.count(None)
            self.counters.record_lookups(num_hits, len(keys) - num_hits, num_hits * self.layout.num_bytes)
        return blocks

    def put_many(self, keys: Sequence[str], blocks: Sequence[torch.Tensor]) -> list[PutResult]:
        """Append the blocks not already held to the active segment; all fail together on an I/O error.

        Blocks evicted to make room travel on the batch's last result.
        """
        if len(keys) != len(blocks):
            raise ValueError(f"put_many: {len(keys)} keys but {len(blocks)} blocks")
        for key, block in zip(keys, blocks):
            self._check_block(key, block)  # fail before the first write
            if len(key) > seg.MAX_KEY_BYTES // 4 and len(key.encode()) > seg.MAX_KEY_BYTES:
                raise ValueError(f"{self.name}: key {key[:80]!r}... is longer than {seg.MAX_KEY_BYTES} utf-8 bytes")
        self._check_open()
        with self.counters.timed("put"):
            payloads = [_bytes_of(block) for block in blocks]
            results: list[PutResult | None] = [None] * len(keys)
            with self._lock:
                held = {i: self._index[key] for i, key in enumerate(keys) if key in self._index}
            is_same = {i: seg.checksum(e.checksum_kind, payloads[i]) == e.payload_checksum for i, e in held.items()}
            with self._lock:
                for i in (i for i, same in is_same.items() if same):
                    if self._index.get(keys[i]) is held[i]:  # held already: refresh only
                        self._index.move_to_end(keys[i])
                        results[i] = PutResult(True)
            todo = [i for i, r in enumerate(results) if r is None]
            if todo:
                appended = self._append([keys[i] for i in todo], [payloads[i] for i in todo])
                for i, result in zip(todo, appended):
                    results[i] = result
            self.counters.add(puts=sum(r.ok for r in results))
        return results

    def close(self) -> None:
        with self._lock:
            was_closed, self._closed, pool, self._pool = self._closed, True, self._pool, None
        if was_closed:
            return
        if pool is not None:
            pool.shutdown(wait=True)
        self._buffers.clear()
        with self._append_lock, self._lock:
            if self._active_fd is not None:
                os.close(self._active_fd)
                self._active_fd = None
            order = list(self._index)
        try:
            seg.save_order(os.path.join(self.path, _ORDER_FILE), order)
        except OSError as exc:
            self._io_error("save order", str(self.path), exc)

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return len(self._index) * self.layout.num_bytes

    # -- writing ---------------------------------------------------------------------------
    def _append(self, keys: list[str], payloads: list[memoryview]) -> list[PutResult]:
        """Write records for these blocks at the end of the active segment, then index them."""
        with self._append_lock:
            self._check_open()
            for _ in range(2):  # a segment lost during the write: once more in a new one
                start = None
                try:
                    fd, start = self._active_segment()
                    headers = self._write_records(fd, start, keys, payloads)
                    if self.fsync:
                        os.fdatasync(fd)
                except (OSError, TierError) as exc:  # TierError: the directory, made again, is unsafe
                    self._cut_back(start)
                    return [self._put_failed(key, exc) for key in keys]
                if not self._roll_over_if_lost():
                    break
            else:
                lost = OSError(errno.ENOENT, "the segment file was deleted or replaced while being written, twice")
                return [self._put_failed(key, lost) for key in keys]
            entries, offset = [], start
            for header in headers:
                entries.append(Entry(self._active_id, offset, header))
                offset += header.record_num_bytes
            self._active_size = offset
            with self._lock:
                dropped, victims = self._commit(keys, entries)
        self.counters.add(bytes_written=len(keys) * self.layout.num_bytes)
        evicted = []
        if victims and self.return_evicted:
            victim_keys = [key for key, _ in victims]
            rows, failures = self._read_blocks(victim_keys, [e for _, e in victims])
            evicted = [(key, row) for key, row, failure in zip(victim_keys, rows, failures) if failure is None]
            self.counters.add(bytes_read=len(evicted) * self.layout.num_bytes)
        self._drop_records(dropped + [e for _, e in victims])
        results = [PutResult(True) for _ in keys]
        results[-1].evicted = evicted
        return results

    def _write_records(
        self, fd: int, start: int, keys: list[str], payloads: list[memoryview]
    ) -> list[seg.RecordHeader]:
        """Write the records from `start`, each at an offset known before any is checksummed.

        A batch of a MiB or more is split over the I/O threads, each checksumming and writing its
        own records (the checksum and the copy into the page cache release the GIL); within a
        part, the checksums of a chunk of about a MiB are computed right before its pwritev,
        which then copies bytes still in the CPU cache.
        """
        ndim, padded = len(self._shape), seg.round_up(self.layout.num_bytes)
        sizes = [seg.header_region_bytes(key, self._dtype_name, ndim) + padded for key in keys]
        offsets = list(itertools.accumulate(sizes, initial=start))

        def write_part(indices: list[int]) -> list[seg.RecordHeader]:
            headers = []
            for first in range(0, len(indices), self._chunk_records):
                chunk, views = indices[first : first + self._chunk_records], []
                for i in chunk:
                    digest = seg.checksum(seg.CHECKSUM_KIND, payloads[i])
                    header = seg.encode_header(keys[i], self._dtype_name, self._shape, payloads[i].nbytes, digest)
                    headers.append(header)
                    views += [memoryview(headers[-1].data), payloads[i], self._pad]
                seg.write_at(fd, views, offsets[chunk[0]])
            return headers

        headers = self._spread(write_part, list(range(len(keys))))
        assert all(h.record_num_bytes == n for h, n in zip(headers, sizes)), "header size mispredicted"
        return headers

    def _commit(self, keys: list[str], entries: list[Entry]) -> tuple[list[Entry], list[tuple[str, Entry]]]:
        """Index appended records; evict LRU blocks over capacity. Caller holds both locks.

        Returns (records superseded, (key, record) evicted); the caller drops them after reading
        the evicted ones, which is why they still count as live in their segment until then.
        """
        dropped = []
        for key, entry in zip(keys, entries):
            old = self._index.pop(key, None)
            if old is not None:
                dropped.append(old)
            self._index[key] = entry
            self._num_live[entry.segment_id] += 1
        victims = []
        while len(self._index) > self.max_blocks:
            victims.append(self._index.popitem(last=False))
        self.counters.add(evictions=len(victims))
        return dropped, victims

    def _active_segment(self) -> tuple[int, int]:
        """(fd, size) of the segment that takes appends, begun anew past segment_bytes or when its
        file was deleted or replaced. Caller holds _append_lock."""
        self._roll_over_if_lost()
        if self._active_fd is not None and self._active_size < self.segment_bytes:
            self._active_size = os.lseek(self._active_fd, 0, os.SEEK_END)  # where the next records go
            return self._active_fd, self._active_size
        if self._active_fd is not None:
            os.close(self._active_fd)
            self._active_fd = None
            with self._lock:
                old, self._active_id = self._active_id, None
                is_dead = self._num_live.get(old) == 0
                if is_dead:
                    del self._num_live[old]
            if is_dead:
                self._unlink(self._segment_path(old))
        if files.directory_identity(str(self.path)) != self._directory_identity:  # deleted (a tmp cleaner) or swapped
            logger.warning("%s: directory %s was deleted or replaced; making or checking it again", self.name, self.path)
            self._open_directory()
        while self._active_fd is None:  # another tier on this path may have taken the id: try the next
            segment_id, self._next_segment_id = self._next_segment_id, self._next_segment_id + 1
            try:
                self._active_fd = files.create_segment(self._segment_path(segment_id))
            except FileExistsError:
                continue
        self._active_size = 0
        with self._lock:
            self._active_id = segment_id
            self._num_live[segment_id] = 0
            self._identities[segment_id] = files.file_identity(self._active_fd)
        if self.fsync:
            _sync_directory(str(self.path))
        return self._active_fd, 0

    def _roll_over_if_lost(self) -> bool:
        """Whether the active segment's file was deleted or replaced; if so, forget it and its blocks
        (the next append begins a new segment). Caller holds _append_lock."""
        if self._active_fd is None:
            return False
        path = self._segment_path(self._active_id)
        try:
            is_unlinked = os.fstat(self._active_fd).st_nlink == 0
            at_path = files.path_identity(path)
        except OSError as exc:
            self._io_error("stat", path, exc)
            return False
        if at_path is not None and at_path != self._identities.get(self._active_id):
            self._forget_segment(self._active_id, "segment_replaced")
        elif is_unlinked or at_path is None:
            self._forget_segment(self._active_id, "segment_deleted")
        else:
            return False
        return True

    def _forget_segment(self, segment_id: int, reason: str) -> None:
        """Drop every index entry into a segment whose file is lost, counted as lost_blocks for
        `reason`; close it if it takes appends. Caller holds _append_lock. The file at its path
        (another's) is left alone."""
        with self._lock:
            if segment_id not in self._num_live:
                return  # forgotten already
            lost = [key for key, entry in self._index.items() if entry.segment_id == segment_id]
            for key in lost:
                del self._index[key]
            del self._num_live[segment_id]
            self._identities.pop(segment_id, None)
            if self._active_id == segment_id:
                os.close(self._active_fd)
                self._active_id, self._active_fd = None, None
        logger.warning("%s: segment %s was %s while in use: %d blocks lost", self.name,
                       self._segment_path(segment_id), reason.split("_")[1], len(lost))  # fmt: skip
        self.counters.add_for_reason("lost_blocks", reason, len(lost))

    def _cut_back(self, size: int | None) -> None:
        """Remove what a failed append left after `size`; if that fails too, begin a new segment next time."""
        if self._active_fd is None or size is None:
            return
        try:
            os.ftruncate(self._active_fd, size)
        except OSError as exc:
            self._io_error("truncate", self._segment_path(self._active_id), exc)
            self._active_size = self.segment_bytes  # what follows `size` is garbage: the next scan drops it

    def _put_failed(self, key: str, exc: OSError | TierError) -> PutResult:
        if isinstance(exc, OSError):
            code = errno.errorcode.get(exc.errno or 0, "OSError")
            error = f"{self.name}: put {key} under {self.path} failed: {code}: {exc.strerror or exc}"
        else:
            error = f"{self.name}: put {key} failed: {exc}"
        logger.warning("%s", error)
        self.counters.add(put_failures=1, errors=1)
        return PutResult(False, error)

    # -- reading ---------------------------------------------------------------------------
    def _read_blocks(self, keys: list[str], entries: list[Entry]) -> tuple[list[torch.Tensor], list[str | None]]:
        """Read and check these records (disk_reads); per block a [*layout.shape] row and None or why it failed.

        A block that fails its checks and is still the indexed one is counted and dropped.
        """
        rows, failures = self._reader.read(keys, entries)
        self._forget_failed(keys, entries, failures)
        return rows, failures

    def _forget_failed(self, keys: list[str], entries: list[Entry], failures: list[str | None]) -> None:
        """Drop failed blocks that are still the indexed ones: corrupt (counted) or deleted behind our back."""
        dropped, lost = [], {}
        with self._lock:
            for key, entry, failure in zip(keys, entries, failures):
                if failure is None or self._index.get(key) is not entry:
                    continue  # fine, or replaced or removed while we read: a plain miss
                if failure in (SEGMENT_GONE, SEGMENT_REPLACED):
                    lost[entry.segment_id] = "segment_deleted" if failure == SEGMENT_GONE else "segment_replaced"
                    continue
                if failure.startswith(("open failed", "read failed")):
                    self._io_error("read", self._segment_path(entry.segment_id), OSError(failure))
                    continue
                logger.warning("%s: dropping block %s (segment %x): %s", self.name, key, entry.segment_id, failure)
                self.counters.add(corrupt_blocks=1)
                dropped.append(self._index.pop(key))
        self._drop_records(dropped)
        if lost:
            with self._append_lock:
                for segment_id, reason in lost.items():
                    self._forget_segment(segment_id, reason)

    # -- dropping records ------------------------------------------------------------------
    def _drop_records(self, entries: list[Entry]) -> None:
        """Punch out records that left the index; delete segments left with no live record."""
        if not entries:
            return
        with self._append_lock, self._lock:  # an emptied active segment is retired too: unlinked, not punched
            entries = [e for e in entries if e.segment_id in self._num_live]  # not of a segment lost meanwhile
            for entry in entries:
                self._num_live[entry.segment_id] -= 1
            dead = {e.segment_id for e in entries if self._num_live[e.segment_id] == 0}
            if self._active_id in dead:
                os.close(self._active_fd)
                self._active_id, self._active_fd = None, None
            for segment_id in dead:
                del self._num_live[segment_id]
                self._identities.pop(segment_id, None)
        for segment_id in dead:
            self._unlink(self._segment_path(segment_id))
        by_segment = itertools.groupby(sorted((e for e in entries if e.segment_id not in dead), key=_position),
                                       key=lambda e: e.segment_id)  # fmt: skip
        for segment_id, group in by_segment:
            self._punch_all(segment_id, list(group))

    def _punch_all(self, segment_id: int, entries: list[Entry]) -> None:
        path = self._segment_path(segment_id)
        try:
            fd = self._open_segment(segment_id, os.O_WRONLY)
        except (FileNotFoundError, files.SegmentReplaced):
            return  # a read will find the segment lost
        except OSError as exc:
            return self._io_error("open", path, exc)
        try:
            for entry in entries:
                try:
                    seg.punch(fd, entry.offset, entry.record_num_bytes)
                except OSError as exc:
                    if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS):
                        raise
                    os.pwrite(fd, bytes(entry.header_num_bytes), entry.offset)  # no scan will find it
        except OSError as exc:
            self._io_error("punch", path, exc)
        finally:
            os.close(fd)

    # -- start-up --------------------------------------------------------------------------
    def _open_directory(self) -> None:
        """Create or check the directory (disk_files: 0700, this user's) and that files can be made in it."""
        try:
            self._directory_identity = files.open_private_directory(str(self.path))
        except TierError as exc:
            raise type(exc)(f"{self.name}: {exc}") from exc.__cause__
        try:
            fd, probe = tempfile.mkstemp(prefix="probe.", suffix=".tmp", dir=self.path)  # O_EXCL | O_NOFOLLOW
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise TierError(f"{self.name}: cannot store blocks under {str(self.path)!r}: {exc}") from exc

    def _open_segment(self, segment_id: int, flags: int) -> int:
        """The segment's file opened with `flags`, never through a symlink; FileNotFoundError when
        it is gone, files.SegmentReplaced when another file took its name."""
        with self._lock:
            identity = self._identities.get(segment_id)
        return files.open_checked_segment(self._segment_path(segment_id), flags, identity)

    def _rebuild_index(self) -> None:
        """Index the records in the segments, oldest first; drop torn tails, superseded and foreign records."""
        dropped: list[Entry] = []
        try:
            disk_scan.remove_old_format(self.path, _ORDER_FILE)
            ids = sorted(int(p.stem, 16) for p in self.path.glob(f"*{_SEGMENT_SUFFIX}") if disk_scan.is_segment_stem(p.stem))
            for segment_id in ids:
                dropped += self._scan_into_index(segment_id)
        except (OSError, ValueError) as exc:
            raise TierError(f"{self.name}: cannot scan {str(self.path)!r}: {exc}") from exc
        self._next_segment_id = ids[-1] + 1 if ids else 0
        order_path = os.path.join(self.path, _ORDER_FILE)
        for key in reversed(seg.load_order(order_path)):  # the last clean close's order; newer records stay newest
            if key in self._index:
                self._index.move_to_end(key, last=False)
        disk_scan.unlink_quietly(order_path)
        while len(self._index) > self.max_blocks:  # capacity shrank since the last run
            dropped.append(self._index.popitem(last=False)[1])
            self.counters.add(evictions=1)
        self._drop_records(dropped)
        for segment_id in [s for s, n in self._num_live.items() if n == 0]:
            del self._num_live[segment_id]
            self._unlink(self._segment_path(segment_id))

    def _scan_into_index(self, segment_id: int) -> list[Entry]:
        """Index a segment's whole records (disk_scan counts and logs what it drops); returns those
        superseded or of another layout, to punch, counted as scan_dropped_records too."""
        path = self._segment_path(segment_id)
        found = disk_scan.scan_segment_file(path, self.name, self.counters)
        if found is None:
            return []
        self._identities[segment_id] = found.identity
        # records this process cannot verify count as one live record: the segment is never deleted here
        self._num_live[segment_id] = len(found.records) + int(found.is_partly_unreadable)
        dropped = []
        for offset, h in found.records:
            entry = Entry(segment_id, offset, h)
            is_ours = h.dtype_name == self._dtype_name and h.shape == self._shape
            old = self._index.pop(h.key, None) if is_ours else entry
            if old is not None:
                reason = "superseded" if is_ours else "other_layout"
                logger.debug("%s: %s: dropping a record of %s (%s)", self.name, path, h.key, reason)
                self.counters.add_for_reason("scan_dropped_records", reason)
                dropped.append(old)
            if is_ours:
                self._index[h.key] = entry
        return dropped

    # -- helpers ---------------------------------------------------------------------------
    def _segment_path(self, segment_id: int) -> str:
        return os.path.join(self.path, f"{segment_id:016x}{_SEGMENT_SUFFIX}")

    def _spread(self, fn: Callable[[list], list], xs: list) -> list:
        """fn over contiguous parts of xs, the parts on the I/O threads when xs is large; results concatenated.

        A part that raises is re-raised once every part has finished."""
        num_parts = min(self._num_io_threads, len(xs), len(xs) * self.layout.num_bytes // _SPREAD_MIN_BYTES)
        if num_parts < 2:
            return fn(xs)
        bounds = [len(xs) * part // num_parts for part in range(num_parts + 1)]
        parts = [xs[a:b] for a, b in zip(bounds, bounds[1:])]
        futures = [self._io_pool().submit(fn, part) for part in parts[1:]]
        try:
            first = fn(parts[0])
        finally:
            wait(futures)  # every part is done before anyone cleans up after a failure
        return first + [r for future in futures for r in future.result()]

    def _checker(self) -> ThreadPoolExecutor | None:
        """Where device reads are checked while the next piece is read; None: on the reading thread."""
        return self._io_pool() if self._num_io_threads > 1 else None

    def _io_pool(self) -> ThreadPoolExecutor:
        with self._lock:
            self._check_open()
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._num_io_threads - 1, thread_name_prefix=f"tierkv-{self.name}")
            return self._pool

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

    def _check_open(self) -> None:
        if self._closed:
            raise TierError(f"{self.name}: tier is closed")


def _num_usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _bytes_of(block: torch.Tensor) -> memoryview:
    """The block's bytes (a copy only when it is not a contiguous CPU tensor); the view keeps the tensor alive."""
    if block.device.type != "cpu" or not block.is_contiguous():
        block = block.detach().cpu().contiguous()
    array = (ctypes.c_char * (block.numel() * block.element_size())).from_address(block.data_ptr())
    array.tensor = block
    return memoryview(array).cast("B")


def _position(entry: Entry) -> tuple[int, int]:
    return entry.segment_id, entry.offset


def _sync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
