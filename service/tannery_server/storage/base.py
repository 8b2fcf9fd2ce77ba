"""The storage interface: a catalog of archives and a store of content-addressed blobs.

The embedded implementations are :class:`~.sqlite_catalog.SqliteCatalog` and
:class:`~.file_blobs.FileBlobStore`; :class:`~.postgres_catalog.PostgresCatalog` and
:class:`~.s3_blobs.S3BlobStore` (what replicas share) implement the same bases. Each base
declares what every implementation does (abstract methods) and the optional capabilities,
with what a store without them does (``wants_digests``, :meth:`BlobStore.evict`,
:meth:`BlobStore.close`, :meth:`BlobFile.read_ahead_until`, :attr:`BlobFile.local_file`): the
callers ask no object what it happens to have. Every method is synchronous and may block:
the server calls them from worker threads.
"""

from __future__ import annotations

import dataclasses
import io
import struct
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Mapping, Sequence

from tannery_protocol.names import join


@dataclass(frozen=True)
class BlobInfo:
    """One stored payload: its SHA-256, its size, and a 32-bit checksum for each block of it.

    The block checksums let a row range be verified by reading only the blocks that
    cover it, instead of hashing the whole blob. ``checksum`` names their algorithm
    (:mod:`tannery_protocol.checksums`): CRC-32C for new blobs, zlib's CRC-32 for those stored
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
    """One named entry of an archive, as the catalog holds it.

    ``digest`` is the SHA-256 of the entry's payload (what Describe reports and a Store
    compares). The payload's bytes are ``payload_bytes`` bytes of blob ``blob`` from
    ``blob_offset``: a payload of its own is its blob (``blob`` is ``digest``, offset 0); a
    small one lives inside a pack shared by the entries of its Store (docs/packs.md).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    payload_bytes: int
    data_offset: int
    digest: str
    #: The blob holding the payload; "" (given) means ``digest``, the payload's own blob.
    blob: str = ""
    blob_offset: int = 0

    def __post_init__(self) -> None:
        if not self.blob:
            object.__setattr__(self, "blob", self.digest)

    @property
    def packed(self) -> bool:
        """Whether the payload lives inside a pack (a blob shared with other entries)."""
        return self.blob != self.digest

    def renamed(self, prefix: str) -> "EntryRecord":
        return dataclasses.replace(self, name=join(prefix, self.name))


@dataclass(frozen=True)
class ArchiveRecord:
    name: str
    entries: int
    nbytes: int
    payload_bytes: int
    created_ns: int
    #: The archive's string-to-string metadata (safetensors' ``__metadata__``), set on Store or Union.
    metadata: Mapping[str, str] = field(default_factory=dict, hash=False)
    #: Set on the record a Store or Union returns when it found the archive already holding
    #: exactly its content and stored nothing (never kept in the catalog).
    already_stored: bool = field(default=False, compare=False)
    #: Set on the record a Delete returns: the aliases removed with it (``force``), sorted.
    untagged: tuple[str, ...] = field(default=(), compare=False)
    #: Of the entries, those that are files kept with the archive (``@file:NAME``; counted in
    #: ``entries``, ``nbytes`` and ``payload_bytes`` too): how many, their bytes, their payloads'.
    files: int = field(default=0, compare=False)
    file_nbytes: int = field(default=0, compare=False)
    file_payload_bytes: int = field(default=0, compare=False)

    @property
    def tensors(self) -> int:
        """The entries that are tensors: all but the kept files."""
        return self.entries - self.files

    @property
    def version(self) -> str:
        """What tells this archive from another stored under its name since (a replace): its
        creation time, in nanoseconds, as text. A resumed Fetch sends it so that it never
        takes the rest of its entries from another version."""
        return str(self.created_ns)


@dataclass(frozen=True)
class ArchiveRead:
    """An archive's record and the entries a read asked of it, read in one snapshot of the
    catalog: a replace committed meanwhile shows in neither or in both."""

    record: ArchiveRecord
    entries: list["EntryRecord"]


