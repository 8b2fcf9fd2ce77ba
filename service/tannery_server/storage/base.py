"""The storage interface: a catalog of archives and a store of content-addressed blobs.

The embedded implementations are :class:`~.sqlite_catalog.SqliteCatalog` and
:class:`~.file_blobs.FileBlobStore`; a PostgreSQL catalog or an S3-compatible blob store
would implement the same two protocols. Every method is synchronous and may block: the
server calls them from worker threads.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Iterable, Iterator, Protocol, Sequence

from tannery.names import join


@dataclass(frozen=True)
class BlobInfo:
    """One stored payload: its SHA-256, its size, and a 32-bit checksum for each block of it.

    The block checksums let a row range be verified by reading only the blocks that
    cover it, instead of hashing the whole blob. ``checksum`` names their algorithm
    (:mod:`tannery.checksums`): CRC-32C for new blobs, zlib's CRC-32 for those stored
    before it.
    """

    digest: str
    size: int
    block_size: int
    block_crcs: bytes  # little-endian uint32, one per block
    checksum: str = "crc32c"

    def crc(self, block: int) -> int:
        return struct.unpack_from("<I", self.block_crcs, 4 * block)[0]

    @property
    def blocks(self) -> int:
        return len(self.block_crcs) // 4


@dataclass(frozen=True)
class EntryRecord:
    """One named entry of an archive, as the catalog holds it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    payload_bytes: int
    data_offset: int
    digest: str

    def renamed(self, prefix: str) -> "EntryRecord":
        return EntryRecord(join(prefix, self.name), self.dtype, self.shape, self.nbytes, self.payload_bytes,
                           self.data_offset, self.digest)


@dataclass(frozen=True)
class ArchiveRecord:
    name: str
    entries: int
    nbytes: int
    payload_bytes: int
    created_ns: int


@dataclass(frozen=True)
class CatalogTotals:
    """How much the catalog holds (what the metrics report)."""

    archives: int
    #: Payload bytes of every archive's entries; an entry shared by two archives counts twice.
    archive_bytes: int
    #: Distinct payloads (blobs) recorded, and their bytes: what the blob store holds.
    blobs: int
    blob_bytes: int


@dataclass(frozen=True)
class ArchiveLimits:
    """The bounds an archive must stay within (the catalog checks them for unions)."""

    max_entries: int
    max_name_bytes: int


class Catalog(Protocol):
    """Archives, their entries and the blobs they reference; each write is one transaction."""

    def archive(self, name: str) -> ArchiveRecord | None: ...

    def entries(self, archive: str, names: Sequence[str]) -> dict[str, EntryRecord]:
        """The entries of these names that exist (KeyError-free: absent names are left out)."""
        ...

    def entries_under(self, archive: str, prefix: str) -> list[EntryRecord]:
        """The entries ``prefix`` owns, sorted by name (every entry for an empty prefix)."""
        ...

    def list_archives(self, prefix: str, after: str, limit: int) -> list[ArchiveRecord]:
        """Archives whose names start with ``prefix`` and sort after ``after``, by name."""
        ...

    def blob(self, digest: str) -> BlobInfo | None: ...

    def commit_archive(
        self, name: str, entries: Sequence[EntryRecord], blobs: Sequence[BlobInfo], replace: bool, created_ns: int
    ) -> tuple[ArchiveRecord, list[str]]:
        """Create (or replace) an archive whose blobs are already durable.

        Returns the archive and the digests the replaced archive referenced (candidates
        for collection). Raises NameTaken when it exists and ``replace`` is false.
        """
        ...

    def union(
        self, target: str, sources: Sequence[tuple[str, str]], replace: bool, created_ns: int, limits: ArchiveLimits
    ) -> tuple[ArchiveRecord, list[str]]:
        """Create ``target`` from the entries of ``(archive, prefix)`` sources, without blob writes.

        Missing for a missing source, Malformed for a name in two sources or too
        long, LimitExceeded for too many entries, NameTaken unless ``replace``.
        """
        ...

    def delete_archive(self, name: str) -> tuple[ArchiveRecord | None, list[str]]:
        """Remove an archive; returns it (None if absent) and the digests it referenced."""
        ...

    def unreferenced(self, digests: Iterable[str]) -> list[BlobInfo]:
        """Of these digests, the recorded blobs no entry references any more."""
        ...

    def forget_blobs(self, digests: Iterable[str]) -> None: ...

    def referenced_digests(self) -> set[str]:
        """Every digest some entry references (start-up garbage collection)."""
        ...

    def referrers(self, digest: str) -> list[tuple[str, str]]:
        """The (archive, entry) pairs whose payload is this blob, sorted."""
        ...

    def forget_unreferenced_blobs(self) -> int:
        """Drop blob rows no entry references; returns how many."""
        ...

    def totals(self) -> CatalogTotals:
        """Counts and sizes of the archives and blobs recorded now."""
        ...

    def close(self) -> None: ...


class BlobFile(Protocol):
    """An open blob to read ranges of."""

    size: int

    def read(self, offset: int, size: int) -> bytes: ...

    def read_into(self, buffer: memoryview, offset: int) -> int:
        """Fill ``buffer`` with the bytes from ``offset``; returns how many were read."""
        ...

    def fileno(self) -> int:
        """An open descriptor of the blob's bytes (the data paths send or pass it)."""
        ...

    def close(self) -> None: ...


class TempBlob(Protocol):
    """A blob being written; nothing of it is visible until :meth:`seal`."""

    def write(self, data: memoryview | bytes) -> None: ...

    def seal(self, digest: str) -> bool:
        """Make the written bytes blob ``digest`` (not yet durable: see ``make_durable``).

        Returns False when that blob already existed (the bytes written are dropped:
        equal payloads are stored once).
        """
        ...

    def discard(self) -> None: ...


class BlobStore(Protocol):
    def create(self) -> TempBlob: ...

    def make_durable(self, digests: Iterable[str]) -> None:
        """Return once these blobs survive a crash (the catalog references only durable blobs)."""
        ...

    def open(self, digest: str) -> BlobFile:
        """FileNotFoundError when the blob is missing."""
        ...

    def remove(self, digest: str) -> int:
        """Delete a blob; returns the bytes freed (0 if it was absent)."""
        ...

    def digests(self) -> Iterator[str]:
        """Every stored blob."""
        ...

    def clear_temporary(self) -> int:
        """Remove blobs left half-written by an interrupted run; returns how many."""
        ...
