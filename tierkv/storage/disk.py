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

Reads. get_many sorts its hits by segment and offset and reads each run of adjacent records
with one preadv, payloads straight into rows of the result: from the page cache where it holds
them (RWF_NOWAIT), else from the device with O_DIRECT (payloads of a multiple of 4096 bytes).
Each block's header and payload checksums are checked (XXH3-64; CRC-32 in records of format
version 1); a block that fails is a miss, counted, dropped. Batches of a MiB or more are split
over num_io_threads threads (I/O and checksums release the GIL). Results land in pre-faulted,
recycled slabs (disk_buffers), and a range is probed with cachestat before RWF_NOWAIT so a
page cache miss starts no readahead that would race the O_DIRECT read.

Remove and evict punch a hole over the record (fallocate PUNCH_HOLE): the space is free at once
and no later scan finds it; a segment with no live record left is deleted. Where the
filesystem cannot punch holes the header is zeroed instead, and the space returns when the
whole segment dies. A put of bytes the tier holds under that key (same checksum, the usual case
for content-addressed keys) writes nothing and only refreshes the block's LRU position.

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
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Callable, Sequence

import torch

from tierkv.blocks import dtype_name
from tierkv.blocks import BlockLayout
from tierkv.storage import disk_segments as seg
from tierkv.storage.base import PutResult, StorageTier, TierError
from tierkv.storage.codec import CorruptBlock
from tierkv.storage.disk_buffers import ReadBufferPool

logger = logging.getLogger(__name__)

_SEGMENT_SUFFIX = ".seg"
_ORDER_FILE = "lru.order"
_SPREAD_MIN_BYTES = 1 << 20  # smaller read batches stay on the caller's thread
_CHUNK_BYTES = 1 << 20  # read then checksummed (or checksummed, then written) at a time: stays in the CPU cache
_MAX_IO_THREADS = 4
_READ_BUFFER_BYTES = 64 << 20  # freed get_many results kept for the next reads
_OLD_FORMAT_SUFFIXES = (".blk", ".tierkv-tmp")  # the one-file-per-block format, removed on start


class _Entry:
    """Where a block's record lives."""

    __slots__ = (
        "segment_id", "offset", "header_num_bytes", "record_num_bytes", "checksum_kind", "payload_checksum",
        "header_end", "header_checksum",
    )  # fmt: skip

    def __init__(self, segment_id: int, offset: int, h: seg.RecordHeader):
        self.segment_id, self.offset = segment_id, offset
        self.header_num_bytes, self.record_num_bytes = h.header_num_bytes, h.record_num_bytes
        self.checksum_kind, self.payload_checksum = h.checksum_kind, h.payload_checksum
        self.header_end, self.header_checksum = h.header_end, h.header_checksum  # the header's own ends at header_end


