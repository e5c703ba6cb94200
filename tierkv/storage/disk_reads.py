"""The disk tier's reads: a batch of records into one read buffer, every block checked.

Primitives: `Entry`, `BatchReader`.

A batch's records, sorted by (segment, offset), land in slots of one slab (disk_buffers), each
record's bytes as they lie on disk, so a run of adjacent records is read with one iovec:

    slab:  | slot 0                                     | slot 1                   | ...
           | zeros | header region | payload, padding  | header region | payload ...
                                   ^ max_header_bytes into every slot: the block's row

A slot is max_header_bytes (the largest header region in the batch: 4 KiB unless a key is
thousands of bytes long) + the padded payload; a record with a smaller header region starts that
much later in its slot, and its run is read with one iovec per record. Slots, records and their
offsets are multiples of 4096 bytes, so O_DIRECT reads any layout straight into the slab.

Runs the page cache holds (cachestat says so; where the kernel cannot tell, RWF_NOWAIT tries) are
copied about a MiB at a time, each block checked while its bytes are still in the CPU cache, the
runs spread over the I/O threads. The rest comes from the device (O_DIRECT) on the calling
thread, piece after piece, while an I/O thread checks the piece before (XXH3-64 and CRC-32 release
the GIL). Pieces are 16 MiB at most; the last two split what is left 3:1, so that the device
stays busy while the larger is checked and little is left to check after the last read:

    calling thread:  | read piece 0 (12 MiB)        | read 1 (4 MiB) | check 1 |
    I/O thread:                                     | check 0      |

Checking after the whole batch was read left the device idle during the checks.
"""
from __future__ import annotations

import errno
import os
from concurrent.futures import Executor, wait
from typing import Callable

import torch

from tierkv.blocks import BlockLayout, dtype_name
from tierkv.storage import disk_segments as seg
from tierkv.storage.codec import CorruptBlock
from tierkv.storage.disk_buffers import ReadBufferPool
from tierkv.storage.disk_files import SegmentReplaced

SEGMENT_GONE, SEGMENT_REPLACED = "segment deleted", "segment replaced"  # a read's failure: the whole segment is lost

_CHUNK_BYTES = 1 << 20  # copied from the page cache, then checked, at a time: stays in the CPU cache
_MAX_PIECE_BYTES = 16 << 20  # read from the device at a time
_MIN_PIECE_BYTES = 4 << 20  # smaller device reads run slower
_UNCACHED = "not in the page cache"  # a slot to read from the device (never returned)

Spread = Callable[[Callable[[list], list], list], list]  # fn over parts of a list on the I/O threads


class Entry:
    """Where a block's record lives: what the index keeps per block."""

    __slots__ = (
        "segment_id", "offset", "header_num_bytes", "record_num_bytes", "checksum_kind", "payload_checksum",
        "header_end", "header_checksum",
    )  # fmt: skip

    def __init__(self, segment_id: int, offset: int, h: seg.RecordHeader):
        self.segment_id, self.offset = segment_id, offset
        self.header_num_bytes, self.record_num_bytes = h.header_num_bytes, h.record_num_bytes
        self.checksum_kind, self.payload_checksum = h.checksum_kind, h.payload_checksum
        self.header_end, self.header_checksum = h.header_end, h.header_checksum  # the header's own ends at header_end