@dataclass(frozen=True)
class AliasRecord:
    """An alias: a name pointing at an archive's name, moved atomically (see :meth:`Catalog.tag`)."""

    alias: str
    archive: str
    #: When it was created or last moved (``time.time_ns()``).
    moved_ns: int
    #: On what :meth:`Catalog.tag` returns: the archive it pointed at before ("" when created),
    #: and whether the tag wrote anything (False: it already pointed there).
    previous: str = field(default="", compare=False)
    changed: bool = field(default=True, compare=False)


@dataclass(frozen=True)
class AliasPage:
    """Which aliases a listing reads beyond its name prefix, and how many: those pointing at
    archives under ``archive_prefix``, or between ``archives_from`` and ``archives_to`` (both
    included; what one page of archives shows), after position ``after`` (``(target, alias)``
    of the last one read), at most ``limit`` (0: all). Aliases come by name, or by target then
    name when a target is asked for (:meth:`by_target`), so a page ends where the next begins."""

    archive_prefix: str = ""
    archives_from: str = ""
    archives_to: str | None = None
    after: tuple[str, str] | None = None
    limit: int = 0

    def by_target(self, archive: str = "") -> bool:
        """Whether the aliases come by target, then name."""
        return bool(archive or self.archive_prefix or self.archives_from or self.archives_to is not None)


@dataclass(frozen=True)
class AliasMove:
    """One move of an alias, as its history keeps it: from ``previous`` ("" when created) to
    ``archive`` ("" when removed: an Untag, a forced Delete of its target), when, and by whom
    (the role and fingerprint of the token that moved it; "" on an open server)."""

    alias: str
    previous: str
    archive: str
    moved_ns: int
    by: str = ""


@dataclass(frozen=True)
class MoveNote:
    """What a write that moves aliases records: who moves them, and how many moves an alias's
    history keeps (the oldest go first); ``record`` False records nothing (a migration, which
    copies the history itself)."""

    by: str = ""
    keep: int = 1000
    record: bool = True


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


