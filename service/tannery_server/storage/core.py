"""Storage as the server uses it: the one base that the embedded :class:`~.catalog_and_blobs.Storage`
and the replicas' :class:`~.shared_storage.SharedStorage` both implement, and what they share.

Both keep a catalog and a blob store consistent: a blob is durable before the catalog
references it, and a blob a call in flight uses is never collected under it. How differs,
and each sibling says it in full: the embedded storage pins blobs in memory, collects them at
once and keeps a space reserve (one server per data directory); the shared one leases them in
the catalog and collects them from a sweeper after a grace period (any number of replicas).
What is the same (reading, scrubbing, checking, a hashed-only payload, what a driver's error
means) is here, once.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import sqlite3
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence, TypeVar

from .base import AliasRecord, ArchiveLimits, MoveNote, ArchiveRecord, BlobFile, BlobInfo, BlobStore, Catalog, EntryRecord
from .disk import EXHAUSTED_ERRNOS, free_bytes, is_disk_full
from .errors import Damaged, OutOfResources, StorageFull, StorageUnavailable
from .block_reader import BlockReader
from .integrity import BLOCK_SIZE
from .payload_writer import PayloadHash, PayloadWriter

log = logging.getLogger("tannery_server.storage")
T = TypeVar("T")


@dataclass(frozen=True)
class Collected:
    blobs: int = 0
    bytes: int = 0


class StorageBase(ABC):
    """A catalog and a blob store, kept consistent (see the module)."""

    #: Where the data lives, named in the errors of a full disk (None: no directory of this host).
    data_dir: Path | None = None

    def __init__(self, catalog: Catalog, blobs: BlobStore) -> None:
        self.catalog = catalog
        self.blobs = blobs

    # Life -------------------------------------------------------------------------------

    @abstractmethod
    def recover(self) -> None:
        """Make the storage ready to serve after it is opened (what a crash left is dealt with)."""

    def close(self) -> None:
        self.catalog.close()
        self.blobs.close()

    def check(self) -> None:
        """StorageUnavailable naming the catalog or the blob store when either does not answer
        (the health check asks)."""
        self.catalog.check()
        self.blobs.check()

    # Writing ----------------------------------------------------------------------------

    @abstractmethod
    def new_payload(self, expected: str | None = None, block_size: int = BLOCK_SIZE) -> PayloadWriter:
        """A temporary blob for one payload (``expected``: its SHA-256 given ahead, which it must
        hash to), checksummed in blocks of ``block_size`` bytes."""

    def hashing_payload(self, expected: str | None = None) -> PayloadWriter:
        """A payload only hashed, written nowhere (``expected``: its SHA-256 given ahead, which it
        must hash to): what a Store compares with an entry already stored, and never stores."""
        return PayloadHash(BLOCK_SIZE, expected)

    @abstractmethod
    def seal(self, writer: PayloadWriter, holder: str | None = None) -> BlobInfo:
        """Make a written payload a blob, held for ``holder`` (the Store that wrote it) until
        :meth:`release`."""

    @abstractmethod
    def commit_archive(self, name: str, entries: Sequence[EntryRecord], blobs: Sequence[BlobInfo], replace: bool,
                       holder: str | None = None, metadata: Mapping[str, str] | None = None) -> ArchiveRecord:
        """Record an archive whose (held) blobs are all sealed, once they are durable."""

    @abstractmethod
    def union(self, target: str, sources: Sequence[tuple[str, str]], replace: bool, limits: ArchiveLimits,
              metadata: Mapping[str, str] | None = None) -> ArchiveRecord:
        """Make ``target`` of the entries of ``(archive, prefix)`` sources (:meth:`Catalog.union`)."""

    @abstractmethod
    def delete(self, name: str, force: bool = False, note: MoveNote = MoveNote()) -> tuple[ArchiveRecord | None, Collected]:
        """Remove an archive (None if absent) and free what only it referenced; an archive an
        alias points at only with ``force``, which removes those aliases, their removal recorded
        as ``note`` says (:meth:`Catalog.delete_archive`)."""

    # Aliases (catalog rows only: no blob changes) ---------------------------------------------

    def tag(self, alias: str, archive: str, expect: str | None, note: MoveNote = MoveNote()) -> AliasRecord:
        """Point ``alias`` at ``archive`` now, the move recorded as ``note`` says (:meth:`Catalog.tag`)."""
        return self._catalog_write(lambda: self.catalog.tag(alias, archive, expect, time.time_ns(), note))

    def untag(self, alias: str, note: MoveNote = MoveNote()) -> AliasRecord | None:
        """Remove ``alias`` (None if absent); possible on a full disk, as a Delete is."""
        return self._catalog_write(lambda: self.catalog.untag(alias, time.time_ns(), note), freeing=True)

    def _catalog_write(self, write: Callable[[], T], freeing: bool = False) -> T:
        """Run a catalog write that touches no blob (the embedded storage answers a full disk
        there, ``freeing`` ones with its space reserve)."""
        return write()

    # Holding blobs ----------------------------------------------------------------------

    @abstractmethod
    def pinned(self, lookup: Callable[[], T], digests_of: Callable[[T], Iterable[str]]) -> T:
        """Run a catalog ``lookup`` whose blobs (``digests_of(result)``) stay readable until the
        caller gives them to :meth:`release`."""

    def reuse(self, digest: str, holder: str) -> bool:
        """Hold blob ``digest``, which a :meth:`pinned` lookup found (an entry of another
        archive), for the commit of ``holder``, which references it without writing it (a
        Derive's SAME entry); False when it is gone. Here the lookup's pin holds it already."""
        return True

    @abstractmethod
    def release(self, digests: Iterable[str], collect: bool = False, holder: str | None = None) -> Collected:
        """End the hold on ``digests`` (those of a :meth:`pinned` lookup, or sealed for ``holder``);
        ``collect``: they may be collected now if nothing references them."""

    # Reading ----------------------------------------------------------------------------

    def open_blob(self, digest: str, size: int | None = None) -> BlobFile:
        """An open blob (FileNotFoundError when missing); ``size`` from the catalog spares a
        remote store a request."""
        return self.blobs.open(digest, size)

    def damaged(self, digest: str) -> None:
        """A blob's bytes failed their check: a cached copy of it is dropped (the next read goes
        to the store itself); a stored blob stays, for ``tannery scrub`` to name."""
        self.blobs.evict(digest)

    def scrub(self) -> list[str]:
        """Read every referenced blob through the block reader (each block against its CRC) and
        hash it against its name (the SHA-256 a Fetch does not recompute): the digests of blobs
        that are missing, of the wrong size, or no longer match (a pack: every entry in it).
        :func:`~.scrub.scrub_store` also looks the other way, for bytes nothing references."""
        return [digest for digest in sorted(self.catalog.referenced_digests()) if self.fault(digest)]

    def fault(self, digest: str) -> str | None:
        """What is wrong with blob ``digest``: ``"missing"`` (no record, or no bytes),
        ``"damaged"`` (another size, a block or the SHA-256 not matching), or None."""
        info = self.catalog.blob(digest)
        if info is None:
            return "missing"
        try:
            blob = self.blobs.open(digest)
        except FileNotFoundError:
            return "missing"
        try:
            if blob.size != info.size:
                return "damaged"
            sha = hashlib.sha256()
            for piece in BlockReader(blob, info, f"blob {digest}").blocks(0, info.size):
                sha.update(piece)
            return None if sha.hexdigest() == digest else "damaged"
        except Damaged:
            return "damaged"
        finally:
            blob.close()

    def remove_leak(self, digest: str) -> bool:
        """Delete the bytes of blob ``digest``, which no catalog row references (``tannery scrub
        --repair``; the store is this process's alone: its lock is held). Whether removed."""
        self.blobs.remove(digest)
        return True

    # What a driver's error means --------------------------------------------------------

    def full_error(self, exc: BaseException) -> BaseException:
        """The StorageFull for ``exc`` when it means the disk of :attr:`data_dir` is full, else ``exc`` itself."""
        if self.data_dir is None or not is_disk_full(exc, self.data_dir):
            return exc
        return StorageFull(f"storage is full: no space left on device in {self.data_dir} "
                           f"({self._free_text()}): delete archives to free space")

    def _free_text(self) -> str:
        try:
            return f"{free_bytes(self.data_dir)} bytes free" if self.data_dir is not None else "no bytes free"
        except OSError:
            return "free space unknown"

    def storage_error(self, exc: BaseException) -> BaseException:
        """The storage error an error of the storage's drivers (files, SQLite) means, so that
        callers know no driver: a full disk or a file size limit is StorageFull, exhausted
        descriptors or memory OutOfResources, any other I/O or database error
        StorageUnavailable. Anything else is returned as it is."""
        full = self.full_error(exc)
        if full is not exc:
            return full
        if isinstance(exc, OSError) and exc.errno == errno.EFBIG:
            return StorageFull(f"storage is full: a file size limit stopped a write in {self.data_dir} "
                               f"({exc.strerror or exc}): raise the limit (ulimit -f) or store smaller entries")
        if isinstance(exc, OSError) and exc.errno in EXHAUSTED_ERRNOS:
            return OutOfResources(f"the server is out of resources: {exc.strerror or exc}")
        if isinstance(exc, (OSError, sqlite3.Error)):
            log.warning("storage error", exc_info=exc)
            return StorageUnavailable(f"storage error in {self.data_dir}: {exc}")
        return exc


__all__ = ["Collected", "StorageBase"]
