"""The embedded storage: a SQLite catalog and blob files in one data directory (or a bucket's
blobs), for one server; the sibling of :class:`~.shared_storage.SharedStorage` under
:class:`~.core.StorageBase`.

It owns the rules that span catalog and blobs: a blob is durable before the catalog references it;
blobs nobody references are collected; a blob pinned by a call in flight (a Store that
reuses it, a Fetch that reads it) is never collected under it; one server at a time
uses a data directory; and a full disk never locks the operator out: a space reserve
(:mod:`.reserve`) is released to let a Delete through, and writes that take space are
refused (:class:`StorageFull`) while it cannot be held.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence, TypeVar

from .base import ArchiveLimits, MoveNote, ArchiveRecord, BlobInfo, BlobStore, Catalog, EntryRecord
from .blob_journal import NAME as JOURNAL_NAME, BlobJournal
from .core import Collected, StorageBase
from .disk import is_disk_full
from .errors import StorageFull
from .file_blobs import FileBlobStore
from .integrity import BLOCK_SIZE
from .lock import DataDirectoryLock
from .payload_writer import PayloadWriter
from .private import create_private_file, private_directory
from .reserve import DEFAULT_CAP, SpaceReserve
from .sqlite_catalog import SqliteCatalog

log = logging.getLogger("tannery_server.storage")
T = TypeVar("T")


def _journal(data_dir: Path) -> BlobJournal | None:
    """The data directory's blob journal; None when it cannot be opened (a full disk): this
    run's recovery reads every blob, as before the journal, and so does the next one (the file
    is removed, since this run notes nothing in it)."""
    try:
        return BlobJournal(data_dir)
    except OSError as exc:
        log.warning("blob journal: cannot open it in %s (%s): start-up reads every blob", data_dir, exc)
        with contextlib.suppress(OSError):
            (data_dir / JOURNAL_NAME).unlink(missing_ok=True)
        return None


class Storage(StorageBase):
    """The embedded storage (see the module): pins in memory, collection at once, a space reserve."""

    def __init__(self, catalog: Catalog, blobs: BlobStore, lock: DataDirectoryLock | None = None,
                 reserve: SpaceReserve | None = None, data_dir: Path | None = None,
                 journal: BlobJournal | None = None) -> None:
        super().__init__(catalog, blobs)
        #: The blobs that may be left unreferenced by this run (None: recovery checks every blob).
        self.journal = journal
        self._lock = lock
        #: The space kept for Deletes on a full disk (None: none kept, writes never refused for it).
        self.reserve = reserve
        #: Where the data lives, named in the errors of a full disk.
        self.data_dir = Path(data_dir).resolve() if data_dir is not None else None
        self._gc_lock = threading.Lock()
        self._pins: Counter[str] = Counter()
        #: Digests collection skipped because they were pinned; collected when unpinned.
        self._deferred: set[str] = set()

    @classmethod
    def open_local(cls, data_dir: Path, reserve_bytes: int = DEFAULT_CAP, blobs: BlobStore | None = None,
                   recovering: bool = True) -> "Storage":
        """The embedded storage in ``data_dir``: a SQLite catalog and blob files (or ``blobs``),
        recovered (unless ``recovering`` is False: ``tannery scrub`` reports what recovery would
        remove), with a space reserve of up to ``reserve_bytes`` (0: none).

        On a full disk the catalog may not open (SQLite creates its WAL index and WAL
        files): then the reserve is released and the open tried once more.
        """
        data_dir = Path(data_dir)
        private_directory(data_dir)
        lock = DataDirectoryLock(data_dir)
        try:
            path = data_dir / "catalog.sqlite3"
            create_private_file(path)  # before SQLite: its WAL takes this file's mode
            reserve = SpaceReserve(data_dir, path, reserve_bytes)
            try:
                catalog = SqliteCatalog(path)
            except sqlite3.Error as exc:
                if not (is_disk_full(exc, data_dir) and reserve.release()):
                    raise
                catalog = SqliteCatalog(path)
            # A tool that does not recover (tannery scrub) keeps no journal: the next server's
            # start-up then still knows whether this directory ever had one.
            storage = cls(catalog, blobs if blobs is not None else FileBlobStore(data_dir), lock, reserve, data_dir,
                          _journal(data_dir) if recovering else None)
            try:
                if recovering:
                    storage.recover()
                reserve.open()
            except BaseException:
                catalog.close()
                raise
        except BaseException:
            lock.release()
            raise
        return storage

    def recover(self) -> None:
        """Remove what an interrupted run left: temporary blobs, and blobs no archive references
        among those the journal noted (:mod:`.blob_journal`): the time it takes depends on what
        was in flight, not on the size of the store. Without a journal (none kept, or a data
        directory from before it) every blob and every entry is read once."""
        temporary = self.blobs.clear_temporary()
        if self.journal is not None and self.journal.existed:
            gone = self.catalog.unreferenced(self.journal.left())
            orphans = [b.digest for b in gone]
            freed = sum(self.blobs.remove(d) for d in orphans)
            recorded = [b.digest for b in gone if b.block_size]
            if recorded:
                self._write_catalog(lambda: self.catalog.forget_blobs(recorded), use_reserve=True)
            rows = len(recorded)
        else:
            referenced = self.catalog.referenced_digests()
            orphans = [d for d in self.blobs.digests() if d not in referenced]
            freed = sum(self.blobs.remove(d) for d in orphans)
            rows = self._write_catalog(self.catalog.forget_unreferenced_blobs, use_reserve=True)
        if self.journal is not None:
            self.journal.empty()
        if temporary or orphans or rows:
            log.info(
                "recovery: removed %d temporary files, %d unreferenced blobs (%d bytes), %d blob records",
                temporary, len(orphans), freed, rows,
            )

    def close(self) -> None:
        super().close()
        if self.journal is not None:
            self.journal.close()
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    # A full disk ------------------------------------------------------------------------

    def check_room(self) -> None:
        """StorageFull unless the space reserve is held (it is released while the disk is full)."""
        if self.reserve is not None and not self.reserve.held:
            raise self._reserve_missing()

    def _ensure_room(self) -> None:
        """Create or grow the space reserve before a write that takes space; StorageFull when it cannot be."""
        if self.reserve is not None and not self.reserve.ensure():
            raise self._reserve_missing()

    def _reserve_missing(self) -> StorageFull:
        target = self.reserve.target() if self.reserve is not None else 0
        return StorageFull(f"storage is full: no space left on device in {self.data_dir} ({self._free_text()}, "
                           f"fewer than the {target} bytes kept in reserve so that Delete works on a full disk): "
                           "delete archives to free space")

    def _write_catalog(self, write: Callable[[], T], use_reserve: bool = False) -> T:
        """Run a catalog write, answering a full disk with StorageFull.

        With ``use_reserve`` (a Delete, recovery) a full disk releases the space reserve
        and the write is tried once more: freeing space must stay possible.
        """
        try:
            return write()
        except (OSError, sqlite3.Error) as exc:
            error = self.full_error(exc)
            if error is exc:
                raise
            if not (use_reserve and self.reserve is not None):
                raise error from exc
        with self.reserve.lock:  # no writer re-creates the reserve before this write has its space
            released = self.reserve.release()
            try:
                return write()
            except (OSError, sqlite3.Error) as exc:
                if self.full_error(exc) is exc:
                    raise
                raise self._no_room_even_so(released) from exc

    def _no_room_even_so(self, released: int) -> StorageFull:
        """The failure of a Delete's catalog write that found no room even with the reserve's space."""
        if released:
            why = f"even with the {released}-byte space reserve released, the catalog write found no room"
        elif self.reserve is not None and self.reserve.cap == 0:
            why = "no space reserve is kept (TANNERY_RESERVE_BYTES is 0) and the catalog write found no room"
        else:
            why = "the space reserve is already used up and the catalog write found no room"
        return StorageFull(f"storage is full: no space left on device in {self.data_dir} ({self._free_text()}): "
                           f"{why}; free space on that disk outside tannery (or raise TANNERY_RESERVE_BYTES)")

    # Pins -------------------------------------------------------------------------------

    def pinned(self, lookup: Callable[[], T], digests_of: Callable[[T], Iterable[str]]) -> T:
        """Run a catalog ``lookup`` and pin the digests it found, with no collection in between.

        The caller must :meth:`release` ``digests_of(result)`` when done with them.
        """
        with self._gc_lock:
            result = lookup()
            self._pins.update(digests_of(result))
            return result

    def release(self, digests: Iterable[str], collect: bool = False, holder: str | None = None) -> Collected:
        """Unpin digests; collect those that nothing references (``collect``) or whose
        collection was deferred while they were pinned. (``holder``: the Store that sealed
        them, which a shared store's leases name; pins here are counted per digest.)"""
        with self._gc_lock:
            candidates, settled = [], []
            for digest in digests:
                self._pins[digest] -= 1
                if self._pins[digest] <= 0:
                    del self._pins[digest]
                    if collect or digest in self._deferred:
                        self._deferred.discard(digest)
                        candidates.append(digest)
                        continue
                settled.append(digest)
            if holder is not None:  # a Store's sealed blobs: committed, or left to their other holders
                self._settled(settled)
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
        recorded = [b.digest for b in gone if b.block_size]  # 0: a file no transaction recorded
        if recorded:
            try:
                self._write_catalog(lambda: self.catalog.forget_blobs(recorded), use_reserve=True)
            except StorageFull as exc:
                # The files are gone and nothing references the rows: the next collection
                # of these digests, or start-up (they stay in the journal), forgets them.
                log.warning("could not forget %d removed blobs in the catalog: %s", len(recorded), exc)
                free = [d for d in free if d not in set(recorded)]
        self._settled(free)
        return Collected(len(gone), freed)

    # The journal ------------------------------------------------------------------------

    def _noted(self, digests: Iterable[str]) -> list[str]:
        """``digests`` written in the journal before a step that could leave them unreferenced."""
        return self.journal.note(digests) if self.journal is not None else []

    def _settled(self, digests: Iterable[str]) -> None:
        if self.journal is not None:
            self.journal.done(digests)

    def _noted_archive(self, name: str) -> list[str]:
        """The blobs of archive ``name`` (if it exists) noted before a write that may release them."""
        if self.journal is None:
            return []
        return self._noted(e.blob or e.digest for e in self.catalog.entries_under(name, ""))

    def _released(self, noted: list[str], released: Iterable[str]) -> Collected:
        """Collect what a write released; the blobs noted before it that it did not release are settled."""
        released = list(released)
        self._settled(set(noted).difference(released))
        return self.collect(released)

    # Writing ----------------------------------------------------------------------------

    def new_payload(self, expected: str | None = None, block_size: int = BLOCK_SIZE) -> PayloadWriter:
        """A temporary blob for one payload (``expected``: its SHA-256 given ahead, which it must
        hash to); StorageFull when the disk has no room (for the reserve either)."""
        self._ensure_room()
        try:
            temp = self.blobs.create(expected)
        except OSError as exc:
            raise self.full_error(exc) from exc
        return PayloadWriter(temp, block_size, self, expected)

    def seal(self, writer: PayloadWriter, holder: str | None = None) -> BlobInfo:
        """Make a written payload a blob, pinned until :meth:`release` (``holder``: see there)."""
        blob = writer.finish()
        with self._gc_lock:
            self._pins[blob.digest] += 1
        self._noted([blob.digest])  # before the rename that puts it in the store
        try:
            writer.temp.seal(blob.digest)
        except BaseException as exc:
            self.release([blob.digest], collect=True)
            if isinstance(exc, OSError):
                raise self.full_error(exc) from exc
            raise
        return blob

    def commit_archive(
        self, name: str, entries: Sequence[EntryRecord], blobs: Sequence[BlobInfo], replace: bool,
        holder: str | None = None, metadata: Mapping[str, str] | None = None,
    ) -> ArchiveRecord:
        """Record an archive whose (pinned) blobs are all sealed, once they are durable."""
        self._ensure_room()
        try:
            self.blobs.make_durable(b.digest for b in blobs)
        except OSError as exc:
            raise self.full_error(exc) from exc
        noted = self._noted_archive(name) if replace else []
        try:
            record, released = self._write_catalog(
                lambda: self.catalog.commit_archive(name, entries, blobs, replace, time.time_ns(), metadata))
        except BaseException:
            self._settled(noted)
            raise
        self._released(noted, released)
        return record

    def union(self, target: str, sources: Sequence[tuple[str, str]], replace: bool, limits: ArchiveLimits,
              metadata: Mapping[str, str] | None = None) -> ArchiveRecord:
        self._ensure_room()
        noted = self._noted_archive(target) if replace else []
        try:
            record, released = self._write_catalog(
                lambda: self.catalog.union(target, sources, replace, time.time_ns(), limits, metadata))
        except BaseException:
            self._settled(noted)
            raise
        self._released(noted, released)
        return record

    def _catalog_write(self, write: Callable[[], T], freeing: bool = False) -> T:
        return self._write_catalog(write, use_reserve=freeing)

    def delete(self, name: str, force: bool = False, note: MoveNote = MoveNote()) -> tuple[ArchiveRecord | None, Collected]:
        """Remove an archive and the blobs only it referenced; works on a disk with no free byte.

        On a full disk the catalog write uses the space reserve; the blobs' removal then
        frees space, and the reserve is re-created once there is room for it.
        """
        noted = self._noted_archive(name)
        try:
            record, released = self._write_catalog(lambda: self.catalog.delete_archive(name, force, note),
                                                  use_reserve=True)
        except BaseException:
            self._settled(noted)
            raise
        try:
            collected = self._released(noted, released)
        finally:
            if self.reserve is not None:
                self.reserve.ensure()
        return record, collected
