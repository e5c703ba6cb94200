"""The deployment's secret, as a start reads it: storage.secret, else the file storage.secret_file names
(created once, mode 0600, where storage.create_secret_file says so). The file must be a regular file of this
user, not accessible by group or others, in a directory only this user (or root) can write; what it holds,
stripped of the ASCII whitespace at its ends, is at least 16 bytes.

Primitives: `secret_path`, `load_secret`, `check_storage_secret`.
"""
from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from tierkv.config import ConfigError

if TYPE_CHECKING:
    from tierkv.config import StorageConfig

SECRET_ENV = "TIERKV_STORAGE__SECRET"
SECRET_FILE_ENV = "TIERKV_STORAGE__SECRET_FILE"
_MIN_SECRET_BYTES = 16


def secret_path(secret_file: str) -> Path:
    """storage.secret_file with `~` expanded; ConfigError naming the key when it cannot be ("~nosuchuser/...")."""
    try:
        return Path(secret_file).expanduser()
    except RuntimeError as exc:
        raise ConfigError("storage.secret_file", secret_file, f"cannot expand it ({exc})") from None


def load_secret(storage: "StorageConfig") -> bytes | None:
    """The deployment's secret from storage.secret, else storage.secret_file; None when neither is set. Either
    way without the ASCII whitespace at its ends (a file's last newline, a pasted value's spaces)."""
    if storage.secret is not None:
        return storage.secret.encode().strip()
    if storage.secret_file is None:
        return None
    path = secret_path(storage.secret_file)
    if not path.exists() and storage.create_secret_file:
        _create_secret_file(path)
    info, data = _read_secret_file(path, storage.create_secret_file)
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError("storage.secret_file", str(path),
                          f"must not be accessible by group or others (mode {stat.S_IMODE(info.st_mode):o}); chmod 600 it")
    _check_owned(path, info)
    if len(data) < _MIN_SECRET_BYTES:
        raise ConfigError("storage.secret_file", str(path), f"expected at least {_MIN_SECRET_BYTES} bytes of secret, "
                          f"found {len(data)}")
    return data


_MAX_SECRET_FILE_BYTES = 64 << 10


def _read_secret_file(path: Path, create: bool) -> tuple[os.stat_result, bytes]:
    """(the file's stat, its content stripped); ConfigError saying why it cannot be read, and what to do."""
    try:
        info = path.stat()
        if stat.S_ISDIR(info.st_mode):
            raise IsADirectoryError
        if not stat.S_ISREG(info.st_mode):  # a FIFO would block the start for ever, /dev/zero fill the memory
            raise ConfigError("storage.secret_file", str(path), "expected a regular file holding the secret; it is "
                              f"{stat.filemode(info.st_mode)[0]!r} (a device, FIFO or socket)")
        if info.st_size > _MAX_SECRET_FILE_BYTES:
            raise ConfigError("storage.secret_file", str(path), f"expected a secret of at most {_MAX_SECRET_FILE_BYTES} "
                              f"bytes; the file holds {info.st_size}")
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            return info, f.read(_MAX_SECRET_FILE_BYTES).strip()
    except IsADirectoryError:
        raise ConfigError("storage.secret_file", str(path), "expected a file holding the secret; it is a directory "
                          "(name a file in it)") from None
    except FileNotFoundError as exc:
        hint = "" if create else ("; copy the secret shared by every process and host using the same disk directory "
                                  "or Redis there, or for a tier of this machine only set "
                                  "storage.create_secret_file: true to create one")
        raise ConfigError("storage.secret_file", str(path), f"expected a readable file ({exc.strerror}){hint}") from None
    except OSError as exc:
        raise ConfigError("storage.secret_file", str(path), f"expected a readable file ({exc.strerror})") from None


def check_storage_secret(storage: "StorageConfig") -> None:
    """What a start that seals a tier refuses about the secret, creating nothing (`tierkv config check`): the
    file read and checked as `load_secret` reads it or, missing with storage.create_secret_file, its nearest
    existing directory writable (a start makes the missing ones below it)."""
    if storage.secret is not None or storage.secret_file is None:
        return
    path = secret_path(storage.secret_file)
    if storage.create_secret_file and not path.exists():
        from tierkv.config.fields import check_writable_dir

        check_writable_dir(str(path), "storage.secret_file", probe=str(path.parent))
        return
    load_secret(storage)


def _check_owned(path: Path, info: os.stat_result) -> None:
    """The secret file, a symlink naming it, and the directory holding it are this user's (or root's), and
    the directory is not writable by others: whoever owns or can replace the file knows the secret."""
    me = os.geteuid()
    link = path.lstat()
    parent = path.resolve().parent.stat()
    for what, st in (("the file", info), ("the symlink", link), ("its directory", parent)):
        if st.st_uid not in (me, 0):
            raise ConfigError("storage.secret_file", str(path), f"{what} is owned by uid {st.st_uid}, not by this "
                              f"user ({me}) or root: its owner knows the secret")
    if parent.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not parent.st_mode & stat.S_ISVTX:
        raise ConfigError("storage.secret_file", str(path), f"its directory is writable by group or others (mode "
                          f"{stat.S_IMODE(parent.st_mode):o}): another user could replace the file")


def _create_secret_file(path: Path) -> None:
    """A random 256-bit secret (hex) in a new file of mode 0600, linked into place whole, so a
    concurrent creator never reads a partial file; the first one linked wins."""
    try:
        missing = [p for p in [path.parent, *path.parent.parents] if not p.exists()]
        for directory in reversed(missing):  # every directory made here is private, not only the last
            directory.mkdir(mode=0o700, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".secret-")  # mode 0600
        try:
            with os.fdopen(fd, "w") as f:
                f.write(os.urandom(32).hex() + "\n")
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    except OSError as exc:
        raise ConfigError("storage.secret_file", str(path), f"could not create it ({exc.strerror}); name a "
                          f"writable path, or set {SECRET_ENV}") from None
