"""The disk tier's segment files: its directory, appends to the active segment, records dropped.

Primitives: `SegmentFiles`.

Appends. A batch's records go at the end of the active segment (pwritev at offsets known up
front, a large batch in parts on the I/O threads); a segment past segment_bytes is closed and a
new one begun. A crash mid-append leaves torn records only in the range being appended: at the
end of a segment, which the scan at start drops (the file is cut after the last whole record), or,
when parts were written at once, before a later part's whole records, where a torn record fails
its checksum when read (a miss, counted, dropped); a failed append (a full disk) is cut away at
once. No fsync by default: this is a cache, and a record that a power loss kept from the device
fails its checksum when read. fsync=True: one fdatasync per append, before it returns.

Drops. A removed or evicted record is punched out (fallocate PUNCH_HOLE): the space is free at
once and no later scan finds it; a segment with no live record left is deleted. Where the
filesystem cannot punch holes the header is zeroed instead, and the space returns when the whole
segment dies.

Loss. A segment deleted or replaced while the tier runs (a tmp cleaner) is forgotten with its
blocks (lost_blocks, by reason), found before each append and on reads; appends go to a new
segment, in a directory made again (and checked, disk_files) if it is gone.

Peers. Other live tiers on the directory (`disk_peers`): while one runs, this tier punches and
deletes only in segments it created, and the start-up repairs wait for a start with no other
live tier (the tier's `_load_index`).

Locks: `lock` guards the active segment; the tier's lock (index_lock) the index; `lock` is taken first.
"""
from __future__ import annotations

import errno
import itertools
import logging
import os
import tempfile
import threading
from typing import Callable

from tierkv.blocks import BlockLayout
from tierkv.metrics.counters import TierCounters
from tierkv.storage import disk_files as files
from tierkv.storage import disk_io
from tierkv.storage import disk_segments as seg
from tierkv.storage.base import TierError
from tierkv.storage.disk_index import DiskIndex, Entry, segment_path
from tierkv.storage.disk_peers import DirectoryPeers
from tierkv.storage.disk_record_layout import RecordLayout
from tierkv.storage.disk_segment_drops import SegmentDrops
from tierkv.storage.log_limit import LimitedWarning

logger = logging.getLogger("tierkv.storage.disk")  # logs as the tier, like disk_scan
_CHUNK_BYTES = 1 << 20  # checksummed, then written, at a time: stays in the CPU cache

Spread = Callable[[Callable[[list], list], list], list]  # fn over parts of a list on the I/O threads


