"""The disk tier's index: where each block's record lies, in LRU order, and what each segment holds.

Primitives: `DiskIndex`, `Entry`, `save_order`, `load_order`, `ORDER_FILE`, `segment_path`.

    key -> Entry (segment, offset, sizes, payload checksum), least recently used first
    segment id -> number of live records (a segment left with none is deleted)
    segment id -> (device, inode) of the file we wrote or scanned (a file at its path that is
                  not that one was put there by someone else: its blocks are lost, never read)

Built at start from the segment headers in write order (a later record of a key wins; records of
another block layout are kept as they are, counted live: `foreign_records`), then reordered by `<path>/lru.order`, which the last clean
close saved (after a crash, write order stands). The order file is only a hint: it is removed once
read, and a damaged one is ignored.

Plain bookkeeping, no file changes and not thread-safe: the tier's lock guards every call.
"""
from __future__ import annotations

import logging
import os
import struct
from collections import OrderedDict
from pathlib import Path

from tierkv.blocks import BlockLayout
from tierkv.metrics.counters import TierCounters
from tierkv.storage import disk_files as files
from tierkv.storage import disk_scan
from tierkv.storage import disk_segments as seg
from tierkv.storage.disk_record_layout import RecordLayout
from tierkv.storage.base import TierError

logger = logging.getLogger("tierkv.storage.disk")  # logs as the tier, like disk_scan
ORDER_FILE = "lru.order"
SEGMENT_SUFFIX = ".seg"
_ORDER_MAGIC = b"TKVO"
_CRC = struct.Struct("<I")


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


class DiskIndex:
    """The blocks one DiskTier holds: key -> Entry, oldest first, with per-segment counts."""

    def __init__(self, name: str, layout: BlockLayout, counters: TierCounters):
        self.name, self.counters = name, counters
        self._record_layout = RecordLayout(layout)  # a sealed tier's records name the layout sealed too
        self._entries: OrderedDict[str, Entry] = OrderedDict()  # oldest first
        self._num_live: dict[int, int] = {}  # segment id -> records not yet dropped
        self._identities: dict[int, files.FileIdentity] = {}  # segment id -> (device, inode) we wrote or scanned

    # -- blocks ----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __getitem__(self, key: str) -> Entry:
        return self._entries[key]

    def get(self, key: str) -> Entry | None:
        return self._entries.get(key)

    def keys(self) -> list[str]:
        """Every key, least recently used first (what lru.order saves)."""
        return list(self._entries)

    def touch(self, key: str) -> None:
        """Make `key` the most recently used."""
        self._entries.move_to_end(key)

    def pop(self, key: str) -> Entry | None:
        """Take `key` out of the index; its record stays live in its segment until `release`."""
        return self._entries.pop(key, None)

    def commit(self, keys: list[str], entries: list[Entry], max_blocks: int) -> tuple[list[Entry], list[tuple[str, Entry]]]:
        """Index appended records, newest last; evict the least recently used over max_blocks.

        Returns (records superseded, (key, record) evicted), out of the index but still live in
        their segments until `release`d (the caller reads the evicted ones first).
        """
        dropped = []
        for key, entry in zip(keys, entries):
            old = self._entries.pop(key, None)
            if old is not None:
                dropped.append(old)
            self._entries[key] = entry
            self._num_live[entry.segment_id] += 1
        return dropped, self.evict_over(max_blocks)

    def evict_over(self, max_blocks: int) -> list[tuple[str, Entry]]:
        """Take the least recently used blocks out until at most max_blocks remain."""
        victims = []
        while len(self._entries) > max_blocks:
            victims.append(self._entries.popitem(last=False))
        return victims

    # -- segments --------------------------------------------------------------------------
    def has_segment(self, segment_id: int) -> bool:
        return segment_id in self._num_live

    def identity(self, segment_id: int) -> files.FileIdentity | None:
        return self._identities.get(segment_id)

    def add_segment(self, segment_id: int, identity: files.FileIdentity) -> None:
        """A segment just created, holding no record yet."""
        self._num_live[segment_id] = 0
        self._identities[segment_id] = identity

    def remove_if_empty(self, segment_id: int | None) -> bool:
        """Forget the segment if it holds no live record; whether it did (its file is to be deleted)."""
        if self._num_live.get(segment_id) != 0:
            return False
        del self._num_live[segment_id]
        self._identities.pop(segment_id, None)
        return True

    def remove_empty(self) -> list[int]:
        """Forget every segment that holds no live record; their ids (files to delete)."""
        empty = [segment_id for segment_id, n in self._num_live.items() if n == 0]
        for segment_id in empty:
            self.remove_if_empty(segment_id)
        return empty

    def forget_segment(self, segment_id: int) -> list[str] | None:
        """Drop the segment and every block whose record lies in it (its file is lost); the keys
        dropped, or None when it was forgotten already."""
        if segment_id not in self._num_live:
            return None
        lost = [key for key, entry in self._entries.items() if entry.segment_id == segment_id]
        for key in lost:
            del self._entries[key]
        del self._num_live[segment_id]
        self._identities.pop(segment_id, None)
        return lost

    def release(self, entries: list[Entry]) -> tuple[list[Entry], set[int]]:
        """Count records already out of the index as gone from their segments.

        Returns those of segments still known (a segment lost meanwhile is skipped) and the ids of
        segments left with no live record, forgotten here: their files are to be deleted, the
        other records punched out.
        """
        entries = [e for e in entries if e.segment_id in self._num_live]
        for entry in entries:
            self._num_live[entry.segment_id] -= 1
        dead = {e.segment_id for e in entries if self._num_live[e.segment_id] == 0}
        for segment_id in dead:
            self.remove_if_empty(segment_id)
        return entries, dead

    # -- start-up --------------------------------------------------------------------------
    def load(self, path: Path, *, repair: bool = True) -> tuple[int, list[Entry]]:
        """Index the segments under `path`, oldest first, then in the saved LRU order.

        Returns (the next free segment id, records to punch: superseded or of another layout).
        TierError when the directory cannot be scanned. repair False (another live tier uses the
        directory): no file is changed (old-format files and torn tails stay).
        """
        dropped: list[Entry] = []
        try:
            if repair:
                disk_scan.remove_old_format(path, ORDER_FILE)
            ids = sorted(int(p.stem, 16) for p in path.glob(f"*{SEGMENT_SUFFIX}") if disk_scan.is_segment_stem(p.stem))
            for segment_id in ids:
                dropped += self._index_segment(segment_id, segment_path(path, segment_id), repair)
        except (OSError, ValueError) as exc:
            raise TierError(f"{self.name}: cannot scan {str(path)!r}: {exc}") from exc
        order_path = os.path.join(path, ORDER_FILE)
        for key in reversed(load_order(order_path)):  # the last clean close's order; newer records stay newest
            if key in self._entries:
                self._entries.move_to_end(key, last=False)
        disk_scan.unlink_quietly(order_path)
        return (ids[-1] + 1 if ids else 0), dropped

    def _index_segment(self, segment_id: int, path: str, repair: bool = True) -> list[Entry]:
        """Index a segment's whole records (disk_scan counts and logs what it drops); returns those
        superseded or of another layout, to punch, counted as scan_dropped_records too."""
        found = disk_scan.scan_segment_file(path, self.name, self.counters, cut_tail=repair)
        if found is None:
            return []
        self._identities[segment_id] = found.identity
        # records this process cannot verify count as one live record: the segment is never deleted here
        self._num_live[segment_id] = len(found.records) + int(found.is_partly_unreadable)
        dropped, foreign = [], 0
        for offset, h in found.records:
            if not self._record_layout.is_own(h.dtype_name, h.shape):
                # another model's or block size's tier shares the directory (the default path is one for every
                # model): its records stay as they are, counted live, so this tier never deletes their segment.
                # Sealed blocks of one byte size share a shape: their records name the layout sealed
                # (disk_record_layout)
                foreign += 1
                continue
            entry = Entry(segment_id, offset, h)
            old = self._entries.pop(h.key, None)
            if old is not None:
                logger.debug("%s: %s: dropping a record of %s (superseded)", self.name, path, h.key)
                self.counters.add_for_reason("scan_dropped_records", "superseded")
                dropped.append(old)
            self._entries[h.key] = entry
        if foreign:
            self.counters.add(foreign_records=foreign)
            logger.info("%s: %s holds %d records of another block layout (another model or block size uses this "
                        "directory): left as they are, outside this tier's capacity", self.name, path, foreign)
        return dropped


