"""The disk tier's write path: records appended to the active segment, indexed, LRU evictions past capacity handed
down the chain, and a full file system met by lowering the capacity (`DiskWrites`, a part of `disk.DiskTier`: it
uses the tier's files, index, locks and counters).

Primitives: `DiskWrites`.
"""
from __future__ import annotations

import errno
import logging

import torch

from tierkv.storage.base import PutResult, TierError
from tierkv.storage.disk_index import Entry

logger = logging.getLogger("tierkv.storage.disk")  # (the tier's own logger: its messages read as before)


class DiskWrites:
    """DiskTier's writing methods; the attributes they use are the tier's (`disk.DiskTier.__init__`)."""

    def _append(self, keys: list[str], payloads: list[memoryview]) -> list[PutResult]:
        """Write records for these blocks at the end of the active segment (SegmentFiles), then index them.

        A file system that is full (capacity_bytes larger than its room, or others' files took it) makes
        room: one put at a time (`_room_lock`) tries again first (another may have made room), then lowers
        max_blocks to the blocks held, evicts room for this batch and tries once more. A tier that stayed
        full would fail every later put and keep only its oldest blocks."""
        results, failure = self._try_append(keys, payloads)
        evicted: list[tuple[str, torch.Tensor]] = []
        if _is_full(failure):
            with self._room_lock:
                results, failure = self._try_append(keys, payloads)
                made = self._make_room(len(keys)) if _is_full(failure) else None
                if made is not None:
                    evicted = made
                    results, failure = self._try_append(keys, payloads)
        if failure is not None:
            results = [self._put_failed(key, failure) for key in keys]
        results[-1].evicted = evicted + results[-1].evicted  # handed down even when the put failed
        return results

    def _try_append(self, keys: list[str], payloads: list[memoryview]) -> tuple[list[PutResult], OSError | TierError | None]:
        """(results, None), or ([], why) when the write failed (what it wrote was cut away, nothing indexed)."""
        with self._files.lock:
            self._check_open()
            try:
                entries = self._files.append(keys, payloads)
            except (OSError, TierError) as exc:  # TierError: the directory, made again, is unsafe
                return [], exc
            with self._lock:
                dropped, victims = self._commit(keys, entries)
        self.counters.add(bytes_written=len(keys) * self.layout.num_bytes)
        results = [PutResult(True) for _ in keys]
        results[-1].evicted = self._drop(victims, dropped)
        return results, None

    def _make_room(self, num_blocks: int) -> list[tuple[str, torch.Tensor]] | None:
        """After a full file system (caller holds _room_lock): max_blocks lowered to the blocks held, the least
        recently used evicted and punched out to leave room for num_blocks; what they held (see _drop), or
        None when it held none."""
        with self._files.lock, self._lock:
            held = len(self._index)
            if held == 0:
                return None
            if held < self.max_blocks:
                logger.warning("%s: %s is full: capacity lowered from %d to %d blocks", self.name, self.path,
                               self.max_blocks, held)
                self.max_blocks = held
            victims = self._index.evict_over(max(0, held - num_blocks))
            self.counters.add(evictions=len(victims))
        return self._drop(victims, [])

    def _drop(self, victims: list[tuple[str, Entry]], dropped: list[Entry]) -> list[tuple[str, torch.Tensor]]:
        """Punch out records left behind (superseded, evicted); the evicted blocks read back first when a tier
        below takes them (return_evicted)."""
        evicted = []
        if victims and self.return_evicted:
            victim_keys = [key for key, _ in victims]
            rows, failures = self._read_blocks(victim_keys, [e for _, e in victims])
            evicted = [(key, row) for key, row, failure in zip(victim_keys, rows, failures) if failure is None]
            self.counters.add(bytes_read=len(evicted) * self.layout.num_bytes)
        self._files.drop_records(dropped + [e for _, e in victims])
        return evicted

    def _commit(self, keys: list[str], entries: list[Entry]) -> tuple[list[Entry], list[tuple[str, Entry]]]:
        """Index appended records; evict LRU blocks over capacity. Caller holds both locks.

        Returns (records superseded, (key, record) evicted); the caller drops them after reading
        the evicted ones, which is why they still count as live in their segment until then.
        """
        dropped, victims = self._index.commit(keys, entries, self.max_blocks)
        self.counters.add(evictions=len(victims))
        return dropped, victims

    def _put_failed(self, key: str, exc: OSError | TierError) -> PutResult:
        if isinstance(exc, OSError):
            code = errno.errorcode.get(exc.errno or 0, "OSError")
            error = f"{self.name}: put {key} under {self.path} failed: {code}: {exc.strerror or exc}"
        else:
            error = f"{self.name}: put {key} failed: {exc}"
        self._error_log.note("%s (counted in put_failures)", error)  # a full disk fails every put: one line per 10 s
        self.counters.add(put_failures=1, errors=1)
        return PutResult(False, error)


def _is_full(failure: BaseException | None) -> bool:
    return isinstance(failure, OSError) and failure.errno in (errno.ENOSPC, errno.EDQUOT)
