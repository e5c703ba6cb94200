"""The disk tier's files: a private directory, files only this user can read, opened without following links.

Primitives: `open_private_directory`, `create_segment`, `open_segment`, `open_checked_segment`, `file_identity`,
`path_identity`, `directory_identity`, `SegmentReplaced`,
`write_private_file`, `read_private_file`, `UnsafeDirectory`, `DIR_MODE`, `FILE_MODE`.

The blocks are KV cache: whoever reads them reads the prompts. So, whatever the umask:

    <path>/            0700, owned by this process's user; refused when owned by another user,
                       or writable by group or others (anyone could plant or swap segment files);
                       a symlink there is followed only when it and its target are this user's
    <path>/*.seg       0600, created O_EXCL | O_NOFOLLOW, opened O_NOFOLLOW
    <path>/lru.order   0600, written to a fresh name (mkstemp: O_EXCL | O_NOFOLLOW) and renamed

A directory of ours that is readable by others (an earlier version made it 0755) is tightened
to 0700, not refused: nobody but its owner could have written into it.
"""
from __future__ import annotations

import errno
import os
import stat
import tempfile

from tierkv.storage.base import TierError

DIR_MODE = 0o700
FILE_MODE = 0o600
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
FileIdentity = tuple[int, int]  # (st_dev, st_ino)


class UnsafeDirectory(TierError):
    """The tier's directory could be read or written by another user."""


class SegmentReplaced(OSError):
    """The file at a segment's path is not the segment this tier wrote or scanned."""


def open_private_directory(path: str) -> FileIdentity:
    """Create `path` (mode 0700) or check the one there; returns its (device, inode). Raises
    UnsafeDirectory naming the path, its owner and mode and what to do, or TierError when it
    cannot be made."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        try:
            os.mkdir(path, DIR_MODE)
        except FileExistsError:
            pass
        link = os.lstat(path)
        if stat.S_ISLNK(link.st_mode) and link.st_uid not in (os.geteuid(), 0):
            raise UnsafeDirectory(_refusal(path, link, " is a symlink made by another user"))
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except UnsafeDirectory:
        raise
    except OSError as exc:
        raise TierError(f"cannot store blocks under {path!r}: {exc}") from exc
    try:
        st = os.fstat(fd)
        problem = directory_refusal(path, link, st)
        if problem is not None:
            raise UnsafeDirectory(problem)
        if stat.S_IMODE(st.st_mode) != DIR_MODE:
            os.fchmod(fd, DIR_MODE)  # ours and only readable by others: tighten
        return st.st_dev, st.st_ino
    except OSError as exc:
        raise TierError(f"cannot store blocks under {path!r}: {exc}") from exc
    finally:
        os.close(fd)


def directory_refusal(path: str, link: os.stat_result, st: os.stat_result) -> str | None:
    """Why the tier refuses directory `path` (`link`: its lstat, `st`: the directory's stat), in the words a
    start uses; None when it is this user's and not writable by group or others (`tierkv config check` asks too)."""
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in (os.geteuid(), 0):
        return _refusal(path, link, " is a symlink made by another user")
    where = f" (the symlink's target {os.path.realpath(path)!r})" if stat.S_ISLNK(link.st_mode) else ""
    if st.st_uid != os.geteuid():
        return _refusal(path, st, f"{where} is owned by another user")
    if st.st_mode & 0o022:
        return _refusal(path, st, f"{where} is writable by group or others")
    return None


def _refusal(path: str, st: os.stat_result, what: str) -> str:
    return (
        f"refusing to store blocks under {path!r}: it{what} (owner {_user(st.st_uid)}, mode "
        f"{stat.filemode(st.st_mode)} {oct(stat.S_IMODE(st.st_mode))}); another user could read the KV cache "
        f"(the prompts) or plant segment files there. The directory must be owned by uid {os.geteuid()} and not "
        f"writable by group or others: remove it and let the tier create it (mode 0700), or set the disk tier's "
        f"path to a directory of your own"
    )


def _user(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def create_segment(path: str) -> int:
    """A new segment file opened for writing (mode 0600); FileExistsError when the name is taken."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | _NOFOLLOW, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
    except OSError:
        os.close(fd)
        raise
    return fd


def open_segment(path: str, flags: int) -> int:
    """An existing segment file, never through a symlink (OSError ELOOP then)."""
    return os.open(path, flags | os.O_CLOEXEC | _NOFOLLOW)


def open_checked_segment(path: str, flags: int, identity: FileIdentity | None) -> int:
    """open_segment, then SegmentReplaced unless the file is `identity` (None: any file)."""
    fd = open_segment(path, flags)
    if identity is not None and file_identity(fd) != identity:
        os.close(fd)
        raise SegmentReplaced(f"{path} is not the segment file this tier wrote")
    return fd


def file_identity(fd: int) -> FileIdentity:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def path_identity(path: str) -> FileIdentity | None:
    """(device, inode) of what is at `path` now (not following a symlink); None when nothing is, also when
    its directory is no longer a directory (ENOTDIR: replaced by a file, nothing can be under it)."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return st.st_dev, st.st_ino


def directory_identity(path: str) -> FileIdentity | None:
    """(device, inode) of the directory `path` names now (through a symlink); None when there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def write_private_file(path: str, data: bytes) -> None:
    """Replace `path` with `data` atomically (mode 0600): written to a fresh name, then renamed."""
    directory, name = os.path.split(path)
    fd, tmp = tempfile.mkstemp(prefix=f"{name}.", suffix=".tmp", dir=directory)  # O_EXCL | O_NOFOLLOW, 0600
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), FILE_MODE)
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_private_file(path: str, max_bytes: int) -> bytes:
    """The bytes of `path`, not through a symlink; OSError when missing, a link, not a regular file (a FIFO planted
    there would block the open's reader for ever) or longer than `max_bytes`."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | _NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, f"{path} is not a regular file")
        if info.st_size > max_bytes:
            raise OSError(errno.EFBIG, f"{path} is {info.st_size} bytes, more than {max_bytes}")
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:  # grown since the fstat
        raise OSError(errno.EFBIG, f"{path} is more than {max_bytes} bytes")
    return data
