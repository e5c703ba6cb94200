"""One batched read of the disk tier: where each record lands in the read buffer, and the files it opens.

Primitives: `ReadBatch`, `OpenSegments`, `SEGMENT_GONE`, `SEGMENT_REPLACED`.

A batch's records, sorted by (segment, offset), land in slots of one slab (disk_buffers), each
record's bytes as they lie on disk, so a run of adjacent records is read with one iovec:

    slab:  | slot 0                                     | slot 1                   | ...
           | zeros | header region | payload, padding  | header region | payload ...
                                   ^ max_header_bytes into every slot: the block's row

A slot is max_header_bytes (the largest header region in the batch: 4 KiB unless a key is
thousands of bytes long) + the padded payload; a record with a smaller header region starts that
much later in its slot, and its run is read with one iovec per record. Slots, records and their
offsets are multiples of 4096 bytes, so O_DIRECT reads any layout straight into the slab.
"""
from __future__ import annotations

import errno
import os
from typing import Callable

import torch

from tierkv.blocks import BlockLayout
from tierkv.storage import disk_segments as seg
from tierkv.storage.disk_buffers import ReadBufferPool
from tierkv.storage.disk_files import SegmentReplaced
from tierkv.storage.disk_index import Entry
from tierkv.storage.disk_io import ReadModes

SEGMENT_GONE, SEGMENT_REPLACED = "segment deleted", "segment replaced"  # a read's failure: the whole segment is lost


class ReadBatch:
    """One get: the records in slot order (sorted by segment and offset), their slab and rows.

    Slot p holds the record of keys[order[p]].
    """

    def __init__(self, keys: list[str], entries: list[Entry], layout: BlockLayout, buffers: ReadBufferPool):
        positions = [(e.segment_id, e.offset) for e in entries]
        self.order = sorted(range(len(entries)), key=positions.__getitem__)
        self.keys = [keys[j] for j in self.order]
        self.entries = [entries[j] for j in self.order]
        ends = [(e.segment_id, e.offset + e.record_num_bytes) for e in self.entries]
        self._follows = [p > 0 and ends[p - 1] == positions[j] for p, j in enumerate(self.order)]  # p right after p-1
        header_sizes = {e.header_num_bytes for e in entries}
        self.header_bytes = max(header_sizes)
        self._is_packed = len(header_sizes) == 1  # then a run is one iovec
        self.payload_bytes = layout.num_bytes
        self.slot_bytes = self.header_bytes + seg.round_up(layout.num_bytes)
        self._layout = layout
        self._slab = buffers.empty(len(entries) * self.slot_bytes)
        self._view = memoryview(self._slab.numpy())

    def rows(self) -> list[torch.Tensor]:
        """Each block's [*layout.shape] view of the slab, in the order of the keys."""
        n, header_bytes, layout = len(self.order), self.header_bytes, self._layout
        payloads = self._slab.view(n, self.slot_bytes)[:, header_bytes : header_bytes + layout.num_bytes]
        in_slot_order = payloads.view(layout.dtype).view(n, *layout.shape).unbind(0)
        rows = [in_slot_order[0]] * n
        for p, j in enumerate(self.order):
            rows[j] = in_slot_order[p]
        return rows

    def runs(self, slots) -> list[tuple[int, int]]:
        """Sorted slots split into [first, end) ranges whose records lie back to back in one segment."""
        runs: list[tuple[int, int]] = []
        first = prev = None
        for p in slots:
            if prev is None or p != prev + 1 or not self._follows[p]:
                if prev is not None:
                    runs.append((first, prev + 1))
                first = p
            prev = p
        if prev is not None:
            runs.append((first, prev + 1))
        return runs

    def disk_bytes(self, start: int, stop: int) -> int:
        """Bytes on disk of the adjacent records in slots [start, stop)."""
        if start >= stop:
            return 0
        return self.entries[stop - 1].offset + self.entries[stop - 1].record_num_bytes - self.entries[start].offset

    def views(self, start: int, stop: int) -> list[memoryview]:
        """The buffers a read of the adjacent records in slots [start, stop) fills, in order."""
        region_start = start * self.slot_bytes + self.header_bytes - self.entries[start].header_num_bytes
        if self._is_packed:
            return [self._view[region_start : stop * self.slot_bytes]]
        return [self._view[(p + 1) * self.slot_bytes - self.entries[p].record_num_bytes : (p + 1) * self.slot_bytes]
                for p in range(start, stop)]  # fmt: skip

    def header(self, p: int) -> memoryview:
        row = p * self.slot_bytes + self.header_bytes
        return self._view[row - self.entries[p].header_num_bytes : row]

    def payload(self, p: int) -> memoryview:
        row = p * self.slot_bytes + self.header_bytes
        return self._view[row : row + self.payload_bytes]


class OpenSegments:
    """The segment files of one read, each opened once on the calling thread and closed on exit."""

    def __init__(self, open_segment: Callable[[int, int], int], modes: ReadModes):
        self._open_segment, self._modes = open_segment, modes
        self._fds: dict[int, int | str] = {}  # segment id -> fd, or why it could not be opened
        self._direct_fds: dict[int, int | None] = {}

    def __enter__(self) -> OpenSegments:
        return self

    def __exit__(self, *exc) -> None:
        for fd in [*self._fds.values(), *self._direct_fds.values()]:
            if isinstance(fd, int):
                try:
                    os.close(fd)  # the blocks were read (and checksummed) before: a failing close (NFS, FUSE) loses
                except OSError:   # nothing, and the other fds still close
                    pass

    def fd(self, segment_id: int) -> int | str:
        """A buffered fd of the segment, or why it cannot be read: SEGMENT_GONE, SEGMENT_REPLACED
        (another file, or a symlink, took its name), "open failed: ..."."""
        if segment_id not in self._fds:
            try:
                self._fds[segment_id] = self._open_segment(segment_id, os.O_RDONLY)
            except (FileNotFoundError, NotADirectoryError):  # ENOTDIR: its directory was replaced by a file
                self._fds[segment_id] = SEGMENT_GONE
            except SegmentReplaced:
                self._fds[segment_id] = SEGMENT_REPLACED
            except OSError as exc:
                self._fds[segment_id] = SEGMENT_REPLACED if exc.errno == errno.ELOOP else f"open failed: {exc}"
        return self._fds[segment_id]

    def direct_fd(self, segment_id: int) -> int | None:
        """An O_DIRECT fd of the segment; None where O_DIRECT is refused (then reads go through the page cache)."""
        if not self._modes.is_direct_ok:
            return None
        if segment_id not in self._direct_fds:
            try:
                self._direct_fds[segment_id] = self._open_segment(segment_id, os.O_RDONLY | os.O_DIRECT)
            except OSError as exc:
                if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):  # this filesystem has no O_DIRECT
                    self._modes.is_direct_ok = False
                self._direct_fds[segment_id] = None
        return self._direct_fds[segment_id]
