"""Warnings a failing tier repeats for every block (an unreadable directory, corrupt records, failed
authentication), logged at most once per interval with the count since the last line.

Primitives: `LimitedWarning` (`note`).
"""
from __future__ import annotations

import logging
import threading
import time


class LimitedWarning:
    """The first occurrence is logged at once, later ones at most once per `interval_s`, each line
    with the number of occurrences it stands for (the counters keep the exact figures)."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0):
        self.logger, self.interval_s = logger, interval_s
        self._lock = threading.Lock()
        self._unlogged = 0
        self._last_s: float | None = None

    def note(self, message: str, *args) -> None:
        """One occurrence; `message % args` is the latest's description, prefixed with the count."""
        now = time.monotonic()
        with self._lock:
            self._unlogged += 1
            if self._last_s is not None and now - self._last_s < self.interval_s:
                return
            count, self._unlogged, self._last_s = self._unlogged, 0, now
        self.logger.warning("%d x (at most one line per %gs) " + message, count, self.interval_s, *args)
