"""Pooled CUDA streams and events: the only place in tierkv that creates them.

Primitives:
    StreamPool   named streams of one device, created on first use, kept for the pool's life
    EventPool    reusable events; an event goes back to the pool by `release()`

Nothing here synchronizes the host. Importing this module does not initialize CUDA.
"""

from __future__ import annotations

import torch

# Lower number = higher priority in CUDA. Copy streams run at high priority so that a
# gather kernel gets SM slots as soon as a compute CTA retires instead of queueing
# behind a whole compute kernel.
HIGH_PRIORITY = -1


class StreamPool:
    """Named CUDA streams of one device.

    `get("h2d")` returns the same stream on every call, so work enqueued under one name
    stays in order. Streams are never destroyed while the pool lives.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"device: StreamPool needs a CUDA device, got {self.device}")
        self._streams: dict[str, torch.cuda.Stream] = {}

    def get(self, name: str, *, priority: int = 0) -> torch.cuda.Stream:
        """The stream called `name`; created with `priority` the first time it is asked for."""
        stream = self._streams.get(name)
        if stream is None:
            stream = torch.cuda.Stream(device=self.device, priority=priority)
            self._streams[name] = stream
        return stream

    def synchronize_all(self) -> None:
        """Host wait for every stream of the pool (tests, shutdown; never a hot path)."""
        for stream in self._streams.values():
            stream.synchronize()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._streams)


class EventPool:
    """Reusable CUDA events (timing disabled).

    An event handed out by `acquire()` belongs to the caller until it calls `release()`.
    Re-recording an event never disturbs waits already enqueued on it (CUDA captures the
    record a wait refers to when the wait is enqueued), so a released event may be reused
    at once; `acquire()` still prefers events whose last record has completed, so a late
    `query()` on a stale reference cannot report a newer record as done.
    """

    def __init__(self, *, max_free: int = 256) -> None:
        self.max_free = max_free
        self.num_created = 0
        self._free: list[torch.cuda.Event] = []

    def acquire(self) -> torch.cuda.Event:
        """An event ready to be recorded: a completed free one, else a new one."""
        for i in range(len(self._free) - 1, -1, -1):
            event = self._free[i]
            if event.query():
                self._free.pop(i)
                return event
        self.num_created += 1
        return torch.cuda.Event(enable_timing=False)

    def release(self, event: torch.cuda.Event) -> None:
        """Give `event` back; the caller must not query or wait on it afterwards."""
        if len(self._free) < self.max_free:
            self._free.append(event)

    def record(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        """An event from the pool recorded on `stream` now."""
        event = self.acquire()
        event.record(stream)
        return event

    @property
    def num_free(self) -> int:
        return len(self._free)
