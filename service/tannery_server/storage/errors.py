"""The storage's own failures, and how a driver's error is told to mean a full disk."""

from __future__ import annotations

import errno
import sqlite3
from pathlib import Path

from ..failures import LimitExceeded, Malformed, Unavailable
from .reserve import free_bytes


class StorageFull(LimitExceeded):
    """The disk of the data directory is full (RESOURCE_EXHAUSTED): the message names it and the remedy."""


class StorageUnavailable(Unavailable):
    """The storage failed to answer (an I/O or database error): UNAVAILABLE, worth a retry."""


class DigestMismatch(Malformed):
    """A payload hashed to another SHA-256 than the one its sender gave ahead of it
    (INVALID_ARGUMENT: the bytes changed on the way, or the sender hashed something else)."""


#: errnos of a machine out of descriptors or memory.
EXHAUSTED_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOMEM)
#: errnos of a write that found no room (EFBIG, a file size limit, is answered by the caller).
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
#: SQLite's primary result codes for a full disk, an I/O error and a file it cannot open.
_SQLITE_FULL, _SQLITE_IOERR, _SQLITE_CANTOPEN = 13, 10, 14
#: Below this many free bytes, an SQLite I/O error is taken for a full disk (SQLite reports a
#: WAL index it cannot grow, or a -shm file it cannot create, as "disk I/O error").
_NEARLY_FULL = 1 << 20


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