class Catalog(ABC):
    """Archives, their entries and the blobs they reference; each write is one transaction."""

    @abstractmethod
    def archive(self, name: str) -> ArchiveRecord | None: ...

    @abstractmethod
    def lookup(self, name: str) -> ArchiveRecord | None:
        """The archive ``name`` denotes now, in one query: the archive of that name, or the one
        the alias ``name`` points at (its record carries the archive's own name, which the
        caller then reads by, so one call never reads two versions). What every read takes."""
        ...

    @abstractmethod
    def alias(self, name: str) -> AliasRecord | None:
        """The alias of that name, if there is one."""
        ...

    @abstractmethod
    def aliases(self, prefix: str = "", archive: str = "", page: AliasPage = AliasPage()) -> list[AliasRecord]:
        """The aliases whose names start with ``prefix`` (pointing at ``archive`` if given), by name
        (by target, then name, when a target is asked for), narrowed and paged as ``page`` says."""
        ...

    @abstractmethod
    def tag(self, alias: str, archive: str, expect: str | None, now_ns: int, note: MoveNote = MoveNote()
            ) -> AliasRecord:
        """Point ``alias`` at ``archive`` in one transaction (:mod:`.alias_sql`'s rules): a record
        with ``changed`` False when it already points there; AliasConflict when ``alias`` is an
        archive's name, ``archive`` is an alias, or ``expect`` (None: no condition; "": no alias
        yet) is not its current target; NoSuchArchive when ``archive`` does not exist. A move is
        recorded in the alias's history, as ``note`` says."""
        ...

    @abstractmethod
    def untag(self, alias: str, now_ns: int = 0, note: MoveNote = MoveNote()) -> AliasRecord | None:
        """Remove an alias (its removal recorded in its history); returns it (None if absent)."""
        ...

    @abstractmethod
    def history(self, alias: str, limit: int) -> list[AliasMove]:
        """The last ``limit`` moves of ``alias``, newest first (none for a name never tagged)."""
        ...

    @abstractmethod
    def import_moves(self, moves: Sequence[AliasMove]) -> int:
        """Add ``moves`` (oldest first) to the history of their aliases, unless an alias already
        has a history here (a migration run again); the moves added."""
        ...

    @abstractmethod
    def read_archive(self, name: str, names: Sequence[str] | None = None, prefix: str = "", *,
                     entries: bool = True) -> ArchiveRead | None:
        """The archive ``name`` denotes now (as :meth:`lookup`) and its entries, in one read
        transaction (one snapshot), so the record and the entries are of one version; None
        when there is no such archive. The entries: none without ``entries``; with ``names``,
        those of these names that exist, sorted by name; else those ``prefix`` owns, sorted by
        name (every entry for an empty prefix). What Describe and Fetch read."""
        ...

    @abstractmethod
    def entries(self, archive: str, names: Sequence[str]) -> dict[str, EntryRecord]:
        """The entries of these names that exist (KeyError-free: absent names are left out)."""
        ...

    @abstractmethod
    def entries_under(self, archive: str, prefix: str) -> list[EntryRecord]:
        """The entries ``prefix`` owns, sorted by name (every entry for an empty prefix)."""
        ...

    @abstractmethod
    def list_archives(self, prefix: str, after: str, limit: int) -> list[ArchiveRecord]:
        """Archives whose names start with ``prefix`` and sort after ``after``, by name."""
        ...

    @abstractmethod
    def blob(self, digest: str) -> BlobInfo | None: ...

    def blobs(self, digests: Iterable[str]) -> dict[str, BlobInfo]:
        """The recorded blobs of these digests (absent ones left out): what a Fetch of many
        entries checks their bytes with, asked once for all of them."""
        found = {}
        for digest in dict.fromkeys(digests):
            info = self.blob(digest)
            if info is not None:
                found[digest] = info
        return found

    @abstractmethod
    def commit_archive(
        self, name: str, entries: Sequence[EntryRecord], blobs: Sequence[BlobInfo], replace: bool, created_ns: int,
        metadata: Mapping[str, str] | None = None,
    ) -> tuple[ArchiveRecord, list[str]]:
        """Create (or replace) an archive whose blobs are already durable, with ``metadata``.

        Returns the archive and the digests the replaced archive referenced (candidates
        for collection). Raises ArchiveExists when it exists and ``replace`` is false.
        """
        ...

    @abstractmethod
    def union(
        self, target: str, sources: Sequence[tuple[str, str]], replace: bool, created_ns: int, limits: ArchiveLimits,
        metadata: Mapping[str, str] | None = None,
    ) -> tuple[ArchiveRecord, list[str]]:
        """Create ``target`` from the entries of ``(archive, prefix)`` sources, without blob writes;
        its metadata is ``metadata`` (not the sources').

        NoSuchArchive for a missing source, InvalidRequest for a name in two sources or too
        long, TooManyEntries for too many entries. When ``target`` exists and not ``replace``:
        the archive there (``already_stored`` set, nothing written) when it holds exactly the
        entries (names and digests) and metadata the union gives, else ArchiveExists naming the
        first difference.
        """
        ...

    @abstractmethod
    def delete_archive(self, name: str, force: bool = False, note: MoveNote = MoveNote()
                       ) -> tuple[ArchiveRecord | None, list[str]]:
        """Remove an archive; returns it (None if absent) and the digests it referenced.
        AliasConflict naming the aliases that point at it, unless ``force``: then they are
        removed with it (named in the record's ``untagged``; each removal in its history)."""
        ...

    @abstractmethod
    def unreferenced(self, digests: Iterable[str]) -> list[BlobInfo]:
        """Of these digests, the recorded blobs no entry references any more."""
        ...

    @abstractmethod
    def forget_blobs(self, digests: Iterable[str]) -> None: ...

    @abstractmethod
    def referenced_digests(self) -> set[str]:
        """Every digest some entry references (start-up garbage collection)."""
        ...

    @abstractmethod
    def referrers(self, digest: str) -> list[tuple[str, str]]:
        """The (archive, entry) pairs whose payload is this blob, sorted."""
        ...

    @abstractmethod
    def forget_unreferenced_blobs(self) -> int:
        """Drop blob rows no entry references; returns how many."""
        ...

    @abstractmethod
    def totals(self) -> CatalogTotals:
        """Counts and sizes of the archives and blobs recorded now."""
        ...

    @abstractmethod
    def check(self) -> None:
        """Return when the catalog answers; StorageUnavailable naming it otherwise (health checks)."""
        ...

    @abstractmethod
    def close(self) -> None: ...


