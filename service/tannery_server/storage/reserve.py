"""Space kept back in the data directory so that a full disk never locks the operator out.

A Delete is a catalog write before it frees anything: SQLite appends the pages it changes
to the WAL, so on a disk with no free byte it fails ("database or disk is full") and no
space can be freed through the API. The reserve is a file, ``<data_dir>/reserve``, of
real (allocated) blocks. Storage releases it to let a Delete's catalog write through on a
full disk, and re-creates it once space is back; while it is missing, Stores and Unions
are refused, so the space it held stays for Deletes.

Its size follows the catalog: one transaction's WAL holds each page it changes once, so
a Delete never appends more than the database file's size (what it appends in practice:
docs/benchmarks.md, "Server memory"), plus the WAL index (32 KiB per 4096 pages). The
reserve is the catalog's size plus :data:`SLACK`, at least :data:`MINIMUM`, in whole
MiB, and at most the configured cap (64 MiB by default: a Delete of any archive in a
catalog up to that size), 1/32 of the filesystem and the process's file size limit.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import threading
from pathlib import Path

from .disk import free_bytes, fsync_directory

log = logging.getLogger("tannery_server.storage")

MiB = 1 << 20
#: The reserve's size when the catalog is small.
MINIMUM = MiB
#: Beyond the catalog's size: the WAL index and frame headers.
SLACK = 256 << 10
#: The default cap (``TANNERY_RESERVE_BYTES``).
DEFAULT_CAP = 64 * MiB
#: At most this fraction of the filesystem is held back (tiny disks in tests and containers).
FRACTION = 32
#: errnos that mean "no room" when the reserve is written.
NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _file_size_limit() -> int:
    soft, _hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 62


class SpaceReserve:
    """``<data_dir>/reserve``: held, released for a Delete on a full disk, re-created after.

    :attr:`held` is what writers check (a bool, read without the lock): False only when
    the reserve is missing for lack of space. A cap of 0 turns the reserve off (then it
    is always "held"). Every method is thread-safe.
    """

    def __init__(self, data_dir: Path, catalog_file: Path, cap: int = DEFAULT_CAP) -> None:
        self.data_dir = Path(data_dir)
        self.path = self.data_dir / "reserve"
        self._catalog_file = Path(catalog_file)
        self.cap = max(0, cap)
        #: Held by a Delete while it writes into the released reserve's space (ensure waits).
        self.lock = threading.RLock()
        self._size = self._current_size()
        self.held = True

    @property
    def size(self) -> int:
        """Bytes the reserve holds now."""
        return self._size

    def target(self) -> int:
        """The size the reserve should have for the catalog as it is now (see the module)."""
        if self.cap == 0:
            return 0
        try:
            catalog = self._catalog_file.stat().st_size
        except FileNotFoundError:
            catalog = 0
        stats = os.statvfs(self.data_dir)
        wanted = -(-max(MINIMUM, catalog + SLACK) // MiB) * MiB
        return min(wanted, self.cap, stats.f_blocks * stats.f_frsize // FRACTION, _file_size_limit())

    def ensure(self) -> bool:
        """Create or grow the reserve to :meth:`target` when there is room; whether it is held.

        Called before every write that takes space (a payload, an archive's commit, a
        union): writes go on only while the reserve is held.
        """
        with self.lock:
            target = self.target()
            if self._size >= target:
                self.held = True
                return True
            self.held = self._grow(target)
            return self.held

    def release(self) -> int:
        """Delete the reserve (a Delete needs its space); the bytes given back."""
        with self.lock:
            freed, self._size = self._size, 0
            self.held = self.cap == 0
            self.path.unlink(missing_ok=True)
            if freed:
                log.warning("the disk of %s is full: released the %d-byte space reserve so that a catalog write "
                            "can go through", self.data_dir, freed)
            return freed

    def open(self) -> None:
        """At start-up: create or grow the reserve, or warn that the disk has no room for it."""
        with self.lock:
            self._size = self._current_size()
            if not self.ensure():
                log.warning("the disk of %s has %d bytes free, too few for the %d-byte space reserve that lets "
                            "Delete work on a full disk: Stores are refused until archives are deleted",
                            self.data_dir, free_bytes(self.data_dir), self.target())

    def _current_size(self) -> int:
        try:
            return self.path.stat().st_size
        except FileNotFoundError:
            return 0

    def _grow(self, target: int) -> bool:
        """Extend (or create) the reserve to ``target`` allocated bytes, fsynced; False when there is no room.

        A failed or interrupted extension leaves the reserve at its old size or between
        the two (the size is read back at start), never a reserve larger than it says.
        """
        if free_bytes(self.data_dir) < target - self._size:
            return False
        created = self._size == 0
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            try:
                _allocate(fd, self._size, target)
                os.fsync(fd)
            except OSError as exc:
                os.ftruncate(fd, self._size)  # give back a partial allocation
                if exc.errno in NO_ROOM:
                    return False
                log.warning("cannot create the space reserve %s (%s): going on without it; a Delete on a full "
                            "disk may then fail", self.path, exc)
                self.cap = 0
                return True
        finally:
            os.close(fd)
        if created:
            fsync_directory(self.data_dir)
        self._size = target
        return True


def _allocate(fd: int, start: int, end: int) -> None:
    """Allocate bytes ``start..end`` of a file (fallocate; zeros written where it is not supported)."""
    try:
        os.posix_fallocate(fd, start, end - start)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        block = bytes(MiB)
        for offset in range(start, end, MiB):
            os.pwrite(fd, block[: min(MiB, end - offset)], offset)
