"""The segment files' dropping side (`SegmentDrops`, a part of `disk_segment_files.SegmentFiles`: it uses its
locks, index, counters and peers): records punched out when they leave the index, segments left with no live record
deleted, a segment whose file was deleted or replaced forgotten with its blocks counted lost, and, while another
live tier shares the directory, only this tier's own segments changed.

Primitives: `SegmentDrops`.
"""
from __future__ import annotations

import itertools
import logging
import os

from tierkv.storage import disk_files as files
from tierkv.storage import disk_io
from tierkv.storage.disk_index import Entry

logger = logging.getLogger("tierkv.storage.disk")  # logs as the tier, like disk_scan


class SegmentDrops:
    """SegmentFiles's dropping methods; the attributes they use are its own (`SegmentFiles.__init__`)."""

    def retire_if_active(self, segment_ids: list[int]) -> None:
        """The next append starts a new segment if the active one is among `segment_ids` (found corrupt)."""
        with self.lock:
            if self.active_id in segment_ids:
                self.active_size = self.segment_bytes

    def forget_lost_segments(self, segment_ids: set[int]) -> set[int]:
        """The segments among `segment_ids` whose file is no longer the one indexed (deleted, or another file at
        its path), each forgotten (`forget_segment`)."""
        lost = {}
        for segment_id in segment_ids:
            with self._index_lock:
                identity = self._index.identity(segment_id)
            if identity is None:
                continue  # forgotten already
            try:
                at_path = files.path_identity(self.segment_path(segment_id))
            except OSError:  # cannot tell: a read finds out
                continue
            if at_path != identity:
                lost[segment_id] = "segment_deleted" if at_path is None else "segment_replaced"
        if lost:
            with self.lock:
                for segment_id, reason in lost.items():
                    self.forget_segment(segment_id, reason)
        return set(lost)

    def forget_segment(self, segment_id: int, reason: str) -> None:
        """Drop every index entry into a segment whose file is lost, counted as lost_blocks for
        `reason`; close it if it takes appends. Caller holds `lock`. The file at its path
        (another's) is left alone."""
        with self._index_lock:
            lost = self._index.forget_segment(segment_id)
            if lost is None:
                return  # forgotten already
            if self.active_id == segment_id:
                self.close()
        logger.warning("%s: segment %s was %s while in use: %d blocks lost", self.name,
                       self.segment_path(segment_id), reason.split("_")[1], len(lost))  # fmt: skip
        self.counters.add_for_reason("lost_blocks", reason, len(lost))

    def drop_records(self, entries: list[Entry], *, change_files: bool = True) -> None:
        """Punch out records that left the index; delete segments left with no live record. While
        another live tier uses the directory, only in segments this tier created (the others' are only
        forgotten); change_files False: forget only."""
        if not entries:
            return
        with self.lock, self._index_lock:  # an emptied active segment is retired too: unlinked, not punched
            entries, dead = self._index.release(entries)
            if self.active_id in dead:
                self.close()
        if not change_files:
            return
        if self.peers.others_live():
            dead = {s for s in dead if s in self.own_segments}
            entries = [e for e in entries if e.segment_id in self.own_segments]
        for segment_id in dead:
            self._unlink(self.segment_path(segment_id))
        by_segment = itertools.groupby(sorted((e for e in entries if e.segment_id not in dead), key=_position),
                                       key=lambda e: e.segment_id)  # fmt: skip
        for segment_id, group in by_segment:
            self._punch_all(segment_id, list(group))

    def is_peers_segment(self, segment_id: int) -> bool:
        """Whether another live tier may have written (and may punch) segment `segment_id`."""
        return segment_id not in self.own_segments and self.peers.others_live()

    def delete_empty(self) -> None:
        """Delete the segments that hold no live record (at start: all of theirs were dropped)."""
        with self._index_lock:
            empty = self._index.remove_empty()
        for segment_id in empty:
            self._unlink(self.segment_path(segment_id))

    def _punch_all(self, segment_id: int, entries: list[Entry]) -> None:
        path = self.segment_path(segment_id)
        try:
            fd = self.open_segment(segment_id, os.O_WRONLY)
        except (FileNotFoundError, NotADirectoryError, files.SegmentReplaced):
            return  # a read will find the segment lost
        except OSError as exc:
            return self._io_error("open", path, exc)
        try:
            disk_io.punch_records(fd, [(e.offset, e.record_num_bytes, e.header_num_bytes) for e in entries])
        except OSError as exc:
            self._io_error("punch", path, exc)
        finally:
            os.close(fd)


def _position(entry: Entry) -> tuple[int, int]:
    return entry.segment_id, entry.offset
