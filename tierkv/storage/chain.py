"""The tier chain: where each block lives, lookups across tiers, promotion and spilling.

Primitives: `TierChain` (put_many, get_many, locate_many, remove_many, write_through, flush,
close, snapshot; acquire_many and acquire_available, the promotions into pinned tier-0 slots:
`chain_promotion.ChainPromotion`). The write-through itself (backlogs of tiers that are down, its
counters): `write_through.WriteThrough`.

    put ──> tier 0 (cpu) ──evicted──> tier 1 (disk) ──evicted──> tier 2 (redis) ──> dropped
    get <── tier 0 <──promote── tier 1 <──promote── tier 2

Lookups go down the tiers in order, in batches, skipping unhealthy tiers. A hit below tier 0
is promoted into tier 0. Blocks pushed out of a tier spill into the next one on a background
thread pool, off the caller's path; while a spill is in flight its blocks are still served
from memory, so nothing is missed between tiers. A spill that a tier refuses (full, down)
goes to the tier after it; only a block no tier accepts is dropped, and that is counted.

Write-through: tiers marked `write_through` (persistent ones: disk, Redis) also receive every
content-addressed block as soon as it lands in tier 0, on the same background pool, so a later
process finds the prefix there even when tier 0 never evicted it. `flush` and `close` wait for
those writes. A write-through tier that is down defers them until it is back (`write_through`).
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

import torch

from tierkv.redact import redact_text
from tierkv.storage.base import PutResult, StorageTier
from tierkv.storage.chain_promotion import ChainPromotion
from tierkv.storage.log_limit import LimitedWarning
from tierkv.storage.write_through import WriteThrough


logger = logging.getLogger(__name__)


class TierChain(ChainPromotion):
    def __init__(self, tiers: Sequence[StorageTier], *, num_spill_workers: int = 2,
                 write_through: Sequence[bool] | None = None):
        if not tiers:
            raise ValueError("a tier chain needs at least one tier")
        self.tiers = list(tiers)
        flags = list(write_through) if write_through is not None else [False] * len(self.tiers)
        if len(flags) != len(self.tiers):
            raise ValueError(f"write_through: {len(flags)} flags for {len(self.tiers)} tiers")
        if hasattr(self.tiers[-1], "return_evicted"):  # nothing below the last tier: do not read evictions back
            self.tiers[-1].return_evicted = False
        self._executor = ThreadPoolExecutor(max_workers=num_spill_workers, thread_name_prefix="tierkv-spill")
        self._lock = threading.Lock()
        self._write_through = WriteThrough(self.tiers, flags, self._lock, self.spill, self._keep_put_error)
        self._in_flight: dict[str, torch.Tensor] = {}
        self._futures: set[Future] = set()
        self.num_spilled = 0
        self.num_dropped = 0
        self.num_promoted = 0
        self.spill_errors: deque[str] = deque(maxlen=10)  # the latest (a tier failing every write: one per call)
        self._error_log = LimitedWarning(logger)

    # -- writes --------------------------------------------------------------------------------
    def put_many(self, keys: Sequence[str], blocks: Sequence[torch.Tensor], *, start: int = 0) -> list[PutResult]:
        """Store blocks in the first tier from `start` that takes them; evictions spill in the background."""
        if len(keys) != len(blocks):
            raise ValueError(f"put_many: {len(keys)} keys but {len(blocks)} blocks")
        return self._put_from(start, list(keys), list(blocks))

    def spill(self, tier_index: int, evicted: list[tuple[str, torch.Tensor | None]]) -> None:
        """Hand blocks pushed out of tier `tier_index` to the tiers below it, in the background. Out of the
        last tier they are gone at once (counted dropped): held in flight until a spill to nowhere ran, they
        still counted as held (`locate_many`, `get_many`), so whether a lookup found them, and a request
        skipped saving or pinning them, depended on that thread's timing (blocks later in no tier). The last tier
        reports its evictions without their bytes (None: `return_evicted` is off there)."""
        if not evicted:
            return
        if tier_index + 1 >= len(self.tiers):
            with self._lock:
                self.num_dropped += len(evicted)
            return
        with self._lock:
            for key, block in evicted:
                self._in_flight[key] = block
            future = self._executor.submit(self._spill_now, tier_index + 1, evicted)
            self._futures.add(future)
        future.add_done_callback(self._forget_future)

    def _put_from(self, start: int, keys: list[str], blocks: list[torch.Tensor], *,
                  keep_errors: bool = False) -> list[PutResult]:
        """Each block into the first healthy tier from `start` that takes it; keep_errors: the tiers' refusals
        are kept for spill_errors (`_keep_put_error`)."""
        results: list[PutResult | None] = [None] * len(keys)
        pending = list(range(len(keys)))
        for index in range(start, len(self.tiers)):
            tier = self.tiers[index]
            if not pending or not tier.is_healthy:
                continue
            tier_results = tier.put_many([keys[i] for i in pending], [blocks[i] for i in pending])
            if keep_errors:
                self._keep_put_error(tier_results)
            still_pending = []
            for i, result in zip(pending, tier_results):
                self.spill(index, result.evicted)
                results[i] = result
                if not result.ok:
                    still_pending.append(i)
            pending = still_pending
        return [r if r is not None else PutResult(ok=False, error="no healthy tier") for r in results]

    def _spill_now(self, start: int, evicted: list[tuple[str, torch.Tensor]]) -> None:
        try:
            keys = [k for k, _ in evicted]
            known = self._locate_from(start, keys)
            todo = [(k, b) for (k, b), where in zip(evicted, known) if where is None]
            if todo:
                results = self._put_from(start, [k for k, _ in todo], [b for _, b in todo], keep_errors=True)
                dropped = sum(not r.ok for r in results)
                with self._lock:
                    self.num_dropped += dropped
            with self._lock:
                self.num_spilled += len(evicted)
        except Exception as exc:  # counted and kept: a spill must never kill the pool silently
            with self._lock:
                self.num_dropped += len(evicted)
            self._note_error(f"spill {type(exc).__name__}: {exc}",
                             "those blocks are dropped: a later request recomputes them")
        finally:
            with self._lock:
                for key, block in evicted:
                    if self._in_flight.get(key) is block:
                        del self._in_flight[key]

    def write_through(self, keys: Sequence[str]) -> None:
        """Copy these tier-0 blocks to every write-through tier that lacks them, in the background; a tier
        that is down gets them (and earlier ones it missed) at a later call once it is back."""
        if not self._write_through.has_work(keys):
            return
        with self._lock:
            future = self._executor.submit(self._write_through_now, list(keys))
            self._futures.add(future)
        future.add_done_callback(self._forget_future)

    def _write_through_now(self, keys: list[str]) -> None:
        error = self._write_through.write(keys)
        if error is not None:  # counted and kept, as a spill's
            self._note_error(error, "those blocks stay in the CPU tier only")

    def _note_error(self, error: str, consequence: str) -> None:
        """A spill or write-through that raised: kept (redacted) for stats' spill_errors and logged, at most a
        line per 10 s (a tier failing every write, e.g. its sealer, was otherwise seen only in the stats)."""
        error = redact_text(error)
        with self._lock:
            self.spill_errors.append(error)
        self._error_log.note("tierkv tiers: %s; %s (stats' spill_errors keeps the latest)", error, consequence)

    def _keep_put_error(self, results: Sequence[PutResult]) -> None:
        """The latest refusal among a spill's or write-through's puts (a full disk, Redis's OOM or READONLY) kept
        for spill_errors; the tier logged it. Not a tier found down (`retry`): that waits or goes on, logged by
        its link. The caller does not hold the lock."""
        errors = [r.error for r in results if not r.ok and not r.retry and r.error]
        if errors:
            with self._lock:
                self.spill_errors.append(redact_text(errors[-1]))

    def _forget_future(self, future: Future) -> None:
        with self._lock:
            self._futures.discard(future)

    # -- reads ---------------------------------------------------------------------------------
    def get_many(self, keys: Sequence[str], *, promote: bool = True, start: int = 0) -> list[torch.Tensor | None]:
        """Blocks for keys (None for a miss), looked up tier by tier from `start`; lower hits promoted to tier 0."""
        found: list[torch.Tensor | None] = [None] * len(keys)
        with self._lock:
            for i, key in enumerate(keys):
                block = self._in_flight.get(key)
                if block is not None:
                    found[i] = block.clone()
        pending = [i for i, b in enumerate(found) if b is None]
        for index, tier in enumerate(self.tiers):
            if index < start or not pending or not tier.is_healthy:
                continue
            blocks = self._tier_get(tier, [keys[i] for i in pending])
            hits = [(i, b) for i, b in zip(pending, blocks) if b is not None]
            for i, block in hits:
                found[i] = block
            if index > 0 and promote and hits:
                self._promote([keys[i] for i, _ in hits], [b for _, b in hits])
            pending = [i for i, b in zip(pending, blocks) if b is None]
        return found

    def _tier_get(self, tier: StorageTier, keys: list[str]) -> list[torch.Tensor | None]:
        """tier.get_many, an exception from it (an OS error its own handling missed) read as misses for that tier
        and counted in its errors: the next tier, or a recompute, serves the keys, and no caller's pins leak."""
        try:
            return tier.get_many(keys)
        except Exception as exc:  # noqa: BLE001 (a tier's failure must not fail the request: it is a miss)
            logger.warning("tierkv: %s: a read of %d blocks failed (%s); they count as misses", tier.name, len(keys),
                           redact_text(f"{type(exc).__name__}: {exc}"), exc_info=True)
            tier.counters.add(errors=1)
            return [None] * len(keys)

    def locate_many(self, keys: Sequence[str]) -> list[int | None]:
        """Index of the first tier holding each key (None: nowhere). Blocks being spilled count as tier 0."""
        with self._lock:
            flying = [k in self._in_flight for k in keys]
        where = self._locate_from(0, keys)
        return [0 if fly and w is None else w for fly, w in zip(flying, where)]

    def _locate_from(self, start: int, keys: Sequence[str]) -> list[int | None]:
        where: list[int | None] = [None] * len(keys)
        pending = list(range(len(keys)))
        for index in range(start, len(self.tiers)):
            tier = self.tiers[index]
            if not pending or not tier.is_healthy:
                continue
            present = tier.contains_many([keys[i] for i in pending])
            for i, is_present in zip(pending, present):
                if is_present:
                    where[i] = index
            pending = [i for i, p in zip(pending, present) if not p]
        return where

    def remove_many(self, keys: Sequence[str]) -> None:
        """Remove keys from every tier (after pending spills, so none comes back)."""
        self.flush()
        for tier in self.tiers:
            if tier.is_healthy:
                tier.remove_many(keys)

    # -- lifecycle -----------------------------------------------------------------------------
    def flush(self) -> None:
        """Wait for every background spill submitted so far."""
        while True:
            with self._lock:
                self._futures = {f for f in self._futures if not f.done()}
                futures = list(self._futures)
            if not futures:
                return
            for future in futures:
                future.result()

    def close(self) -> None:
        self.write_through([])  # the blocks a write-through tier missed while down, if it is back now
        self.flush()
        lost = self._write_through.drop_backlog()
        if lost:  # still down: those blocks live only in this process's tiers, which close now
            logger.warning("write-through: %s never reached (down until close); a later process recomputes them",
                           ", ".join(f"{n} blocks for {name}" for name, n in lost.items()))
        self._executor.shutdown(wait=True)
        for tier in self.tiers:
            tier.close()

    def snapshot(self) -> dict:
        with self._lock:
            chain = {
                "spilled": self.num_spilled, "dropped": self.num_dropped, "promoted": self.num_promoted,
                "in_flight": len(self._in_flight), "spill_errors": list(self.spill_errors),
                **self._write_through.snapshot(),
            }
        return {"chain": chain, "tiers": [dict(t.counters.snapshot(), healthy=t.is_healthy, used_bytes=t.used_bytes,
                                               capacity_bytes=t.held_capacity_bytes) for t in self.tiers]}
