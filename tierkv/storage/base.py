"""The small contract every storage tier implements.

Primitives: `StorageTier` (contains, get, put, remove, close; batched forms built on them),
`PutResult` (failures and evictions travel as values), `TierError`.

A tier stores blocks: tensors of one fixed shape and dtype (`BlockLayout`), addressed by
string keys from `tierkv.blocks`. `get` returns a tensor the caller owns (never a view into
the tier's storage), or None for a miss; a block that fails its checksum is a miss.
"""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Sequence

import torch

from tierkv.blocks import BlockLayout
from tierkv.metrics.counters import TierCounters


class TierError(RuntimeError):
    """A tier could not do what was asked (full, unreachable, misconfigured)."""


@dataclass
class PutResult:
    """What a put did. `evicted` holds blocks pushed out to make room, for the next tier (a tier told that none
    is below, `return_evicted = False`, lists them with None or not at all). `retry`: it failed only because the
    tier (or the key's node) could not be reached now: the same put may succeed later."""

    ok: bool
    error: str | None = None
    evicted: list[tuple[str, torch.Tensor | None]] = field(default_factory=list)
    retry: bool = False


class StorageTier(ABC):
    """One tier of block storage. Thread-safe: every public method may be called from any thread."""

    kind: str = "abstract"

    def __init__(self, name: str, layout: BlockLayout, capacity_bytes: int | None):
        self.name = name
        self.layout = layout
        self.capacity_bytes = capacity_bytes
        self.counters = TierCounters(name)
        self._lock = threading.RLock()

    # -- single-block primitives -------------------------------------------------------
    @abstractmethod
    def contains(self, key: str) -> bool: ...

    @abstractmethod
    def get(self, key: str) -> torch.Tensor | None: ...

    @abstractmethod
    def put(self, key: str, block: torch.Tensor) -> PutResult:
        """Store `block` under `key`. A key names one block's bytes for good (keys are content addresses: model,
        layout, the chained token ids): the chain skips spilling or writing through a key a lower tier holds, so
        other bytes put under a held key may leave the older ones served."""

    @abstractmethod
    def remove(self, key: str) -> bool: ...

    @abstractmethod
    def close(self) -> None: ...

    @property
    @abstractmethod
    def used_bytes(self) -> int: ...

    @property
    def is_healthy(self) -> bool:
        """False while the tier cannot serve (e.g. its server is down); callers skip it."""
        return True

    @property
    def down_nodes(self) -> list[str]:
        """The tier's servers marked down while the tier as a whole serves (a Redis Cluster's nodes); none here."""
        return []

    # -- batched forms; tiers override them where a batch is cheaper ----------------------
    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        return [self.contains(k) for k in keys]

    def get_many(self, keys: Sequence[str]) -> list[torch.Tensor | None]:
        return [self.get(k) for k in keys]

    def put_many(self, keys: Sequence[str], blocks: Sequence[torch.Tensor]) -> list[PutResult]:
        if len(keys) != len(blocks):
            raise ValueError(f"put_many: {len(keys)} keys but {len(blocks)} blocks")
        return [self.put(k, b) for k, b in zip(keys, blocks)]

    def remove_many(self, keys: Sequence[str]) -> list[bool]:
        return [self.remove(k) for k in keys]

    def remove_if_held(self, keys: Sequence[str], blocks: Sequence[torch.Tensor]) -> None:
        """Remove each key while it holds the block given (as read, found bad by a wrapper). A tier that other
        processes write (Redis) removes none they stored since; one whose records are this process's own
        (CPU, disk: a peer appends to segments of its own) removes the key."""
        self.remove_many(keys)

    # -- helpers for implementations --------------------------------------------------------
    def _check_block(self, key: str, block: torch.Tensor) -> None:
        if not isinstance(key, str) or not key:
            raise ValueError(f"{self.name}: block key must be a non-empty str, got {key!r}")
        if tuple(block.shape) != self.layout.shape or block.dtype != self.layout.dtype:
            raise ValueError(
                f"{self.name}: block {key} has shape {tuple(block.shape)} dtype {block.dtype}; "
                f"this tier holds shape {self.layout.shape} dtype {self.layout.dtype}"
            )

    def __enter__(self) -> "StorageTier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def held_capacity_bytes(self) -> int | None:
        """What the tier holds at most now: capacity_bytes, or less where a tier lowered it (a full file system)."""
        return self.capacity_bytes

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, used={self.used_bytes}, capacity={self.capacity_bytes})"
