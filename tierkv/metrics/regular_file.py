"""Opening a metrics file (the recorder's JSONL, its readers', a report page) as a regular file only.

Primitives: `open_regular`.

A metrics path may sit in a directory other users can write: a symbolic link planted there would choose the file
written or read, a FIFO would hang the opener, a device would feed it without end. Every opener of such a path
goes through `open_regular`: never through a link (O_NOFOLLOW), never blocking on a FIFO (O_NONBLOCK while it
opens), then the descriptor's own file checked regular (fstat, so no race with a swap after a check by name).
"""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def open_regular(path: str | Path, flags: int, mode: int = 0o600) -> int:
    """A descriptor of `path` opened with `flags` (os.O_* access and creation flags), blocking again once open;
    OSError when it cannot be opened, errno ELOOP for a symbolic link (where the platform says so), EINVAL when
    it is not a regular file (the descriptor closed)."""
    fd = os.open(path, flags | _NOFOLLOW | _NONBLOCK | _CLOEXEC, mode)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd
