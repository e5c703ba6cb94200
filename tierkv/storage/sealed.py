"""A disk or Redis tier whose blocks are authenticated (and optionally encrypted) with the deployment's secret.

Primitives: `SealedTier`.

    put:  key, block --name(key), seal--> inner tier (flat uint8 blocks of the sealed layout)
    get:  inner tier --open (MAC, key binding)--> block, or a miss

The inner tier is an ordinary DiskTier or RedisTier built with `BlockSealer.sealed_layout`; it
only ever sees keyed names, so nobody without the secret can compute, probe (EXISTS / GET) or
overwrite a given prompt's blocks there. A stored value that fails `open` is a miss, counted
as `auth_failures` (its hit in the inner tier's figures becomes a miss), logged at most once per
`log_interval_s` per tier, and deleted; it is never returned. The counters are the inner tier's.
Blocks the inner tier evicts are opened before they travel down the chain (their stored key is
authenticated); ones that fail are dropped without a count or a warning: they are leaving anyway, nothing was
served, and they are what a rotated secret or a change of `encrypt` leaves behind (every old block fails when
the LRU reaches it, which is no attack), or, in a disk directory, another model's block sealed by a version that
did not name the sealed layout in its records (disk_record_layout). A read still counts and reports every
block that fails under a name the tier asked for.

HMAC-SHA256 releases the GIL, so in the authenticated mode a batch's blocks are sealed and opened
on a few threads (`seal_threads`; 2 threads ran HMAC at 1.9x one on a 2-core machine). AES-GCM
(`cryptography`) holds the GIL: the encrypting mode stays on the calling thread.
"""
from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence, TypeVar

import torch

from tierkv.blocks import BlockLayout
from tierkv.storage.auth import AuthFailure, BlockSealer
from tierkv.storage.base import PutResult, StorageTier
from tierkv.storage.log_limit import LimitedWarning
from tierkv.storage.wrapped import WrappedTier

logger = logging.getLogger(__name__)
T = TypeVar("T")
SEAL_THREADS = min(8, os.cpu_count() or 1)


class SealedTier(WrappedTier):
    def __init__(self, inner: StorageTier, layout: BlockLayout, sealer: BlockSealer, *, log_interval_s: float = 10.0,
                 seal_threads: int = SEAL_THREADS):
        if sealer.layout != layout or inner.layout != sealer.sealed_layout:
            raise ValueError(f"{inner.name}: inner layout {inner.layout} is not the sealed form of {layout}")
        super().__init__(inner, layout)
        self.sealer = sealer
        self.log_interval_s = log_interval_s
        self._failure_log = LimitedWarning(logger, log_interval_s)
        # HMAC releases the GIL; AES-GCM does not (threads would only add overhead there)
        threads = 1 if sealer.encrypt else max(1, seal_threads)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tierkv-seal") if threads > 1 else None

    # -- reads ------------------------------------------------------------------------------------
    def get_many(self, keys: Sequence[str]) -> list[torch.Tensor | None]:
        names = self._names(keys)
        found = self.inner.get_many(names)
        out: list[torch.Tensor | None] = [None] * len(keys)
        failed: list[str] = []
        failed_at: list[int] = []
        present = [i for i, sealed in enumerate(found) if sealed is not None]
        for i, opened in zip(present, self._each(lambda i: self._try_open(keys[i], found[i]), present)):
            if isinstance(opened, AuthFailure):
                failed.append(names[i])
                failed_at.append(i)
                self._note_failure(opened)
            else:
                out[i] = opened
        if failed:  # the inner tier counted them as hits
            self.counters.add(hits=-len(failed), misses=len(failed), auth_failures=len(failed),
                              bytes_read=-len(failed) * self.inner.layout.num_bytes)
            self.inner.remove_if_held(failed, [found[i] for i in failed_at])
        return out

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        return self.inner.contains_many(self._names(keys))

    # -- writes -----------------------------------------------------------------------------------
    def put_many(self, keys: Sequence[str], blocks: Sequence[torch.Tensor]) -> list[PutResult]:
        self._check_put(keys, blocks)
        sealed = self._each(lambda i: self.sealer.seal(keys[i], blocks[i]), range(len(keys)))
        return [self._opened_evictions(r) for r in self.inner.put_many(self._names(keys), sealed)]

    def remove_many(self, keys: Sequence[str]) -> list[bool]:
        return self.inner.remove_many(self._names(keys))

    # -- the rest of the contract -------------------------------------------------------------------
    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        super().close()

    def __repr__(self) -> str:
        mode = "encrypted" if self.sealer.encrypt else "authenticated"
        return f"SealedTier({mode}, {self.inner!r})"

    # -- helpers ------------------------------------------------------------------------------------
    def _each(self, fn: Callable[[int], T], indices: Sequence[int]) -> list[T]:
        """fn over indices, in order: on the sealing threads for a batch of several, else here."""
        if self._pool is None or len(indices) < 2:
            return [fn(i) for i in indices]
        return list(self._pool.map(fn, indices))

    def _try_open(self, key: str, sealed: torch.Tensor) -> torch.Tensor | AuthFailure:
        try:
            return self.sealer.open(key, sealed)[1]
        except AuthFailure as exc:
            return exc

    def _names(self, keys: Sequence[str]) -> list[str]:
        return [self.sealer.name(k) for k in keys]

    def _opened_evictions(self, result: PutResult) -> PutResult:
        """The evicted blocks under their own keys; those that fail to open are dropped, not reported (see the
        module docstring: an eviction reads what the LRU reached, not what was asked for)."""
        evicted = []
        for name, sealed in result.evicted:
            if sealed is None:  # no tier below (return_evicted off): only counted, by the name it was stored under
                evicted.append((name, None))
                continue
            try:
                evicted.append(self.sealer.open(None, sealed))
            except AuthFailure as exc:
                logger.debug("%s: dropping evicted block %s that does not open here: %s", self.name, name, exc)
        result.evicted = evicted
        return result

    def _note_failure(self, exc: AuthFailure) -> None:
        """Log the first failure, then at most one line per log_interval_s with the count since."""
        self._failure_log.note("%s: stored block(s) failed authentication and were dropped as misses; latest: %s",
                               self.name, exc)