class BlobFile(ABC):
    """An open blob to read ranges of."""

    size: int
    #: Whether :meth:`fileno` gives an open descriptor of the blob's bytes (a file on this host).
    local_file: bool = False

    @abstractmethod
    def read(self, offset: int, size: int) -> bytes: ...

    @abstractmethod
    def read_into(self, buffer: memoryview, offset: int) -> int:
        """Fill ``buffer`` with the bytes from ``offset``; returns how many were read."""
        ...

    def fileno(self) -> int:
        """An open descriptor of the blob's bytes (the data paths send or pass it), when
        :attr:`local_file`.

        ``io.UnsupportedOperation`` for a blob with no local file (an object in a bucket
        that is not in the local cache), as :mod:`io` says it: the data paths then send bytes
        read with :meth:`read_into` instead.
        """
        raise io.UnsupportedOperation(f"{type(self).__name__} has no local file")

    def read_ahead_until(self, stop: int) -> None:
        """Read no byte at or past ``stop`` ahead of the reads (the end of a row range). A blob
        that reads nothing ahead (a local file: the kernel does) has nothing to bound."""

    @abstractmethod
    def close(self) -> None: ...


class TempBlob(ABC):
    """A blob being written; nothing of it is visible until :meth:`seal`."""

    @abstractmethod
    def write(self, data: memoryview | bytes) -> None: ...

    @abstractmethod
    def seal(self, digest: str) -> bool:
        """Make the written bytes blob ``digest`` (not yet durable: see ``make_durable``).

        Returns False when that blob already existed (the bytes written are dropped:
        equal payloads are stored once).
        """
        ...

    @abstractmethod
    def discard(self) -> None: ...


class BlobStore(ABC):
    #: Whether a digest given ahead to :meth:`create` saves work (a copy in a bucket).
    wants_digests: bool = False

    @abstractmethod
    def create(self, expected: str | None = None) -> TempBlob:
        """A new temporary blob. ``expected``, the digest its bytes will have (checked by the
        caller before seal), lets a remote store write them straight to their final place."""
        ...

    @abstractmethod
    def make_durable(self, digests: Iterable[str]) -> None:
        """Return once these blobs survive a crash (the catalog references only durable blobs)."""
        ...

    @abstractmethod
    def open(self, digest: str, size: int | None = None) -> BlobFile:
        """FileNotFoundError when the blob is missing. ``size``, when the caller knows it
        (the catalog does), spares a remote store the request that would find it."""
        ...

    @abstractmethod
    def remove(self, digest: str) -> int:
        """Delete a blob; returns the bytes freed (0 if it was absent)."""
        ...

    @abstractmethod
    def digests(self) -> Iterator[str]:
        """Every stored blob."""
        ...

    @abstractmethod
    def modified_ns(self, digest: str) -> int:
        """When blob ``digest`` was last written (nanoseconds since the epoch); FileNotFoundError
        when it is not there. ``tannery scrub`` spares a leak younger than the grace period."""
        ...

    @abstractmethod
    def temporaries(self) -> list[str]:
        """The names of the temporary blobs there now (Stores in flight, or left by a crash)."""
        ...

    @abstractmethod
    def clear_temporary(self, older_than_ns: int | None = None) -> int:
        """Remove blobs left half-written by an interrupted run; returns how many.

        ``older_than_ns`` (a ``time.time_ns()``): only those started before it (a store
        shared by replicas must not remove another replica's upload in progress); None:
        every one (one process owns the store and nothing is being written).
        """
        ...

    @abstractmethod
    def check(self) -> None:
        """Return when the store answers; StorageUnavailable naming it otherwise (health checks)."""
        ...

    def evict(self, digest: str) -> None:
        """Drop a local copy of blob ``digest`` whose bytes failed a check (the next read goes to the
        store itself); the blob stays. A store that keeps no copies (every one but a cache) has
        none to drop."""

    def close(self) -> None:
        """Stop the store's own threads (a bucket's uploads and reads, a cache's fills); a store
        with none (a directory) has nothing to stop."""


