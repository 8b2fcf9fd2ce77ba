"""Storage as the server uses it: a catalog and a blob store, kept consistent.

It owns the rules that span both: a blob is durable before the catalog references it;
blobs nobody references are collected; a blob pinned by a call in flight (a Store that
reuses it, a Fetch that reads it) is never collected under it; and one server at a time
uses a data directory.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence, TypeVar

from .base import ArchiveRecord, BlobFile, BlobInfo, BlobStore, Catalog, EntryRecord, Limits, TempBlob
from .file_blobs import FileBlobStore
from .integrity import BLOCK_SIZE, PayloadDigest, verify_digest
from .sqlite_catalog import SqliteCatalog

log = logging.getLogger("tannery_server.storage")
T = TypeVar("T")


class DataDirectoryInUse(RuntimeError):
    """Another server holds the data directory's lock."""


class DataDirectoryLock:
    """An exclusive ``flock`` on ``<data_dir>/lock``, held while the server runs."""

    def __init__(self, data_dir: Path) -> None:
        self.path = Path(data_dir) / "lock"
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(self._fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(self._fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise DataDirectoryInUse(
                    f"data directory {data_dir} is in use by another tannery server (pid {holder})"
                ) from None
            raise
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        if self._fd >= 0:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = -1


@dataclass(frozen=True)
class Collected:
    blobs: int = 0
    bytes: int = 0


#: Hashes pieces of payloads while their bytes are written (hashlib and zlib release the
#: GIL, so hashing one piece overlaps writing it and receiving the next).
_HASHING = ThreadPoolExecutor(max(2, os.cpu_count() or 2), thread_name_prefix="tannery-hash")
#: Pieces smaller than this are hashed inline: a thread hand-off would cost more.
HASH_INLINE_BELOW = 256 << 10


class PayloadWriter:
    """One payload going to a temporary blob, hashed as it is written.

    A large piece is hashed by another thread while this one writes it; that hash is
    awaited before the next piece is hashed (so pieces are hashed in order) and by
    :meth:`finish`. At most one piece per payload is in flight.
    """

    def __init__(self, temp: TempBlob, block_size: int) -> None:
        self.temp = temp
        self.digest = PayloadDigest(block_size)
        #: Bytes written so far.
        self.size = 0
        self._hashing: Future | None = None

    def write(self, data: memoryview | bytes) -> None:
        view = memoryview(data)
        self._wait()
        if view.nbytes < HASH_INLINE_BELOW:
            self.digest.update(view)
        else:
            self._hashing = _HASHING.submit(self.digest.update, view)
        self.temp.write(view)
        self.size += view.nbytes

    def finish(self) -> BlobInfo:
        """The payload's digest and block checksums, once every piece is hashed."""
        self._wait()
        return self.digest.finish()

    def _wait(self) -> None:
        if self._hashing is not None:
            hashing, self._hashing = self._hashing, None
            hashing.result()


class Storage:
    def __init__(self, catalog: Catalog, blobs: BlobStore, lock: DataDirectoryLock | None = None) -> None:
        self.catalog = catalog
        self.blobs = blobs
        self._lock = lock
        self._gc_lock = threading.Lock()
        self._pins: Counter[str] = Counter()
        #: Digests collection skipped because they were pinned; collected when unpinned.
        self._deferred: set[str] = set()

    @classmethod
    def open_local(cls, data_dir: Path) -> "Storage":
        """The embedded storage in ``data_dir``: a SQLite catalog and blob files, recovered."""
        data_dir = Path(data_dir)
        data_dir.mkdir(parents=True, exist_ok=True)
        lock = DataDirectoryLock(data_dir)
        try:
            storage = cls(SqliteCatalog(data_dir / "catalog.sqlite3"), FileBlobStore(data_dir), lock)
            storage.recover()
        except BaseException:
            lock.release()
            raise
        return storage

    def recover(self) -> None:
        """Remove what an interrupted run left: temporary blobs, and blobs no archive references."""
        temporary = self.blobs.clear_temporary()
        referenced = self.catalog.referenced_digests()
        orphans = [d for d in self.blobs.digests() if d not in referenced]
        freed = sum(self.blobs.remove(d) for d in orphans)
        rows = self.catalog.forget_unreferenced_blobs()
        if temporary or orphans or rows:
            log.info(
                "recovery: removed %d temporary files, %d unreferenced blobs (%d bytes), %d blob records",
                temporary, len(orphans), freed, rows,
            )

    def close(self) -> None:
        self.catalog.close()
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    # Pins -------------------------------------------------------------------------------

    def pinned(self, lookup: Callable[[], T], digests_of: Callable[[T], Iterable[str]]) -> T:
        """Run a catalog ``lookup`` and pin the digests it found, with no collection in between.

        The caller must :meth:`release` ``digests_of(result)`` when done with them.
        """
        with self._gc_lock:
            result = lookup()
            self._pins.update(digests_of(result))
            return result

    def release(self, digests: Iterable[str], collect: bool = False) -> Collected:
        """Unpin digests; collect those that nothing references (``collect``) or whose
        collection was deferred while they were pinned."""
        with self._gc_lock:
            candidates = []
            for digest in digests:
                self._pins[digest] -= 1
                if self._pins[digest] <= 0:
                    del self._pins[digest]
                    if collect or digest in self._deferred:
                        self._deferred.discard(digest)
                        candidates.append(digest)
            return self._collect_locked(candidates)

    def collect(self, candidates: Iterable[str]) -> Collected:
        with self._gc_lock:
            return self._collect_locked(candidates)

    def _collect_locked(self, candidates: Iterable[str]) -> Collected:
        free = []
        for digest in dict.fromkeys(candidates):
            if self._pins.get(digest):
                self._deferred.add(digest)
            else:
                free.append(digest)
        if not free:
            return Collected()
        gone = self.catalog.unreferenced(free)
        freed = sum(self.blobs.remove(b.digest) for b in gone)
        self.catalog.forget_blobs(b.digest for b in gone)
        return Collected(len(gone), freed)

    # Writing ----------------------------------------------------------------------------

    def new_payload(self) -> PayloadWriter:
        return PayloadWriter(self.blobs.create(), BLOCK_SIZE)

    def publish(self, writer: PayloadWriter) -> BlobInfo:
        """Make a written payload a blob, pinned until :meth:`release`."""
        blob = writer.finish()
        with self._gc_lock:
            self._pins[blob.digest] += 1
        try:
            writer.temp.publish(blob.digest)
        except BaseException:
            self.release([blob.digest], collect=True)
            raise
        return blob

    def commit_archive(
        self, name: str, entries: Sequence[EntryRecord], blobs: Sequence[BlobInfo], replace: bool
    ) -> ArchiveRecord:
        """Record an archive whose (pinned) blobs are all published, once they are durable."""
        self.blobs.make_durable(b.digest for b in blobs)
        record, released = self.catalog.commit_archive(name, entries, blobs, replace, time.time_ns())
        self.collect(released)
        return record

    def union(self, target: str, sources: Sequence[tuple[str, str]], replace: bool, limits: Limits) -> ArchiveRecord:
        record, released = self.catalog.union(target, sources, replace, time.time_ns(), limits)
        self.collect(released)
        return record

    def delete(self, name: str) -> tuple[ArchiveRecord | None, Collected]:
        record, released = self.catalog.delete_archive(name)
        return record, self.collect(released)

    # Reading ----------------------------------------------------------------------------

    def open_blob(self, digest: str) -> BlobFile:
        return self.blobs.open(digest)

    def scrub(self) -> list[str]:
        """Re-hash every referenced blob and compare it with its name (the SHA-256 a Fetch no
        longer recomputes: it checks the cheaper block CRCs); the digests of blobs that are
        missing, of the wrong size, or no longer match."""
        bad = []
        for digest in sorted(self.catalog.referenced_digests()):
            info = self.catalog.blob(digest)
            try:
                blob = self.blobs.open(digest)
            except FileNotFoundError:
                bad.append(digest)
                continue
            try:
                if info is None or blob.size != info.size or not verify_digest(blob.read_into, blob.size, digest):
                    bad.append(digest)
            finally:
                blob.close()
        return bad
