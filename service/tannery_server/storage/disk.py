"""The data directory's disk: its free space, durable directory entries, and whether a
driver's error (a file's, SQLite's) means that disk is full."""

from __future__ import annotations

import errno
import os
import sqlite3
from pathlib import Path

#: errnos of a machine out of descriptors or memory.
EXHAUSTED_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOMEM)
#: errnos of a write that found no room (EFBIG, a file size limit, is answered by the caller).
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
#: SQLite's primary result codes for a full disk, an I/O error and a file it cannot open.
_SQLITE_FULL, _SQLITE_IOERR, _SQLITE_CANTOPEN = 13, 10, 14
#: Below this many free bytes, an SQLite I/O error is taken for a full disk (SQLite reports a
#: WAL index it cannot grow, or a -shm file it cannot create, as "disk I/O error").
_NEARLY_FULL = 1 << 20


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on the filesystem of ``path``."""
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


def fsync_directory(path: Path) -> None:
    """Make a directory's entries (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_disk_full(exc: BaseException, data_dir: Path) -> bool:
    """Whether ``exc`` means the disk of ``data_dir`` has no room (ENOSPC, EDQUOT, SQLITE_FULL, or an
    SQLite I/O error on a disk with less than a MiB free)."""
    if isinstance(exc, OSError):
        return exc.errno in _NO_SPACE
    if not isinstance(exc, sqlite3.Error):
        return False
    code = getattr(exc, "sqlite_errorcode", None)
    primary = code & 0xFF if isinstance(code, int) else None
    if primary == _SQLITE_FULL or "database or disk is full" in str(exc):
        return True
    if primary in (_SQLITE_IOERR, _SQLITE_CANTOPEN) or "disk I/O error" in str(exc):
        try:
            return free_bytes(data_dir) < _NEARLY_FULL
        except OSError:
            return False
    return False
