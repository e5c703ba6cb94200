"""The disk tier's reads: a batch of records into one read buffer (disk_read_batch), every block checked.

Primitives: `BatchReader`.

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

from concurrent.futures import Executor, wait
from typing import Callable

import torch

from tierkv.blocks import BlockLayout
from tierkv.storage import disk_io
from tierkv.storage import disk_segments as seg
from tierkv.storage.codec import CorruptBlock
from tierkv.storage.disk_buffers import ReadBufferPool
from tierkv.storage.disk_index import Entry
from tierkv.storage.disk_read_batch import OpenSegments, ReadBatch
from tierkv.storage.disk_record_layout import RecordLayout

_CHUNK_BYTES = 1 << 20  # copied from the page cache, then checked, at a time: stays in the CPU cache
_MAX_PIECE_BYTES = 16 << 20  # read from the device at a time
_MIN_PIECE_BYTES = 4 << 20  # smaller device reads run slower
_UNCACHED = "not in the page cache"  # a slot to read from the device (never returned)

Spread = Callable[[Callable[[list], list], list], list]  # fn over parts of a list on the I/O threads


class BatchReader:
    """Reads batches of one layout's records into fresh read buffers and checks every block.

    open_segment: opens a segment id's file with extra flags (disk_files.open_checked_segment's
    errors: FileNotFoundError, SegmentReplaced, other OSError). spread: runs a function over contiguous parts of a list,
    on the I/O threads when the list is large, results concatenated. checker: the executor that
    checks device pieces behind the reads, or None to check them on the calling thread.
    """

    def __init__(
        self, layout: BlockLayout, open_segment: Callable[[int, int], int], buffers: ReadBufferPool,
        modes: disk_io.ReadModes, spread: Spread, checker: Callable[[], Executor | None],
    ):  # fmt: skip
        self.layout = layout
        self._open_segment, self._buffers, self._modes = open_segment, buffers, modes
        self._spread, self._checker = spread, checker
        self._record_layout = RecordLayout(layout)

    def read(self, keys: list[str], entries: list[Entry]) -> tuple[list[torch.Tensor], list[str | None]]:
        """Per block, a [*layout.shape] row of one fresh slab, and None or why the block failed
        (its row then holds whatever was read)."""
        if not keys:
            return [], []
        batch = ReadBatch(keys, entries, self.layout, self._buffers)
        results: list[tuple[int, str | None]] = []  # (slot, failure)
        with OpenSegments(self._open_segment, self._modes) as files:
            cached, uncached_runs = [], []  # slots, [first, end) ranges of slots
            for first, end in batch.runs(range(len(keys))):
                fd = files.fd(batch.entries[first].segment_id)
                if isinstance(fd, str):
                    results += [(p, fd) for p in range(first, end)]
                    continue
                run_bytes = batch.disk_bytes(first, end)
                num_cached = disk_io.cached_bytes(fd, batch.entries[first].offset, run_bytes, self._modes)
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

    def _read_cached(self, batch: ReadBatch, files: OpenSegments, slots: list[int]) -> list[tuple[int, str | None]]:
        """Copy these slots' runs from the page cache and check them; from the first chunk it does
        not hold, the rest of a run is left for the device (_UNCACHED)."""
        results = []
        chunk_slots = max(1, _CHUNK_BYTES // batch.slot_bytes)
        for first, end in batch.runs(slots):
            fd = files.fd(batch.entries[first].segment_id)
            for start in range(first, end, chunk_slots):
                stop = min(start + chunk_slots, end)
                try:
                    num_read = disk_io.read_cached(fd, batch.views(start, stop), batch.entries[start].offset, self._modes)
                except OSError as exc:
                    results += [(p, f"read failed: {exc}") for p in range(start, end)]
                    break
                if num_read < batch.disk_bytes(start, stop):
                    results += [(p, _UNCACHED) for p in range(start, end)]
                    break
                results += self._check_slots(batch, start, stop, batch.entries[start].offset + num_read)
        return results

    def _read_from_device(
        self, batch: ReadBatch, files: OpenSegments, runs: list[tuple[int, int]], checker: Executor | None
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
                        read_end = offset + disk_io.read_at(fd, batch.views(start, stop), offset, self._modes, direct_fd)
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

    def _check_slots(self, batch: ReadBatch, start: int, stop: int, read_end: int) -> list[tuple[int, str | None]]:
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
        if not self._record_layout.is_own(h.dtype_name, h.shape) or h.payload_num_bytes != payload.nbytes:
            return f"stored as {h.shape} {h.dtype_name}, not this tier's layout"
        if seg.checksum(kind, payload) != h.payload_checksum:
            return "payload checksum mismatch"
        return None