class BatchReader:
    """Reads batches of one layout's records into fresh read buffers and checks every block.

    open_segment: opens a segment id's file with extra flags (disk_files.open_checked_segment's
    errors: FileNotFoundError, SegmentReplaced, other OSError). spread: runs a function over contiguous parts of a list,
    on the I/O threads when the list is large, results concatenated. checker: the executor that
    checks device pieces behind the reads, or None to check them on the calling thread.
    """

    def __init__(
        self, layout: BlockLayout, open_segment: Callable[[int, int], int], buffers: ReadBufferPool,
        modes: seg.ReadModes, spread: Spread, checker: Callable[[], Executor | None],
    ):  # fmt: skip
        self.layout = layout
        self._open_segment, self._buffers, self._modes = open_segment, buffers, modes
        self._spread, self._checker = spread, checker
        self._dtype_name, self._shape = dtype_name(layout.dtype), tuple(layout.shape)

    def read(self, keys: list[str], entries: list[Entry]) -> tuple[list[torch.Tensor], list[str | None]]:
        """Per block, a [*layout.shape] row of one fresh slab, and None or why the block failed
        (its row then holds whatever was read)."""
        if not keys:
            return [], []
        batch = _Batch(keys, entries, self.layout, self._buffers)
        results: list[tuple[int, str | None]] = []  # (slot, failure)
        with _OpenSegments(self._open_segment, self._modes) as files:
            cached, uncached_runs = [], []  # slots, [first, end) ranges of slots
            for first, end in batch.runs(range(len(keys))):
                fd = files.fd(batch.entries[first].segment_id)
                if isinstance(fd, str):
                    results += [(p, fd) for p in range(first, end)]
                    continue
                run_bytes = batch.disk_bytes(first, end)
                num_cached = seg.cached_bytes(fd, batch.entries[first].offset, run_bytes, self._modes)
                is_cached = num_cached is None or num_cached == run_bytes  # None: unknown, RWF_NOWAIT tells
                if is_cached:
                    cached.extend(range(first, end))
                else:
                    uncached_runs.append((first, end))
            left = []  # slots of cached runs the page cache turned out not to hold
            for p, failure in self._spread(lambda part: self._read_cached(batch, files, part), cached):
                if failure is _UNCACHED:
                    left.append(p)
                else:
                    results.append((p, failure))
            runs = sorted(uncached_runs + batch.runs(sorted(left)))
            results += self._read_from_device(batch, files, runs, self._checker() if runs else None)
        failures: list[str | None] = ["not read"] * len(keys)  # a block is returned only once its check passed
        for p, failure in results:
            failures[batch.order[p]] = failure
        return batch.rows(), failures

    def _read_cached(self, batch: _Batch, files: _OpenSegments, slots: list[int]) -> list[tuple[int, str | None]]:
        """Copy these slots' runs from the page cache and check them; from the first chunk it does
        not hold, the rest of a run is left for the device (_UNCACHED)."""
        results = []
        chunk_slots = max(1, _CHUNK_BYTES // batch.slot_bytes)
        for first, end in batch.runs(slots):
            fd = files.fd(batch.entries[first].segment_id)
            for start in range(first, end, chunk_slots):
                stop = min(start + chunk_slots, end)
                try:
                    num_read = seg.read_cached(fd, batch.views(start, stop), batch.entries[start].offset, self._modes)
                except OSError as exc:
                    results += [(p, f"read failed: {exc}") for p in range(start, end)]
                    break
                if num_read < batch.disk_bytes(start, stop):
                    results += [(p, _UNCACHED) for p in range(start, end)]
                    break
                results += self._check_slots(batch, start, stop, batch.entries[start].offset + num_read)
        return results

    def _read_from_device(
        self, batch: _Batch, files: _OpenSegments, runs: list[tuple[int, int]], checker: Executor | None
    ) -> list[tuple[int, str | None]]:  # fmt: skip
        """Read the runs piece by piece on this thread while the checker checks the piece before;
        the last piece is checked here (every piece without a checker)."""
        results, futures = [], []
        remaining = sum(batch.disk_bytes(first, end) for first, end in runs)
        try:
            for first, end in runs:
                segment_id = batch.entries[first].segment_id
                fd, direct_fd = files.fd(segment_id), files.direct_fd(segment_id)
                start = first
                while start < end:
                    piece_bytes = min(_MAX_PIECE_BYTES, max(_MIN_PIECE_BYTES, remaining * 3 // 4))
                    stop = min(end, start + -(-piece_bytes // batch.slot_bytes))
                    remaining -= batch.disk_bytes(start, stop)
                    offset = batch.entries[start].offset
                    try:
                        read_end = offset + seg.read_at(fd, batch.views(start, stop), offset, self._modes, direct_fd)
                    except OSError as exc:
                        results += [(p, f"read failed: {exc}") for p in range(start, end)]
                        remaining -= batch.disk_bytes(stop, end)
                        break
                    if checker is None or remaining == 0:
                        results += self._check_slots(batch, start, stop, read_end)
                    else:
                        futures.append(checker.submit(self._check_slots, batch, start, stop, read_end))
                    start = stop
        finally:
            wait(futures)  # no check reads the slab once this returns
        return results + [r for future in futures for r in future.result()]

    def _check_slots(self, batch: _Batch, start: int, stop: int, read_end: int) -> list[tuple[int, str | None]]:
        """Check slots [start, stop), whose records were read up to disk offset read_end."""
        results = []
        for p in range(start, stop):
            entry = batch.entries[p]
            if entry.offset + entry.record_num_bytes > read_end:
                results.append((p, "short read"))
            else:
                results.append((p, self._check(batch.keys[p], entry, batch.header(p), batch.payload(p))))
        return results

    def _check(self, key: str, entry: Entry, header: memoryview, payload: memoryview) -> str | None:
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


class _Batch:
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


class _OpenSegments:
    """The segment files of one read, each opened once on the calling thread and closed on exit."""

    def __init__(self, open_segment: Callable[[int, int], int], modes: seg.ReadModes):
        self._open_segment, self._modes = open_segment, modes
        self._fds: dict[int, int | str] = {}  # segment id -> fd, or why it could not be opened
        self._direct_fds: dict[int, int | None] = {}

    def __enter__(self) -> _OpenSegments:
        return self

    def __exit__(self, *exc) -> None:
        for fd in [*self._fds.values(), *self._direct_fds.values()]:
            if isinstance(fd, int):
                os.close(fd)

    def fd(self, segment_id: int) -> int | str:
        """A buffered fd of the segment, or why it cannot be read: SEGMENT_GONE, SEGMENT_REPLACED
        (another file, or a symlink, took its name), "open failed: ..."."""
        if segment_id not in self._fds:
            try:
                self._fds[segment_id] = self._open_segment(segment_id, os.O_RDONLY)
            except FileNotFoundError:
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
