"""The disk tier's start-up scan of one segment file: its whole records, every drop logged and counted.

Primitives: `SegmentScan`, `scan_segment_file`, `is_segment_stem`, `remove_old_format`, `unlink_quietly`.

What a scan drops, counted in the tier's `scan_dropped_records` by reason (the tier adds
`superseded` when it indexes the records; records of another layout are kept, counted as `foreign_records`):

    header_damaged   data between whole records that is no header: a record whose header was damaged
    torn_tail        data after the last whole record (a torn write, a damaged last record): cut off

A segment name that is a symlink, not a regular file or another user's file is skipped
(logged, counted in `errors`) and left as it is; a segment of ours is made 0600.
"""
from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path
from typing import NamedTuple

from tierkv.metrics.counters import TierCounters
from tierkv.storage import disk_files as files
from tierkv.storage import disk_io
from tierkv.storage import disk_segments as seg

logger = logging.getLogger("tierkv.storage.disk")
_OLD_FORMAT_SUFFIXES = (".blk", ".tierkv-tmp")  # the one-file-per-block format, removed on start


class SegmentScan(NamedTuple):
    records: list[tuple[int, seg.RecordHeader]]  # (offset, header) of each whole record
    is_partly_unreadable: bool  # stopped at a record this process cannot verify (kept as it is)
    identity: files.FileIdentity


def scan_segment_file(path: str, tier_name: str, counters: TierCounters, *, cut_tail: bool = True) -> SegmentScan | None:
    """Scan one segment, cutting a torn tail off the file (cut_tail False: another live tier may be
    appending there; the tail is left and not counted); None when the file is skipped."""
    fd = _open_for_scan(path, tier_name, counters)
    if fd is None:
        return None
    damaged: list[tuple[int, int]] = []
    try:
        size = os.fstat(fd).st_size
        records, end, is_partly_unreadable = seg.scan_segment(fd, size, damaged)
        damaged = [region for region in damaged if region[1] <= end]  # later ones were the tail
        if cut_tail:  # the repairs of a tier alone on the directory
            _free_damaged(fd, path, damaged, tier_name)
            if end < size:
                _cut_tail(fd, path, end, size, tier_name, counters)
        identity = files.file_identity(fd)
    finally:
        os.close(fd)
    for start, stop in damaged:
        logger.warning("%s: %s: dropping a record whose header is damaged (%d bytes at offset %d)",
                       tier_name, path, stop - start, start)  # fmt: skip
        counters.add_for_reason("scan_dropped_records", "header_damaged")
    return SegmentScan(records, is_partly_unreadable, identity)


def _free_damaged(fd: int, path: str, damaged: list[tuple[int, int]], tier_name: str) -> None:
    """Punch out (or zero) the bytes of records whose headers are damaged: counted once, not at every start,
    and their space freed. A failure leaves them for the next start (logged)."""
    try:  # the whole region is zeroed where holes cannot be punched: a scan steps through all of it
        disk_io.punch_records(fd, [(start, stop - start, stop - start) for start, stop in damaged])
    except OSError as exc:
        logger.warning("%s: %s: cannot free a damaged record's bytes: %s", tier_name, path, exc)


def _open_for_scan(path: str, tier_name: str, counters: TierCounters) -> int | None:
    try:
        fd = files.open_segment(path, os.O_RDWR)
    except FileNotFoundError:  # a live peer on the directory removed its emptied segment since the listing
        return None
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.EACCES, errno.EISDIR, errno.ENXIO):
            raise
        return _skipped(path, str(exc), tier_name, counters)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        return _skipped(path, f"not a regular file of uid {os.geteuid()} (owner uid {st.st_uid}, "
                              f"{stat.filemode(st.st_mode)})", tier_name, counters)  # fmt: skip
    if stat.S_IMODE(st.st_mode) != files.FILE_MODE:
        os.fchmod(fd, files.FILE_MODE)  # an earlier version made segments 0644
    return fd


def _skipped(path: str, why: str, tier_name: str, counters: TierCounters) -> None:
    logger.warning("%s: skipping %s: %s; it is left as it is", tier_name, path, why)
    counters.add(errors=1)
    return None


def _cut_tail(fd: int, path: str, end: int, size: int, tier_name: str, counters: TierCounters) -> None:
    """Cut what follows the last whole record: a torn or damaged tail (counted), or punched holes."""
    if _holds_data(fd, end, size):
        logger.warning("%s: %s: dropping %d bytes after the last whole record (a torn write, a damaged "
                       "record, or removed records whose headers were zeroed)", tier_name, path, size - end)
        counters.add_for_reason("scan_dropped_records", "torn_tail")
    else:  # nothing but the holes punched over removed records
        logger.debug("%s: %s: trimming %d bytes of punched holes", tier_name, path, size - end)
    os.ftruncate(fd, end)


def _holds_data(fd: int, start: int, end: int) -> bool:
    """Whether bytes [start, end) of the file hold data, not only holes (True where the
    filesystem cannot tell)."""
    try:
        return os.lseek(fd, start, os.SEEK_DATA) < end
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # no data at or after start
            return False
        return True


def is_segment_stem(stem: str) -> bool:
    return len(stem) == 16 and all(c in "0123456789abcdef" for c in stem)


def remove_old_format(root: Path, order_file: str) -> None:
    """Delete block files of the one-file-per-block format (in two-hex-digit subdirectories), and
    temporary files an earlier run left (`<order_file>.*`, `probe.*`)."""
    for entry in os.scandir(root):
        if entry.is_dir(follow_symlinks=False) and len(entry.name) == 2:
            for sub in os.scandir(entry.path):
                if sub.name.endswith(_OLD_FORMAT_SUFFIXES) and sub.is_file(follow_symlinks=False):
                    unlink_quietly(sub.path)
            try:
                os.rmdir(entry.path)
            except OSError:
                pass
        elif entry.name.endswith(_OLD_FORMAT_SUFFIXES) or entry.name.startswith((f"{order_file}.", "probe.")):
            unlink_quietly(entry.path)


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