def segment_path(directory: str | os.PathLike, segment_id: int) -> str:
    """Where segment `segment_id` lives: `<directory>/<16 hex digits>.seg`."""
    return os.path.join(directory, f"{segment_id:016x}{SEGMENT_SUFFIX}")


def save_order(path: str, keys: list[str]) -> None:
    """Write `keys` (oldest first) to `path` atomically: magic, count, (u16 length, key)*, CRC-32."""
    parts = [_ORDER_MAGIC, struct.pack("<I", len(keys))]
    for key in keys:
        key_bytes = key.encode()
        parts += [struct.pack("<H", len(key_bytes)), key_bytes]
    body = b"".join(parts)
    files.write_private_file(path, body + _CRC.pack(seg.checksum(seg.CRC32, body)))  # a fresh 0600 file, renamed: no symlink is followed


_MAX_ORDER_BYTES = 256 << 20  # some 72 bytes a block: 3.7 million blocks; a larger file is not one this tier wrote


def load_order(path: str) -> list[str]:
    """The keys `save_order` wrote, or [] when the file is missing or damaged (it is only a hint)."""
    try:
        data = files.read_private_file(path, _MAX_ORDER_BYTES)
    except OSError:
        return []
    if len(data) < 12 or data[:4] != _ORDER_MAGIC:
        return []
    if seg.checksum(seg.CRC32, data[:-4]) != _CRC.unpack_from(data, len(data) - 4)[0]:
        return []
    (count,), offset, keys = struct.unpack_from("<I", data, 4), 8, []
    for _ in range(count):
        (length,) = struct.unpack_from("<H", data, offset)
        keys.append(data[offset + 2 : offset + 2 + length].decode(errors="replace"))
        offset += 2 + length
    return keys
