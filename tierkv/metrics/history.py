"""The recorder's history: the latest snapshot lines kept as compact JSON, within a byte bound.

Primitives: `History` (`append`, `since`, `encoded_since`, `latest`, `num_bytes`), `DEFAULT_HISTORY_BYTES`.

Measured: a line of the CPU test workload (2 layers, CPU and disk tiers) is 4.3 KB of JSON and
5.9 KB as Python dicts; lines grow with layers (per-layer prefetch arrays) and tiers (latency
histograms), and 3,600 lines of a loaded runtime held as dicts took 70-90 MB. Held as JSON bytes,
the history costs what its bound says plus about 100 bytes of bookkeeping per line (a bytes
object and a tuple in the deque); a reader decodes only the lines it asks for.
"""
from __future__ import annotations

import json
from collections import deque

DEFAULT_HISTORY_BYTES = 8 * 1024**2


class History:
    def __init__(self, max_bytes: int = DEFAULT_HISTORY_BYTES, max_lines: int | None = None):
        if max_bytes < 1:
            raise ValueError(f"history_bytes: got {max_bytes!r}; must be positive")
        if max_lines is not None and max_lines < 1:
            raise ValueError(f"history: got {max_lines!r}; must be positive or None")
        self.max_bytes, self.max_lines = max_bytes, max_lines
        self._lines: deque[tuple[int, bytes]] = deque()  # (seq, compact JSON), oldest first
        self.num_bytes = 0

    def append(self, seq: int, encoded: bytes) -> None:
        """Keep line `seq`; drop the oldest until within the bounds (the newest line is always kept)."""
        self._lines.append((seq, encoded))
        self.num_bytes += len(encoded)
        while len(self._lines) > 1 and (self.num_bytes > self.max_bytes
                                        or (self.max_lines is not None and len(self._lines) > self.max_lines)):
            self.num_bytes -= len(self._lines.popleft()[1])

    def since(self, seq: int) -> list[dict]:
        """The kept lines numbered >= seq, decoded, oldest first."""
        return [json.loads(encoded) for encoded in self.encoded_since(seq)]

    def encoded_since(self, seq: int, max_lines: int | None = None) -> list[bytes]:
        """The kept lines numbered >= seq as they are kept (compact JSON), oldest first; only the newest
        `max_lines` of them when given. Copies references only: cheap under a caller's lock."""
        newer = []
        for line_seq, encoded in reversed(self._lines):
            if line_seq < seq or (max_lines is not None and len(newer) >= max_lines):
                break
            newer.append(encoded)
        newer.reverse()
        return newer

    def latest(self) -> dict | None:
        return json.loads(self._lines[-1][1]) if self._lines else None

    def __len__(self) -> int:
        return len(self._lines)
