"""The memory a replica holds for payloads on their way to a bucket, bounded across all Stores.

A payload (a pack of small entries above all) is held in memory while it may still end within a
few parts, so that it goes to its digest key in one PUT at seal (:mod:`.s3_uploads`). Held per
call, that grew with the number of concurrent Stores (issue #43: 8 packed Stores took a replica
from 113 to 729 MiB). Now every byte held so is taken from one :class:`MemoryBudget` of the
replica (``--upload-memory``); a payload that finds no room **spills**: what it held goes to a
:class:`Spill` (an unnamed temporary file in the data directory, gone with the process), and so
does the rest of it. At seal a spilled payload is uploaded from its file, straight to its digest
key, in ranges (:class:`FileRange`) that botocore reads as it sends: no part is copied into
memory. Nothing waits for room, so no Store can hold up another.
"""

from __future__ import annotations

import errno
import io
import logging
import os
import tempfile
import threading
from pathlib import Path

from .errors import StorageFull, StorageUnavailable
from .private import private_directory

log = logging.getLogger("tannery_server.storage")
#: Memory is taken from the budget in steps of at least this many bytes (fewer calls to its lock).
STEP = 1 << 20


class MemoryBudget:
    """Bytes a replica may hold for uploads, shared by every payload being written; thread-safe."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._used = 0
        #: The most bytes held at once since the start (a measure, and what tests check).
        self.peak = 0
        #: Payloads that spilled to a file for want of room.
        self.spills = 0
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        return self._used

    def try_take(self, size: int) -> bool:
        """Take ``size`` bytes if they fit under the limit; False (nothing taken) if not. Never waits."""
        with self._lock:
            if self._used + size > self.limit:
                return False
            self._used += size
            self.peak = max(self.peak, self._used)
            return True

    def give(self, size: int) -> None:
        """Give back ``size`` bytes taken."""
        with self._lock:
            self._used -= size

    def spilled(self, where: Path | None) -> None:
        """One more payload spilled (the first one is logged: the bound is being reached)."""
        with self._lock:
            self.spills += 1
            first = self.spills == 1
        if first:
            log.info("upload memory full (%d bytes held): payloads spill to unnamed files in %s until there is "
                     "room (--upload-memory sets it)", self.limit, where or tempfile.gettempdir())


class Spill:
    """A payload's bytes in an unnamed temporary file of ``directory`` (removed by the OS when
    closed or when the process dies: nothing to recover)."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        try:
            if directory is not None:
                private_directory(directory)  # a replica's data directory holds only its socket otherwise
            self._file = tempfile.TemporaryFile(dir=directory, prefix="tannery-spill-")
        except OSError as exc:
            raise _failure(directory, exc) from exc
        self.size = 0

    def write(self, data: memoryview | bytes) -> None:
        view = memoryview(data).cast("B")
        try:
            while view.nbytes:
                written = os.pwrite(self._file.fileno(), view, self.size)
                self.size += written
                view = view[written:]
        except OSError as exc:
            raise _failure(self.directory, exc) from exc

    def read_into(self, offset: int, buffer: memoryview) -> None:
        """Fill ``buffer`` from ``offset`` of the file."""
        done = 0
        while done < buffer.nbytes:
            got = os.preadv(self._file.fileno(), [buffer[done:]], offset + done)
            if got == 0:
                raise StorageUnavailable(f"spill file in {self.directory}: ended at {offset + done} of {self.size}")
            done += got

    def range(self, offset: int, size: int) -> "FileRange":
        return FileRange(self._file.fileno(), offset, size)

    def close(self) -> None:
        self._file.close()


def _failure(directory: Path | None, exc: OSError) -> Exception:
    where = directory or tempfile.gettempdir()
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return StorageFull(f"no room in {where} for a payload spilled there on its way to the bucket "
                           f"({exc.strerror}): free space there, or give the server more --upload-memory")
    return StorageUnavailable(f"cannot spill a payload to {where} on its way to the bucket: {exc.strerror or exc}")


class _Range(io.RawIOBase):
    """``size`` bytes as a seekable file of their own: a request body botocore reads (to checksum
    it, then to send it, again on a retry) by pieces, never whole."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self._size, self._at = size, 0

    def _read_at(self, at: int, view: memoryview) -> int:
        raise NotImplementedError

    def __len__(self) -> int:
        return self._size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: self._size}[whence]
        self._at = min(max(base + offset, 0), self._size)
        return self._at

    def readinto(self, buffer) -> int:  # type: ignore[override]
        view = memoryview(buffer).cast("B")
        n = min(view.nbytes, self._size - self._at)
        if n <= 0:
            return 0
        got = self._read_at(self._at, view[:n])
        self._at += got
        return got

    def read(self, size: int | None = -1) -> bytes:
        n = self._size - self._at if size is None or size < 0 else min(size, self._size - self._at)
        if n <= 0:
            return b""
        data = bytearray(n)
        got = self.readinto(data)
        return bytes(data[:got])


class FileRange(_Range):
    """``size`` bytes of a file from ``offset``, read with ``pread`` so that ranges of one file
    are read by several threads at once."""

    def __init__(self, fd: int, offset: int, size: int) -> None:
        super().__init__(size)
        self._fd, self._offset = fd, offset

    def _read_at(self, at: int, view: memoryview) -> int:
        return os.preadv(self._fd, [view], self._offset + at)


class MemoryRange(_Range):
    """Bytes in memory (a part held in an anonymous map) as a request body of their own."""

    def __init__(self, data: memoryview) -> None:
        super().__init__(data.nbytes)
        self._data = data

    def _read_at(self, at: int, view: memoryview) -> int:
        view[:] = self._data[at:at + view.nbytes]
        return view.nbytes


__all__ = ["FileRange", "MemoryBudget", "MemoryRange", "STEP", "Spill"]
