"""Content-addressed blobs as files: ``blobs/ab/abcdef...`` holds exactly one payload's bytes."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
import uuid
from pathlib import Path
from typing import Iterable, Iterator

from .base import BlobFile, BlobStore, TempBlob
from .disk import fsync_directory
from .errors import StorageUnavailable
from .private import PRIVATE_DIR, open_private, private_directory

_DIGEST = re.compile(r"[0-9a-f]{64}")
#: Bytes of a temporary blob written between two requests to the kernel to start writing them
#: to disk: by the fsync that makes the blob durable most of it is there already, instead of
#: all of it waiting in the page cache for that fsync (about 0.45 s per GiB here).
WRITEBACK_BYTES = 8 << 20


def _writeback_starter():
    """Linux's ``sync_file_range(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE)``, which starts
    writing a file's dirty pages back and returns (no durability: ``fsync`` still gives
    that); None where libc has none (then the fsync does all the writing)."""
    try:
        function = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    function.restype = ctypes.c_int
    sync_file_range_write = 2
    return lambda fd, offset, size: function(fd, offset, size, sync_file_range_write)


_start_writeback = _writeback_starter()


class FileBlob(BlobFile):
    """An open blob file, read with ``pread`` so many readers share nothing."""

    local_file = True

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_RDONLY)
        self.size = os.fstat(self._fd).st_size

    def read(self, offset: int, size: int) -> bytes:
        data = os.pread(self._fd, size, offset)
        while len(data) < size:  # pread may return less near signals; a short file is caught by the caller
            more = os.pread(self._fd, size - len(data), offset + len(data))
            if not more:
                break
            data += more
        return data

    def read_into(self, buffer: memoryview, offset: int) -> int:
        """Fill ``buffer`` from ``offset`` with no intermediate copy; the bytes read (fewer at the end)."""
        filled = 0
        while filled < len(buffer):
            got = os.preadv(self._fd, [buffer[filled:]], offset + filled)
            if not got:
                break
            filled += got
        return filled

    def fileno(self) -> int:
        """The open file (the same-host data path passes it to the client; sendfile reads it)."""
        return self._fd

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class FileTempBlob(TempBlob):
    """A blob written to ``tmp/`` and renamed into place once fsynced."""

    def __init__(self, store: "FileBlobStore") -> None:
        self._store = store
        self.path = store.tmp / f"{uuid.uuid4().hex}.part"
        self._fd = open_private(self.path, os.O_WRONLY | os.O_EXCL)
        self._written = 0  # bytes written so far
        self._unstarted = 0  # where the bytes whose writeback has not been asked for start

    def write(self, data: memoryview | bytes) -> None:
        view = memoryview(data)
        while view.nbytes:
            written = os.write(self._fd, view)
            view = view[written:]
            self._written += written
        if self._written - self._unstarted >= WRITEBACK_BYTES and _start_writeback is not None:
            _start_writeback(self._fd, self._unstarted, self._written - self._unstarted)
            self._unstarted = self._written

    def seal(self, digest: str) -> bool:
        # Not fsynced here: the kernel writes it back while later payloads arrive, and
        # make_durable() waits for it before the catalog may reference it. A crash before
        # that leaves an unreferenced file, which start-up removes.
        os.close(self._fd)
        self._fd = -1
        target = self._store.path(digest)
        if target.exists():
            self.path.unlink(missing_ok=True)
            return False
        try:
            target.parent.mkdir(mode=PRIVATE_DIR)
            self._store.new_directories.add(target.parent)  # blobs/ itself needs an fsync now
        except FileExistsError:
            pass
        os.rename(self.path, target)
        return True

    def discard(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self.path.unlink(missing_ok=True)


class FileBlobStore(BlobStore):
    """Blobs under ``root/blobs``, named by SHA-256; temporary files under ``root/tmp``."""

    #: A digest given ahead saves nothing here (see :meth:`create`).
    wants_digests = False

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.blobs = self.root / "blobs"
        self.tmp = self.root / "tmp"
        private_directory(self.root)
        private_directory(self.blobs)
        private_directory(self.tmp)
        #: Subdirectories of ``blobs`` created since ``blobs`` was last fsynced.
        self.new_directories: set[Path] = set()

    def path(self, digest: str) -> Path:
        if not _DIGEST.fullmatch(digest):
            raise ValueError(f"not a SHA-256 hex digest: {digest!r}")
        return self.blobs / digest[:2] / digest

    def create(self, expected: str | None = None) -> FileTempBlob:
        """A temporary file (``expected`` changes nothing: a rename publishes it at no cost)."""
        return FileTempBlob(self)

    def make_durable(self, digests: Iterable[str]) -> None:
        """fsync these blobs (written by this call or found already there) and their directories."""
        directories = set()
        for digest in dict.fromkeys(digests):
            path = self.path(digest)
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            directories.add(path.parent)
        for directory in sorted(directories):
            fsync_directory(directory)
        created = directories & self.new_directories
        if created:  # an fsync of blobs/ after the mkdir makes the new subdirectory durable
            fsync_directory(self.blobs)
            self.new_directories -= created

    def open(self, digest: str, size: int | None = None) -> FileBlob:
        return FileBlob(self.path(digest))

    def remove(self, digest: str) -> int:
        path = self.path(digest)
        try:
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            return 0
        return size

    def modified_ns(self, digest: str) -> int:
        return self.path(digest).stat().st_mtime_ns

    def digests(self) -> Iterator[str]:
        for sub in self.blobs.iterdir():
            if sub.is_dir():
                for blob in sub.iterdir():
                    if _DIGEST.fullmatch(blob.name):
                        yield blob.name

    def temporaries(self) -> list[str]:
        """The names of the temporary blobs there now (Stores in flight, or left by a crash)."""
        return sorted(p.name for p in self.tmp.iterdir())

    def clear_temporary(self, older_than_ns: int | None = None) -> int:
        count = 0
        for leftover in self.tmp.iterdir():
            try:
                if older_than_ns is not None and leftover.stat().st_mtime_ns >= older_than_ns:
                    continue
                leftover.unlink()
            except FileNotFoundError:
                continue
            count += 1
        return count

    def check(self) -> None:
        """StorageUnavailable when the blob directory cannot be read."""
        try:
            os.stat(self.blobs)
        except OSError as exc:
            raise StorageUnavailable(f"blob directory {self.blobs} unreadable: {exc.strerror or exc}") from exc