class SharedCatalog(Catalog):
    """A catalog that several server replicas share (PostgreSQL).

    Replicas keep nothing that matters in memory, so what protects a blob from collection
    lives here too (see ``docs/scale-out.md``):

    * a **lease** ``(replica, holder)`` on a blob, taken by a Store once the blob's bytes
      are sealed and dropped when its archive commits or the call ends; a replica renews
      its leases while it lives, so those of a killed replica expire;
    * ``blobs.touched_ns``, set when a blob row is created, leased, unleased, or loses its
      last reference: a blob is collected only once it has no reference, no live lease,
      and was last touched before a grace period (which also covers a Fetch that was
      reading it when its archive was deleted);
    * :meth:`collect_blob` decides and deletes under the blob row's lock, so a lease taken
      at the same moment either comes first (no collection) or finds no row (and uploads
      the blob again).

    Every write is one transaction. Driver errors are raised as StorageUnavailable naming
    the catalog (never the driver's own exception).
    """

    @abstractmethod
    def lease(self, blob: BlobInfo, replica: str, holder: str, expires_ns: int) -> bool:
        """Record ``blob`` (its row created if absent, else touched) and a lease on it by
        ``(replica, holder)`` until ``expires_ns``, in one transaction that holds the blob
        row's lock. Returns whether the row existed before."""
        ...

    @abstractmethod
    def renew_leases(self, replica: str, expires_ns: int) -> int:
        """Extend every lease of ``replica`` to ``expires_ns``; returns how many."""
        ...

    @abstractmethod
    def drop_leases(self, replica: str, holder: str) -> None:
        """Remove the leases of ``(replica, holder)`` and touch their blobs."""
        ...

    @abstractmethod
    def commit_leased(
        self, name: str, entries: Sequence[EntryRecord], replace: bool, created_ns: int, replica: str, holder: str,
        now_ns: int, metadata: Mapping[str, str] | None = None,
    ) -> tuple[ArchiveRecord, list[str]]:
        """:meth:`Catalog.commit_archive` for blobs leased by ``(replica, holder)``: in one
        transaction, check that every entry's blob has a live lease of that holder at
        ``now_ns`` (StorageUnavailable naming the blob otherwise: nothing is committed),
        create or replace the archive (ArchiveExists as ever; two replicas committing one name
        at once: exactly one wins, never a mix), drop the holder's leases, and touch the
        blobs the replaced archive released (returned, as by ``commit_archive``)."""
        ...

    @abstractmethod
    def collectable(self, touched_before_ns: int, now_ns: int, limit: int, skip: Iterable[str] = ()) -> list[str]:
        """Up to ``limit`` digests of blob rows that no entry references, with no lease live at
        ``now_ns`` and no collection's claim live now, last touched before ``touched_before_ns``,
        oldest first, leaving out ``skip`` (blobs the caller tried already)."""
        ...

    @abstractmethod
    def collect_orphan(self, digest: str, remove: Callable[[str], object]) -> bool:
        """Call ``remove(digest)`` for bytes no row names, claiming the digest meanwhile as
        :meth:`collect_blob` does; False (nothing removed) when a row names it now."""
        ...

    @abstractmethod
    def collect_blob(self, digest: str, touched_before_ns: int, now_ns: int, remove: Callable[[str], object]) -> bool:
        """If the blob is still collectable (as :meth:`collectable` says), claim its row, call
        ``remove(digest)`` (which deletes its bytes) outside any transaction, and delete the row.
        Returns whether it was collected; an exception from ``remove`` leaves the row, unclaimed."""
        ...
