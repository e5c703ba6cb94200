"""Local-disk tier: blocks appended to segment files, indexed in memory (NVMe in production).

Primitives: `DiskTier`.

    <path>/<16 hex digits>.seg   a segment: records appended in order (format: disk_segments, system calls: disk_io)
    <path>/lru.order             the LRU order at the last close; a hint for the next start

DiskTier owns the StorageTier contract, the LRU policy (what to evict, what a put may skip) and
what a failed read means; the rest lives beside it, each in its own module:

    disk_index          DiskIndex: key -> record, LRU order, live records per segment; the start-up
                        scan (disk_scan) and lru.order
    disk_segment_files  SegmentFiles: the directory, appends to the active segment, punched holes,
                        deleted or replaced segments found and forgotten
    disk_reads          BatchReader: a batch of records into one read buffer (disk_read_batch), checked
    disk_threads        IOThreads: large batches spread over a few threads
    disk_files          the private directory and files (0700/0600, O_EXCL, O_NOFOLLOW)

A put of bytes the tier holds under that key (same checksum, the usual case for content-addressed
keys) writes nothing and only refreshes the block's LRU position. A block that fails its checks
when read is a miss, counted (corrupt_blocks) and dropped. Capacity, used_bytes and the byte
counters count block bytes (layout.num_bytes each); a record on disk also holds its 4 KiB header
region and padding to 4 KiB. Two live tiers on one path (tensor-parallel ranks, two processes)
each append to segments of their own, see the other's blocks only as found at start, and never
serve wrong bytes (reads check key and checksum); neither destroys the other's blocks
(`disk_peers`: start-up repairs wait for a start with no other live tier, and a tier punches and
deletes only in its own segments while another lives; a record its writer evicted is counted as
lost_blocks{removed_by_peer}, not corrupt).
"""
from __future__ import annotations

import ctypes
import logging
import os
import threading
from pathlib import Path
from typing import Callable, Sequence

import torch

from tierkv.blocks import BlockLayout
from tierkv.storage import disk_segments as seg
from tierkv.storage.base import PutResult, StorageTier, TierError
from tierkv.storage.disk_buffers import ReadBufferPool
from tierkv.storage.disk_index import ORDER_FILE, DiskIndex, Entry, save_order
from tierkv.storage.disk_io import ReadModes
from tierkv.storage.disk_read_batch import SEGMENT_GONE, SEGMENT_REPLACED
from tierkv.storage.disk_reads import BatchReader
from tierkv.storage.disk_segment_files import SegmentFiles
from tierkv.storage.disk_threads import IOThreads
from tierkv.storage.disk_writes import DiskWrites
from tierkv.storage.log_limit import LimitedWarning

logger = logging.getLogger(__name__)

_READ_BUFFER_BYTES = 64 << 20  # freed get_many results kept for the next reads


