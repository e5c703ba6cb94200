"""Other live disk tiers on the same directory (tensor-parallel ranks, a second process), told apart from
files that dead ones left.

Primitives: `DirectoryPeers` (`others_live`, `close`).

Each live tier holds an exclusive flock on a file of its own, `.live-<pid>-<random>` in the directory,
for as long as it runs; the kernel drops the lock when the process dies. `others_live` tries each
other such file: a lock it can take belonged to a dead tier (the file is removed), one it cannot is
held by a live tier. The disk tier changes files only it may change while others live: no start-up
repair (torn tails, superseded or foreign records, empty segments) and no punching or deleting in
segments another tier wrote; what it drops there it only forgets.
"""
from __future__ import annotations

import fcntl
import logging
import os
import secrets
import time

logger = logging.getLogger("tierkv.storage.disk")

LIVE_PREFIX = ".live-"
RECHECK_S = 1.0  # others_live is cached this long: drops ask it per batch


class DirectoryPeers:
    def __init__(self, path: str | os.PathLike):
        """Announce this tier in directory `path` (made and checked by the caller); OSError if it cannot."""
        self.path = os.fspath(path)
        self.name = f"{LIVE_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        self._fd: int | None = os.open(os.path.join(self.path, self.name), flags, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._checked: tuple[float, bool] | None = None

    def others_live(self) -> bool:
        """Whether another live tier uses this directory (files of dead ones are removed on the way)."""
        now = time.monotonic()
        if self._checked is not None and now - self._checked[0] < RECHECK_S:
            return self._checked[1]
        live = False
        try:
            names = [e.name for e in os.scandir(self.path) if e.name.startswith(LIVE_PREFIX) and e.name != self.name]
        except OSError:
            names = []
        for name in names:
            live = _is_held(os.path.join(self.path, name)) or live
        self._checked = (now, live)
        return live

    def close(self) -> None:
        if self._fd is None:
            return
        try:
            os.unlink(os.path.join(self.path, self.name))
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None


def _is_held(path: str) -> bool:
    """True when a live tier holds `path`'s lock; a file whose lock can be taken is a dead tier's: removed."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False  # gone meanwhile, or not a plain file: nobody holds it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    else:
        try:
            os.unlink(path)  # a dead tier's
        except OSError:
            pass
        return False
    finally:
        os.close(fd)