class SegmentFiles(SegmentDrops):
    """The segment files of one tier's directory, changed only through here; the index says what they hold.

    index, index_lock: the tier's index and the lock that guards it. spread: runs a function over
    contiguous parts of a list, on the I/O threads when the list is large, results concatenated.
    Opens (and checks, disk_files) the directory; TierError when it is unsafe or unusable.
    """

    def __init__(
        self, name: str, path: os.PathLike, layout: BlockLayout, counters: TierCounters, *,
        index: DiskIndex, index_lock: threading.RLock, segment_bytes: int, fsync: bool, spread: Spread,
    ):  # fmt: skip
        self.name, self.path, self.layout, self.counters = name, path, layout, counters
        self.segment_bytes, self.fsync = segment_bytes, fsync
        self._index, self._index_lock, self._spread = index, index_lock, spread
        self._record_layout = RecordLayout(layout)  # the dtype and shape its records' headers name
        self._pad = memoryview(bytearray(seg.round_up(layout.num_bytes) - layout.num_bytes))
        self._chunk_records = max(1, _CHUNK_BYTES // (seg.ALIGN + seg.round_up(layout.num_bytes)))
        self.lock = threading.Lock()  # the active segment: its fd, size and rollover
        # a lost directory fails every append and stat: one line per 10 s with the count, as the tier's own errors
        self._error_log, self._directory_log = LimitedWarning(logger), LimitedWarning(logger)
        self.active_id: int | None = None
        self.active_size = 0
        self.next_segment_id = 0
        self._active_fd: int | None = None
        self._open_directory()
        # other live tiers on this directory: their segments, and start-up repairs, are not ours to change
        self.peers = DirectoryPeers(self.path)
        self.own_segments: set[int] = set()  # the segments this tier created (it may punch and delete them)

    def segment_path(self, segment_id: int) -> str:
        return segment_path(self.path, segment_id)

    def open_segment(self, segment_id: int, flags: int) -> int:
        """The segment's file opened with `flags`, never through a symlink; FileNotFoundError when
        it is gone, files.SegmentReplaced when another file took its name."""
        with self._index_lock:
            identity = self._index.identity(segment_id)
        return files.open_checked_segment(self.segment_path(segment_id), flags, identity)

    # -- appending -------------------------------------------------------------------------
    def append(self, keys: list[str], payloads: list[memoryview]) -> list[Entry]:
        """Write records for these blocks at the end of the active segment; where they lie, to index.

        Caller holds `lock`. OSError or TierError (the directory, made again, is unsafe) when the
        write failed: what it left is cut away, nothing is to be indexed. A segment that meets a limit on
        file size below segment_bytes (EFBIG: RLIMIT_FSIZE, a filesystem's largest file) is full: the records
        go to a new segment (EFBIG again only when they do not fit in an empty one).
        """
        try:
            return self._append(keys, payloads)
        except OSError as exc:
            if exc.errno != errno.EFBIG or self._active_fd is None or self.active_size == 0:
                raise
            self._error_log.note("%s: segment %s met a file size limit at %d bytes, below segment_bytes=%d (EFBIG: "
                                 "RLIMIT_FSIZE or the filesystem's); appending to a new segment", self.name,
                                 self.segment_path(self.active_id), self.active_size, self.segment_bytes)
            self.active_size = self.segment_bytes
            return self._append(keys, payloads)

    def _append(self, keys: list[str], payloads: list[memoryview]) -> list[Entry]:
        for _ in range(2):  # a segment lost during the write: once more in a new one
            start = None
            try:
                fd, start = self._active_segment()
                headers = self._write_records(fd, start, keys, payloads)
                if self.fsync:
                    os.fdatasync(fd)
            except (OSError, TierError):
                self._cut_back(start)
                raise
            if not self._roll_over_if_lost():
                break
        else:
            raise OSError(errno.ENOENT, "the segment file was deleted or replaced while being written, twice")
        entries, offset = [], start
        for header in headers:
            entries.append(Entry(self.active_id, offset, header))
            offset += header.record_num_bytes
        self.active_size = offset
        return entries

    def _write_records(self, fd: int, start: int, keys: list[str], payloads: list[memoryview]) -> list[seg.RecordHeader]:
        """Write the records from `start`, each at an offset known before any is checksummed.

        A batch of a MiB or more is split over the I/O threads, each checksumming and writing its
        own records (the checksum and the copy into the page cache release the GIL); within a
        part, the checksums of a chunk of about a MiB are computed right before its pwritev,
        which then copies bytes still in the CPU cache.
        """
        fmt, padded = self._record_layout, seg.round_up(self.layout.num_bytes)
        sizes = [seg.header_region_bytes(key, fmt.dtype_name, len(fmt.shape)) + padded for key in keys]
        offsets = list(itertools.accumulate(sizes, initial=start))

        def write_part(indices: list[int]) -> list[seg.RecordHeader]:
            headers = []
            for first in range(0, len(indices), self._chunk_records):
                chunk, views = indices[first : first + self._chunk_records], []
                for i in chunk:
                    digest = seg.checksum(seg.CHECKSUM_KIND, payloads[i])
                    header = seg.encode_header(keys[i], fmt.dtype_name, fmt.shape, payloads[i].nbytes, digest)
                    headers.append(header)
                    views += [memoryview(headers[-1].data), payloads[i], self._pad]
                disk_io.write_at(fd, views, offsets[chunk[0]])
            return headers

        headers = self._spread(write_part, list(range(len(keys))))
        assert all(h.record_num_bytes == n for h, n in zip(headers, sizes)), "header size mispredicted"
        return headers

    def _active_segment(self) -> tuple[int, int]:
        """(fd, size) of the segment that takes appends, begun anew past segment_bytes or when its
        file was deleted or replaced. Caller holds `lock`."""
        self._roll_over_if_lost()
        if self._active_fd is not None and self.active_size < self.segment_bytes:
            end = os.lseek(self._active_fd, 0, os.SEEK_END)
            if end == self.active_size:  # where the next records go
                return self._active_fd, end
            # cut (or grown) by something else: records past the cut read as corrupt misses, and records appended at
            # an end off the 4 KiB grid would be invisible to the next start's scan: begin a new segment
            logger.warning("%s: segment %s is %d bytes, not the %d this tier wrote; appending to a new segment",
                           self.name, self.segment_path(self.active_id), end, self.active_size)
            self.counters.add(errors=1)
            self.active_size = self.segment_bytes
        if self._active_fd is not None:
            os.close(self._active_fd)
            self._active_fd = None
            with self._index_lock:
                old, self.active_id = self.active_id, None
                is_dead = self._index.remove_if_empty(old)
            if is_dead:
                self._unlink(self.segment_path(old))
        if files.directory_identity(str(self.path)) != self._directory_identity:  # deleted (a tmp cleaner) or swapped
            # replaced by a file, it cannot be made again: every put comes here, so one line per 10 s
            self._directory_log.note("%s: directory %s was deleted or replaced; making or checking it again",
                                     self.name, self.path)
            self._open_directory()
            self.peers.close()  # its live file went with the directory: announce this tier in the new one
            self.peers = DirectoryPeers(self.path)
        while self._active_fd is None:  # another tier on this path may have taken the id: try the next
            segment_id, self.next_segment_id = self.next_segment_id, self.next_segment_id + 1
            try:
                self._active_fd = files.create_segment(self.segment_path(segment_id))
            except FileExistsError:
                continue
        self.active_size = 0
        self.own_segments.add(segment_id)
        with self._index_lock:
            self.active_id = segment_id
            self._index.add_segment(segment_id, files.file_identity(self._active_fd))
        if self.fsync:
            disk_io.sync_directory(str(self.path))
        return self._active_fd, 0

    def _roll_over_if_lost(self) -> bool:
        """Whether the active segment's file was deleted or replaced (or its directory was, by a file too);
        if so, forget it and its blocks (the next append begins a new segment). Caller holds `lock`."""
        if self._active_fd is None:
            return False
        path = self.segment_path(self.active_id)
        try:
            is_unlinked = os.fstat(self._active_fd).st_nlink == 0
        except OSError as exc:
            self._io_error("fstat", path, exc)
            return False
        try:
            at_path = files.path_identity(path)
        except OSError as exc:
            if not is_unlinked:  # cannot tell, and the file is still linked somewhere: keep appending
                self._io_error("stat", path, exc)
                return False
            at_path = None  # gone whatever the path says: appends to it would be counted stored, never readable
        with self._index_lock:
            identity = self._index.identity(self.active_id)
        if at_path is not None and at_path != identity:
            self.forget_segment(self.active_id, "segment_replaced")
        elif is_unlinked or at_path is None:
            self.forget_segment(self.active_id, "segment_deleted")
        else:
            return False
        return True

    def _cut_back(self, size: int | None) -> None:
        """Remove what a failed append left after `size`; if that fails too, begin a new segment next time."""
        if self._active_fd is None or size is None:
            return
        try:
            os.ftruncate(self._active_fd, size)
        except OSError as exc:
            self._io_error("truncate", self.segment_path(self.active_id), exc)
            self.active_size = self.segment_bytes  # what follows `size` is garbage: the next scan drops it

    # -- the directory and the active file -------------------------------------------------
    def close(self) -> None:
        """Close the active segment's file (the tier is closing, or the segment died). Caller holds `lock`."""
        if self._active_fd is not None:
            os.close(self._active_fd)
            self.active_id, self._active_fd = None, None

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

    def _unlink(self, path: str) -> None:
        try:
            os.unlink(path)
        except (FileNotFoundError, NotADirectoryError):  # gone, or its directory is: nothing to delete
            pass
        except OSError as exc:
            self._io_error("unlink", path, exc)

    def _io_error(self, op: str, path: str, exc: OSError) -> None:
        self._error_log.note("%s: I/O failed (counted in errors); latest: %s %s: %s", self.name, op, path, exc)
        self.counters.add(errors=1)