class DiskTier(StorageTier):
    """Blocks in segment files under `path`, at most capacity_bytes // layout.num_bytes of them, LRU.

    return_evicted: PutResult.evicted carries (key, block) for blocks pushed out, read back
        from disk so a chain can spill them; False drops them unread, right when no tier sits
        below this one. A plain attribute the chain may set.
    fsync: sync each put_many's records to the device before it returns.
    num_io_threads: large get_many batches are split over this many threads; None: one per CPU
        this process may run on, at most 4 (more threads than cores only add GIL hand-offs).
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
        self.path = Path(path)
        self.return_evicted = return_evicted
        self.fsync = fsync
        self.max_blocks = capacity_bytes // layout.num_bytes
        self.segment_bytes = segment_bytes or min(1 << 30, max(1 << 20, capacity_bytes // 8))
        self._num_io_threads = num_io_threads or min(_MAX_IO_THREADS, _num_usable_cpus())
        self._dtype_name, self._shape = dtype_name(layout.dtype), tuple(layout.shape)
        self._is_direct_eligible = layout.num_bytes % seg.ALIGN == 0  # payload rows stay 4096-aligned
        self._pad = memoryview(bytearray(seg.round_up(layout.num_bytes) - layout.num_bytes))
        self._chunk_records = max(1, _CHUNK_BYTES // (seg.ALIGN + seg.round_up(layout.num_bytes)))
        self._index: OrderedDict[str, _Entry] = OrderedDict()  # oldest first
        self._num_live: dict[int, int] = {}  # segment id -> records not yet dropped
        self._append_lock = threading.Lock()  # the active segment: its fd, size and rollover
        self._active_id: int | None = None
        self._active_fd: int | None = None
        self._active_size = 0
        self._next_segment_id = 0
        self._modes = seg.ReadModes()
        self._buffers = ReadBufferPool(read_buffer_bytes)
        self._pool: ThreadPoolExecutor | None = None
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
        """Hits are rows of one fresh [num_hits, *layout.shape] tensor the caller owns; None for a miss."""
        self._check_open()
        with self.counters.timed("get"):
            with self._lock:
                found = [(i, self._index[key]) for i, key in enumerate(keys) if key in self._index]
                for i, _ in found:
                    self._index.move_to_end(keys[i])
            batch, failures = self._read_blocks([keys[i] for i, _ in found], [e for _, e in found])
            blocks: list[torch.Tensor | None] = [None] * len(keys)
            for (i, _), row, failure in zip(found, batch.unbind(0), failures):
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
            start = None
            try:
                fd, start = self._active_segment()
                headers = self._write_records(fd, start, keys, payloads)
                if self.fsync:
                    os.fdatasync(fd)
            except OSError as exc:
                self._cut_back(start)
                return [self._put_failed(key, exc) for key in keys]
            entries, offset = [], start
            for header in headers:
                entries.append(_Entry(self._active_id, offset, header))
                offset += header.record_num_bytes
            self._active_size = offset
            with self._lock:
                dropped, victims = self._commit(keys, entries)
        self.counters.add(bytes_written=len(keys) * self.layout.num_bytes)
        evicted = []
        if victims and self.return_evicted:
            victim_keys = [key for key, _ in victims]
            batch, failures = self._read_blocks(victim_keys, [e for _, e in victims])
            rows = zip(victim_keys, batch.unbind(0), failures)
            evicted = [(key, row) for key, row, failure in rows if failure is None]
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

    def _commit(self, keys: list[str], entries: list[_Entry]) -> tuple[list[_Entry], list[tuple[str, _Entry]]]:
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
        """(fd, size) of the segment that takes appends, begun anew past segment_bytes. Caller holds _append_lock."""
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
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        while self._active_fd is None:  # another tier on this path may have taken the id: try the next
            segment_id, self._next_segment_id = self._next_segment_id, self._next_segment_id + 1
            try:
                self._active_fd = os.open(self._segment_path(segment_id), flags, 0o644)
            except FileExistsError:
                continue
        self._active_size = 0
        with self._lock:
            self._active_id = segment_id
            self._num_live[segment_id] = 0
        if self.fsync:
            _sync_directory(str(self.path))
        return self._active_fd, 0

    def _cut_back(self, size: int | None) -> None:
        """Remove what a failed append left after `size`; if that fails too, begin a new segment next time."""
        if self._active_fd is None or size is None:
            return
        try:
            os.ftruncate(self._active_fd, size)
        except OSError as exc:
            self._io_error("truncate", self._segment_path(self._active_id), exc)
            self._active_size = self.segment_bytes  # what follows `size` is garbage: the next scan drops it

    def _put_failed(self, key: str, exc: OSError) -> PutResult:
        code = errno.errorcode.get(exc.errno or 0, "OSError")
        error = f"{self.name}: put {key} under {self.path} failed: {code}: {exc.strerror or exc}"
        logger.warning("%s", error)
        self.counters.add(put_failures=1, errors=1)
        return PutResult(False, error)

    # -- reading ---------------------------------------------------------------------------
    def _read_blocks(self, keys: list[str], entries: list[_Entry]) -> tuple[torch.Tensor, list[str | None]]:
        """Read and verify records into a fresh [len(keys), *layout.shape] tensor; per block None or why it failed.

        A block that fails its checks and is still the indexed one is counted and dropped.
        """
        num_bytes = self.layout.num_bytes
        if not keys:
            return torch.empty((0, *self._shape), dtype=self.layout.dtype), []
        payloads_end = seg.round_up(len(keys) * num_bytes)  # slab: | payload rows | header regions |
        header_offsets = list(itertools.accumulate((e.header_num_bytes for e in entries), initial=payloads_end))
        slab = self._buffers.empty(header_offsets[-1])
        batch = slab[: len(keys) * num_bytes].view(self.layout.dtype).view(len(keys), *self._shape)
        headers = payloads = memoryview(slab.numpy())
        jobs = [  # (segment, offset, index, header view, payload view, where the record ends)
            (e.segment_id, e.offset, j, headers[header_offsets[j] : header_offsets[j + 1]],
             payloads[j * num_bytes : (j + 1) * num_bytes], e.offset + e.record_num_bytes)
            for j, e in enumerate(entries)
        ]  # fmt: skip
        jobs.sort(key=_position_of_job)
        failures: list[str | None] = [None] * len(keys)
        for j, failure in self._spread(lambda part: self._read_part(part, keys, entries), jobs):
            failures[j] = failure
        self._forget_failed(keys, entries, failures)
        return batch, failures

    def _read_part(self, jobs: list[tuple], keys: list[str], entries: list[_Entry]) -> list[tuple[int, str | None]]:
        """Read and check one part of a batch, sorted by (segment, offset); per block (index, failure or None)."""
        results = []
        for segment_id, group in itertools.groupby(jobs, key=lambda job: job[0]):
            group = list(group)
            path = self._segment_path(segment_id)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as exc:
                reason = "gone" if exc.errno == errno.ENOENT else f"open failed: {exc}"
                results += [(job[2], reason) for job in group]
                continue
            direct_fds: list[int] = []
            try:
                for run in _runs(group):
                    results += self._read_run(fd, path, direct_fds, run, keys, entries)
            finally:
                for f in [fd, *direct_fds]:
                    os.close(f)
        return results

    def _read_run(self, fd: int, path: str, direct_fds: list[int], run: list[tuple], keys: list[str],
                  entries: list[_Entry]) -> list[tuple[int, str | None]]:  # fmt: skip
        """Adjacent records: from the page cache a chunk of about a MiB at a time, each block checked
        while its bytes are still in the CPU cache; once a chunk is not cached (or cachestat says
        the run is not all cached), the rest of the run comes from the device in one preadv
        (O_DIRECT where the layout allows)."""
        results, pos = [], 0
        run_bytes = run[-1][5] - run[0][1]
        num_cached = seg.cached_bytes(fd, run[0][1], run_bytes, self._modes)
        is_cached = num_cached is None or num_cached == run_bytes  # None: unknown, RWF_NOWAIT tells
        while pos < len(run):
            chunk = run[pos : pos + self._chunk_records]
            try:
                num_read = seg.read_cached(fd, self._views(chunk), chunk[0][1], self._modes) if is_cached else 0
                if num_read < chunk[-1][5] - chunk[0][1]:
                    direct_fd = _open_direct(path, direct_fds, self._modes) if self._is_direct_eligible else None
                    if direct_fd is not None:
                        chunk = run[pos:]
                    num_read = seg.read_at(fd, self._views(chunk), chunk[0][1], self._modes, direct_fd)
            except OSError as exc:
                return results + [(job[2], f"read failed: {exc}") for job in run[pos:]]
            end = chunk[0][1] + num_read
            for _, _, j, header, payload, record_end in chunk:
                failure = self._check(keys[j], entries[j], header, payload) if record_end <= end else "short read"
                results.append((j, failure))
            pos += len(chunk)
        return results

    def _views(self, jobs: list[tuple]) -> list[memoryview]:
        """The buffers a preadv of these adjacent records fills: header region, payload, padding each."""
        if self._pad.nbytes:
            return [v for job in jobs for v in (job[3], job[4], self._pad)]
        return [v for job in jobs for v in (job[3], job[4])]

    def _check(self, key: str, entry: _Entry, header: memoryview, payload: memoryview) -> str | None:
        """None when the record read is this block, intact; else what is wrong.

        Fast path: the header is byte for byte the one indexed when its own checksum is the one
        remembered and matches its bytes; then only the payload's checksum is left to check.
        """
        kind, end = entry.checksum_kind, entry.header_end
        digest, body_end = seg.CHECKSUM_FUNCTIONS[kind], end - seg.CHECKSUM_BYTES[kind]
        if digest(header[:body_end]) == entry.header_checksum == int.from_bytes(header[body_end:end], "little"):
            return None if digest(payload) == entry.payload_checksum else "payload checksum mismatch"
        try:
            h = seg.parse_header(header)
        except CorruptBlock as exc:
            return str(exc)
        if (h.key != key or h.payload_checksum != entry.payload_checksum or h.checksum_kind != kind
                or h.header_num_bytes != entry.header_num_bytes):  # fmt: skip
            return f"the record at offset {entry.offset} is not this block (key {h.key[:80]!r})"
        if h.dtype_name != self._dtype_name or h.shape != self._shape or h.payload_num_bytes != payload.nbytes:
            return f"stored as {h.shape} {h.dtype_name}, not this tier's layout"
        if seg.checksum(kind, payload) != h.payload_checksum:
            return "payload checksum mismatch"
        return None

    def _forget_failed(self, keys: list[str], entries: list[_Entry], failures: list[str | None]) -> None:
        """Drop failed blocks that are still the indexed ones: corrupt (counted) or deleted behind our back."""
        dropped = []
        with self._lock:
            for key, entry, failure in zip(keys, entries, failures):
                if failure is None or self._index.get(key) is not entry:
                    continue  # fine, or replaced or removed while we read: a plain miss
                if failure.startswith(("open failed", "read failed")):
                    self._io_error("read", self._segment_path(entry.segment_id), OSError(failure))
                    continue
                logger.warning("%s: dropping block %s (segment %x): %s", self.name, key, entry.segment_id, failure)
                self.counters.add(**({"errors": 1} if failure == "gone" else {"corrupt_blocks": 1}))
                dropped.append(self._index.pop(key))
        self._drop_records(dropped)

    # -- dropping records ------------------------------------------------------------------
    def _drop_records(self, entries: list[_Entry]) -> None:
        """Punch out records that left the index; delete segments left with no live record."""
        if not entries:
            return
        with self._append_lock, self._lock:  # an emptied active segment is retired too: unlinked, not punched
            for entry in entries:
                self._num_live[entry.segment_id] -= 1
            dead = {e.segment_id for e in entries if self._num_live[e.segment_id] == 0}
            if self._active_id in dead:
                os.close(self._active_fd)
                self._active_id, self._active_fd = None, None
            for segment_id in dead:
                del self._num_live[segment_id]
        for segment_id in dead:
            self._unlink(self._segment_path(segment_id))
        by_segment = itertools.groupby(sorted((e for e in entries if e.segment_id not in dead), key=_position),
                                       key=lambda e: e.segment_id)  # fmt: skip
        for segment_id, group in by_segment:
            self._punch_all(segment_id, list(group))

    def _punch_all(self, segment_id: int, entries: list[_Entry]) -> None:
        path = self._segment_path(segment_id)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return
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
        probe = os.path.join(self.path, f"probe.{os.getpid()}.tmp")
        try:
            os.makedirs(self.path, exist_ok=True)
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644))
            os.unlink(probe)
        except OSError as exc:
            raise TierError(f"{self.name}: cannot store blocks under {str(self.path)!r}: {exc}") from exc

    def _rebuild_index(self) -> None:
        """Index the records in the segments, oldest first; drop torn tails, superseded and foreign records."""
        dropped: list[_Entry] = []
        try:
            _remove_old_format(self.path)
            ids = sorted(int(p.stem, 16) for p in self.path.glob(f"*{_SEGMENT_SUFFIX}") if _is_segment_stem(p.stem))
            for segment_id in ids:
                dropped += self._scan_into_index(segment_id)
        except (OSError, ValueError) as exc:
            raise TierError(f"{self.name}: cannot scan {str(self.path)!r}: {exc}") from exc
        self._next_segment_id = ids[-1] + 1 if ids else 0
        order_path = os.path.join(self.path, _ORDER_FILE)
        for key in reversed(seg.load_order(order_path)):  # the last clean close's order; newer records stay newest
            if key in self._index:
                self._index.move_to_end(key, last=False)
        _unlink_quietly(order_path)
        while len(self._index) > self.max_blocks:  # capacity shrank since the last run
            dropped.append(self._index.popitem(last=False)[1])
            self.counters.add(evictions=1)
        self._drop_records(dropped)
        for segment_id in [s for s, n in self._num_live.items() if n == 0]:
            del self._num_live[segment_id]
            self._unlink(self._segment_path(segment_id))

    def _scan_into_index(self, segment_id: int) -> list[_Entry]:
        path, dropped = self._segment_path(segment_id), []
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            records, end, is_partly_unreadable = seg.scan_segment(fd, size)
            if end < size:
                logger.warning("%s: %s: dropping %d bytes after the last whole record", self.name, path, size - end)
                os.ftruncate(fd, end)
        finally:
            os.close(fd)
        # records this process cannot verify count as one live record: the segment is never deleted here
        self._num_live[segment_id] = len(records) + int(is_partly_unreadable)
        for offset, h in records:
            entry = _Entry(segment_id, offset, h)
            is_ours = h.dtype_name == self._dtype_name and h.shape == self._shape
            old = self._index.pop(h.key, None) if is_ours else entry
            if old is not None:
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


def _is_segment_stem(stem: str) -> bool:
    return len(stem) == 16 and all(c in "0123456789abcdef" for c in stem)


def _position(entry: _Entry) -> tuple[int, int]:
    return entry.segment_id, entry.offset


def _position_of_job(job: tuple) -> tuple[int, int]:
    return job[0], job[1]


def _runs(jobs: list[tuple]) -> list[list[tuple]]:
    """Split jobs (one segment, sorted by offset) into runs of adjacent records, each one preadv."""
    runs: list[list[tuple]] = []
    max_records, end = seg.IOV_MAX // 3, None
    for job in jobs:
        if job[1] == end and len(runs[-1]) < max_records:
            runs[-1].append(job)
        else:
            runs.append([job])
        end = job[5]
    return runs


def _open_direct(path: str, opened: list[int], modes: seg.ReadModes) -> int | None:
    """An O_DIRECT fd of `path`, opened once per read part (kept in `opened`); None where O_DIRECT is refused."""
    if not modes.is_direct_ok:
        return None
    if not opened:
        try:
            opened.append(os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC))
        except OSError:
            modes.is_direct_ok = False
            return None
    return opened[0]


def _sync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_old_format(root: Path) -> None:
    """Delete block files of the one-file-per-block format (in two-hex-digit subdirectories)."""
    for entry in os.scandir(root):
        if entry.is_dir(follow_symlinks=False) and len(entry.name) == 2:
            for sub in os.scandir(entry.path):
                if sub.name.endswith(_OLD_FORMAT_SUFFIXES) and sub.is_file(follow_symlinks=False):
                    _unlink_quietly(sub.path)
            try:
                os.rmdir(entry.path)
            except OSError:
                pass
        elif entry.name.endswith(_OLD_FORMAT_SUFFIXES) or entry.name.startswith((f"{_ORDER_FILE}.", "probe.")):
            _unlink_quietly(entry.path)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
