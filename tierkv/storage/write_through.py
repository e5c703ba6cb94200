"""Write-through for the tier chain: tier 0's content-addressed blocks copied to persistent tiers.

Primitives: `WriteThrough` (has_work, write, drop_backlog, snapshot), `WRITE_THROUGH_BACKLOG_KEYS`.
Used by `chain.TierChain`, which runs `write` on its background pool and passes its own lock.

Tiers marked `write_through` (persistent ones: disk, Redis) also receive every content-addressed
block as soon as it lands in tier 0, so a later process finds the prefix there even when tier 0
never evicted it. A write-through tier that is down, or whose put fails because it (or the key's
cluster node) could not be reached (`PutResult.retry`), defers them (`write_through_deferred`): they
are written at the first write-through after it is back, or at `close` (whatever tier 0 still
holds; what it no longer holds, or a tier still down at close, counts in `write_through_failed`).
A put the tier refused for another reason (a disk's I/O error) counts failed at once.

    keys ──> tier 0 (peek) ──> each write-through tier that lacks them      (healthy)
                           └─> its backlog, oldest first, bounded           (down: written later)
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Sequence

import torch

from tierkv.storage.base import PutResult, StorageTier

WRITE_THROUGH_BACKLOG_KEYS = 1 << 16  # per tier: keys kept for a tier that is down (older ones counted failed)


class WriteThrough:
    """The chain's write-through: which tiers get tier 0's blocks, their backlogs while down, the counters."""

    def __init__(self, tiers: Sequence[StorageTier], flags: Sequence[bool], lock: threading.Lock,
                 spill: Callable[[int, list[tuple[str, torch.Tensor]]], None],
                 keep_put_error: Callable[[Sequence[PutResult]], None]):
        """tiers: the chain's tiers; flags: per tier, whether it is written through (tier 0 never is).
        lock: the chain's lock, which guards the counters and backlogs; spill(tier index, evicted): the
        chain's hand-off of blocks a write pushed out of a tier; keep_put_error(results): the chain keeps
        what a tier's refused puts said (called without the lock)."""
        self.tiers = tiers
        self.tier_indices = [i for i, flag in enumerate(flags) if flag and i > 0]
        self._lock = lock
        self._spill = spill
        self._keep_put_error = keep_put_error
        self.num_written = 0
        self.num_failed = 0
        self.num_deferred = 0
        # per write-through tier: keys it missed while down, written when it is back (oldest first, bounded)
        self._backlog: dict[int, OrderedDict[str, None]] = {i: OrderedDict() for i in self.tier_indices}

    def has_work(self, keys: Sequence[str]) -> bool:
        """Whether a write of `keys` has anything to do: some tier is written through, and there are keys
        or a backlog."""
        return bool(self.tier_indices) and bool(keys or any(self._backlog.values()))

    def write(self, keys: list[str]) -> str | None:
        """Copy these tier-0 blocks (and earlier ones a tier missed while down) to every write-through tier
        that lacks them; a tier that is down gets them at a later call once it is back. Returns None, or
        what went wrong (its keys counted failed)."""
        try:
            peeked: dict[str, torch.Tensor | None] = {}  # tier 0's blocks, read once for every write-through tier
            for index in self.tier_indices:
                deferred = self._take_backlog(index, keys)
                if deferred is not None:
                    self._write_tier(index, deferred, keys, peeked)
        except Exception as exc:  # counted and kept, as a spill's
            with self._lock:
                self.num_failed += len(keys)
            return f"write-through {type(exc).__name__}: {exc}"
        return None

    def _take_backlog(self, index: int, keys: list[str]) -> list[str] | None:
        """The keys tier `index` missed while down, taken from its backlog; None, with `keys` deferred to
        it, while it is down (written once it is back: a later call, or close)."""
        tier, backlog = self.tiers[index], self._backlog[index]
        with self._lock:
            if not tier.is_healthy:
                self._defer(index, keys, len(keys))
                return None
            if tier.down_nodes:  # a cluster node still marked down: the backlog waits (each write would read it
                return []        # all from tier 0 again for nothing); this call's keys go on
            deferred = list(backlog)
            backlog.clear()
        return deferred

    def _write_tier(self, index: int, deferred: list[str], keys: list[str],
                    peeked: dict[str, torch.Tensor | None]) -> None:
        """Write the deferred keys, then `keys`, to tier `index` where it lacks them (tier 0's blocks read
        into `peeked` once)."""
        first, tier = self.tiers[0], self.tiers[index]
        fresh = set(keys)
        todo_keys = list(dict.fromkeys(deferred + keys))  # each once, the deferred ones first
        unread = [k for k in todo_keys if k not in peeked]
        if unread:
            read = first.peek_many(unread) if hasattr(first, "peek_many") else first.get_many(unread)
            peeked.update(zip(unread, read))
        found = [peeked[k] for k in todo_keys]
        present = [(k, b) for k, b in zip(todo_keys, found) if b is not None]
        gone = [k for k, b in zip(todo_keys, found) if b is None and k not in fresh]
        if gone:  # deferred blocks tier 0 no longer holds: lost to this tier unless a spill brought them
            lost = sum(not held for held in tier.contains_many(gone))
            with self._lock:
                self.num_failed += lost
        if not present:
            return
        held = tier.contains_many([k for k, _ in present])
        todo = [(k, b) for (k, b), is_held in zip(present, held) if not is_held]
        if not todo:
            return
        results = tier.put_many([k for k, _ in todo], [b for _, b in todo])
        for result in results:
            self._spill(index, result.evicted)
        self._keep_put_error(results)
        # a put that failed because the tier (or the key's node) went down meanwhile waits in the backlog, as
        # the keys of a tier found down do: tier 0 still holds the block
        again = [k for (k, _), r in zip(todo, results) if not r.ok and r.retry]
        with self._lock:
            self.num_written += sum(r.ok for r in results)
            self.num_failed += sum(not r.ok and not r.retry for r in results)
            self._defer(index, again, sum(k in fresh for k in again))

    def _defer(self, index: int, keys: list[str], num_new: int) -> None:
        """Keys for tier `index`'s backlog (num_new of them not deferred before); the oldest over its bound
        count failed. The caller holds the lock."""
        backlog = self._backlog[index]
        for key in keys:
            backlog[key] = None
        self.num_deferred += num_new
        while len(backlog) > WRITE_THROUGH_BACKLOG_KEYS:
            backlog.popitem(last=False)
            self.num_failed += 1

    def drop_backlog(self) -> dict[str, int]:
        """At close, after a last write: per tier name, the blocks a tier still down never got (counted
        failed once, and cleared: a backlog still reported would count them twice, pending and failed)."""
        with self._lock:
            lost = {self.tiers[i].name: len(b) for i, b in self._backlog.items() if b}
            self.num_failed += sum(len(b) for b in self._backlog.values())
            for backlog in self._backlog.values():
                backlog.clear()
        return lost

    def snapshot(self) -> dict:
        """The counters and the backlog's size, as the chain's snapshot reports them. The caller holds the lock."""
        return {
            "written_through": self.num_written,
            "write_through_failed": self.num_failed,
            "write_through_deferred": self.num_deferred,
            "write_through_backlog": sum(len(b) for b in self._backlog.values()),
        }