class DiskTier(DiskWrites, StorageTier):
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
            raise ValueError(f"{name}: capacity_bytes={capacity_bytes!r}; must be at least one block ({layout.num_bytes})")
        if num_io_threads is not None and num_io_threads < 1:
            raise ValueError(f"{name}: num_io_threads={num_io_threads!r}; must be >= 1 or None")
        if segment_bytes is not None and segment_bytes < 1:
            raise ValueError(f"{name}: segment_bytes={segment_bytes!r}; must be >= 1 or None")
        super().__init__(name, layout, capacity_bytes)
        # a failing directory or a run of corrupt records repeats per block: one line per 10 s with the count
        self._error_log, self._drop_log = LimitedWarning(logger), LimitedWarning(logger)
        self.path = Path(path).expanduser()
        self.return_evicted = return_evicted
        self.fsync = fsync
        self.max_blocks = capacity_bytes // layout.num_bytes
        self.segment_bytes = segment_bytes or min(1 << 30, max(1 << 20, capacity_bytes // 8))
        self._threads = IOThreads(name, num_io_threads)
        self._index = DiskIndex(name, layout, self.counters)  # guarded by self._lock
        # segments a corrupt record was found in (guarded by self._lock): a block put again whose record lies in
        # one is written afresh, not taken as held (its record may be damaged too, unread so far)
        self._suspect_segments: set[int] = set()
        self._files = SegmentFiles(
            name, self.path, layout, self.counters, index=self._index, index_lock=self._lock,
            segment_bytes=self.segment_bytes, fsync=fsync, spread=self._spread,
        )  # fmt: skip
        self._modes = ReadModes()
        self._buffers = ReadBufferPool(read_buffer_bytes)
        self._reader = BatchReader(
            layout, self._files.open_segment, self._buffers, self._modes, self._spread, self._threads.checker
        )
        self._room_lock = threading.Lock()  # one put at a time makes room on a full file system (_append)
        self._closed = False
        self._load_index()

    # -- StorageTier ---------------------------------------------------------------------
    def contains(self, key: str) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """Whether the tier holds each key; a record in a segment found corrupt counts as not held (it may be
        damaged too, unread so far), and so does one whose segment file was deleted or replaced (a tmp cleaner):
        the segment is forgotten (its blocks counted lost), so a chain writes the blocks again, afresh, instead
        of skipping a spill on the word of an index entry (each segment's file is checked once per call)."""
        with self._lock:
            entries = [self._index.get(key) for key in keys]
        segments = {e.segment_id for e in entries if e is not None}
        lost = self._files.forget_lost_segments(segments) if segments else set()
        with self._lock:
            bad = lost | self._suspect_segments
        return [e is not None and e.segment_id not in bad for e in entries]

    def get(self, key: str) -> torch.Tensor | None:
        return self.get_many([key])[0]

    def put(self, key: str, block: torch.Tensor) -> PutResult:
        return self.put_many([key], [block])[0]

    def remove(self, key: str) -> bool:
        return self.remove_many([key])[0]

    def remove_many(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            entries = [self._index.pop(key) for key in keys]
        removed = [e for e in entries if e is not None]
        self._files.drop_records(removed)
        self.counters.add(removes=len(removed))
        return [e is not None for e in entries]

    def get_many(self, keys: Sequence[str]) -> list[torch.Tensor | None]:
        """Hits are [*layout.shape] views of one fresh read buffer the caller owns; None for a miss."""
        self._check_open()
        with self.counters.timed("get"):
            with self._lock:
                found = [(i, self._index[key]) for i, key in enumerate(keys) if key in self._index]
                for i, _ in found:
                    self._index.touch(keys[i])
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
                    if held[i].segment_id in self._suspect_segments:
                        continue  # written afresh below: the held record may be damaged
                    if self._index.get(keys[i]) is held[i]:  # held already: refresh only
                        self._index.touch(keys[i])
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
            was_closed, self._closed = self._closed, True
        if was_closed:
            return
        self._threads.shutdown()
        self._buffers.clear()
        with self._files.lock, self._lock:
            self._files.close()
            order = self._index.keys()
        self._files.peers.close()
        try:
            save_order(os.path.join(self.path, ORDER_FILE), order)
        except OSError as exc:
            self._io_error("save order", str(self.path), exc)

    @property
    def held_capacity_bytes(self) -> int:
        """capacity_bytes, or what a full file system lowered it to (`_make_room`; until the tier is made again)."""
        return self.max_blocks * self.layout.num_bytes

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return len(self._index) * self.layout.num_bytes

    # -- reading ---------------------------------------------------------------------------
    def _read_blocks(self, keys: list[str], entries: list[Entry]) -> tuple[list[torch.Tensor], list[str | None]]:
        """Read and check these records (disk_reads); per block a [*layout.shape] row and None or why it failed.

        A block that fails its checks and is still the indexed one is counted and dropped.
        """
        rows, failures = self._reader.read(keys, entries)
        self._forget_failed(keys, entries, failures)
        return rows, failures

    def _forget_failed(self, keys: list[str], entries: list[Entry], failures: list[str | None]) -> None:
        """Drop failed blocks that are still the indexed ones: corrupt (counted, their segment suspected) or
        deleted behind our back."""
        dropped, lost, suspect = [], {}, []
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
                dropped.append(self._index.pop(key))
                if failure.startswith(seg.ZEROED_HEADER) and self._files.is_peers_segment(entry.segment_id):
                    # punched out by the live tier that wrote it (its eviction): gone, not damaged
                    self.counters.add_for_reason("lost_blocks", "removed_by_peer")
                    continue
                self._drop_log.note("%s: dropping corrupt block(s); latest %s (segment %x): %s", self.name, key,
                                    entry.segment_id, failure)
                self.counters.add(corrupt_blocks=1)
                if entry.segment_id not in self._suspect_segments:
                    self._suspect_segments.add(entry.segment_id)
                    suspect.append(entry.segment_id)
        self._files.drop_records(dropped)
        if suspect:
            self._files.retire_if_active(suspect)  # records written from now on go to a segment not suspected
        if lost:
            with self._files.lock:
                for segment_id, reason in lost.items():
                    self._files.forget_segment(segment_id, reason)

    # -- start-up --------------------------------------------------------------------------
    def _load_index(self) -> None:
        """Index the segments found (disk_index), drop what they hold beyond capacity, delete empty ones.
        With another live tier on the directory the files are left as they are (its active segment may
        look torn, its records superseded): what this tier drops it only forgets."""
        repair = not self._files.peers.others_live()
        self._files.next_segment_id, dropped = self._index.load(self.path, repair=repair)
        with self._lock:
            over = self._index.evict_over(self.max_blocks)  # capacity shrank since the last run
        self.counters.add(evictions=len(over))
        self._files.drop_records(dropped + [entry for _, entry in over], change_files=repair)
        if repair:
            self._files.delete_empty()

    # -- helpers ---------------------------------------------------------------------------
    def _segment_path(self, segment_id: int) -> str:
        return self._files.segment_path(segment_id)

    def _spread(self, fn: Callable[[list], list], xs: list) -> list:
        """fn over contiguous parts of xs (blocks), the parts on the I/O threads when xs is large."""
        return self._threads.spread(fn, xs, self.layout.num_bytes)

    def _io_error(self, op: str, path: str, exc: OSError) -> None:
        self._error_log.note("%s: I/O failed (counted in errors); latest: %s %s: %s", self.name, op, path, exc)
        self.counters.add(errors=1)

    def _check_open(self) -> None:
        if self._closed:
            raise TierError(f"{self.name}: tier is closed")


def _bytes_of(block: torch.Tensor) -> memoryview:
    """The block's bytes (a copy only when it is not a contiguous CPU tensor); the view keeps the tensor alive."""
    if block.device.type != "cpu" or not block.is_contiguous():
        block = block.detach().cpu().contiguous()
    array = (ctypes.c_char * (block.numel() * block.element_size())).from_address(block.data_ptr())
    array.tensor = block
    return memoryview(array).cast("B")
