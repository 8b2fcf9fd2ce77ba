"""The records calls return: what users get back from a call, built from its answer message.

:class:`ArchiveInfo` (an archive as the catalog knows it), :class:`ArchiveDescription` and
its entries (:class:`EntryDescription`), :class:`Deleted` and :class:`Published`; aliases
(:class:`Alias`, :class:`Tagged`, :class:`Untagged`) and :class:`Pruned`. Shared by
``tannery.Client``, ``tannery.aio.Client`` and the remote archives; nothing here imports torch.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tannery_protocol.v1 import archives_pb2, channels_pb2
from tannery_protocol.names import SEPARATOR, join
# How a kept file's entry is named (``@file:NAME``, ``P.@file:NAME``): one rule for the client and
# the server (docs/model-folders.md); re-exported here, where the client always read it.
from tannery_protocol.kept_files import MARK, entry_name, is_file_entry, split_entry

if TYPE_CHECKING:
    from tannery.archive import TensorInfo

#: The entry that keeps the plain values of a value stored under a prefix (``P.@values``:
#: :mod:`tannery.plain`), a 1-D uint8 tensor of their document; a file's metadata key too.
VALUES = "@values"


def values_entry(prefix: str = "") -> str:
    """The entry (or file metadata key) of the plain values kept under ``prefix``."""
    return join(prefix, VALUES)


def values_prefix(name: str) -> str | None:
    """The prefix whose plain values entry ``name`` keeps, None for any other entry."""
    if name == VALUES:
        return ""
    if name.endswith(SEPARATOR + VALUES):
        return name[: -len(SEPARATOR + VALUES)]
    return None


def is_kept_entry(name: str) -> bool:
    """Whether entry ``name`` keeps a file or plain values (and is no tensor of the archive's)."""
    return split_entry(name) is not None or values_prefix(name) is not None


@dataclass(frozen=True)
class ArchiveInfo:
    """An archive as the catalog knows it: entries (its tensors), tensor bytes, payload bytes (as
    stored and sent), and when it was created (UTC); ``files`` and ``file_bytes`` count the files
    kept with it (a pushed folder's config.json...) apart from the tensors.

    ``already_stored`` is true on what a store or union returns when the server found the
    archive already holding exactly that content (same entries, digests and metadata) and
    stored nothing: a Store sent again after its answer was lost, say. ``created`` is then
    when the archive was first stored."""

    name: str
    entries: int
    nbytes: int
    payload_bytes: int
    created: dt.datetime
    already_stored: bool = False
    files: int = 0
    file_bytes: int = 0

    @staticmethod
    def of(message: archives_pb2.ArchiveInfo) -> "ArchiveInfo":
        created = dt.datetime.fromtimestamp(message.created.ToNanoseconds() / 1e9, dt.timezone.utc)
        return ArchiveInfo(message.name, message.entries, message.nbytes, message.payload_bytes, created,
                           message.already_stored, message.files, message.file_bytes)


@dataclass(frozen=True)
class EntryDescription:
    """One stored entry: dtype, shape, tensor bytes, payload bytes and the payload's SHA-256."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    payload_bytes: int
    digest: str

    @property
    def info(self) -> TensorInfo:
        from tannery.archive import TensorInfo  # not at import: catalog calls need no archive module

        return TensorInfo(self.dtype, self.shape, self.nbytes)

    def __str__(self) -> str:
        from tannery_protocol.codec import format_shape  # not at import: tannery ls formats no shape

        return f"{self.name}: {self.dtype} {format_shape(self.shape)}"


@dataclass(frozen=True)
class FileDescription:
    """A file kept with the archive (a model folder's ``config.json``, say: see
    :mod:`tannery.calls.archive_files`): its name, the prefix it was stored under, its size in
    bytes, the SHA-256 of its entry's payload and that entry's name."""

    name: str
    prefix: str
    size: int
    digest: str
    entry: str


@dataclass(frozen=True)
class ValuesDescription:
    """The plain values kept with the archive under one prefix (:mod:`tannery.plain`): the
    prefix, the size of their document in bytes, the SHA-256 of its entry's payload and that
    entry's name (``P.@values``)."""

    prefix: str
    size: int
    digest: str
    entry: str


@dataclass(frozen=True)
class ArchiveDescription:
    """An archive's info and every entry, sorted by name (iterating gives the entries), and
    the files kept with it (entries too on the server, never listed among the tensors)."""

    info: ArchiveInfo
    entries: tuple[EntryDescription, ...]
    #: The archive's string-to-string metadata (safetensors' ``__metadata__``), as stored.
    metadata: dict[str, str] = field(default_factory=dict, hash=False)
    #: The files kept with the archive, sorted by entry name (those described: all of them
    #: when every entry was).
    files: tuple[FileDescription, ...] = ()
    #: The plain values kept with the archive, one document per prefix they were stored under
    #: (those described), sorted by entry name.
    values: tuple[ValuesDescription, ...] = ()
    #: The entries (of the whole archive, tensors or not) whose bytes ``tannery scrub --repair``
    #: found gone from the server's blob store, sorted by name: fetching one fails with DataLoss.
    lost_entries: tuple[str, ...] = ()

    @staticmethod
    def of(message: archives_pb2.ArchiveDescription) -> "ArchiveDescription":
        entries, files, values = [], [], []
        for e in message.entries:
            kept, prefix = split_entry(e.name), values_prefix(e.name)
            if kept is not None:
                files.append(FileDescription(kept[1], kept[0], e.nbytes, e.digest, e.name))
            elif prefix is not None:
                values.append(ValuesDescription(prefix, e.nbytes, e.digest, e.name))
            else:
                entries.append(EntryDescription(e.name, e.dtype, tuple(e.shape), e.nbytes, e.payload_bytes, e.digest))
        return ArchiveDescription(ArchiveInfo.of(message.info), tuple(entries), dict(message.metadata), tuple(files),
                                  tuple(values), tuple(message.lost_entries))

    @property
    def name(self) -> str:
        return self.info.name

    def __iter__(self) -> Iterator[EntryDescription]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)


def _time(stamp: object) -> dt.datetime:
    return dt.datetime.fromtimestamp(stamp.ToNanoseconds() / 1e9, dt.timezone.utc)  # type: ignore[attr-defined]


_EPOCH = dt.datetime.fromtimestamp(0, dt.timezone.utc)


@dataclass(frozen=True)
class Alias:
    """A name that points at an archive (``archive``), and when it was created or last moved (UTC)."""

    alias: str
    archive: str
    moved: dt.datetime

    @staticmethod
    def of(message: archives_pb2.Alias) -> "Alias":
        return Alias(message.alias, message.archive, _time(message.moved))


@dataclass(frozen=True)
class Tagged:
    """What a tag did: the alias as it is now, the archive it pointed at before ("" when the tag
    created it), and whether anything changed (False: it already pointed there)."""

    alias: Alias
    previous: str
    changed: bool

    @staticmethod
    def of(message: archives_pb2.TagResponse) -> "Tagged":
        return Tagged(Alias.of(message.alias), message.previous, message.changed)


@dataclass(frozen=True)
class Untagged:
    """The alias an untag removed (the archive stays). ``already_gone``: the call was retried
    after a lost answer and found no alias: the lost attempt removed it (its target is not known)."""

    alias: Alias
    already_gone: bool = False

    @staticmethod
    def gone(name: str) -> "Untagged":
        return Untagged(Alias(name, "", _EPOCH), already_gone=True)


@dataclass(frozen=True)
class Pruned:
    """What a prune did (or, ``dry_run``, would do): the archives deleted and those kept, each
    newest first; ``aliased`` maps each kept archive an alias points at to its aliases (kept
    whatever its age)."""

    deleted: tuple[ArchiveInfo, ...]
    kept: tuple[ArchiveInfo, ...]
    aliased: dict[str, tuple[str, ...]] = field(default_factory=dict, hash=False)
    dry_run: bool = False


@dataclass(frozen=True)
class Deleted:
    """What a delete removed: the archive, and the blobs no other archive used (and their bytes)."""

    archive: ArchiveInfo
    blobs_removed: int
    bytes_freed: int
    #: The call was retried after a lost answer and found the archive gone: the attempt
    #: whose answer was lost deleted it (what it removed is not known; the counts are 0).
    already_gone: bool = False
    #: The aliases removed with the archive (``force``), sorted: the first 1,000 of them.
    aliases_removed: tuple[str, ...] = ()
    #: How many aliases were removed in all (more than ``aliases_removed`` names past 1,000).
    aliases_removed_count: int = 0

    @staticmethod
    def of(message: archives_pb2.DeleteResponse) -> "Deleted":
        named = tuple(message.aliases_removed)
        return Deleted(ArchiveInfo.of(message.deleted), message.blobs_removed, message.bytes_freed,
                       aliases_removed=named, aliases_removed_count=max(message.aliases_removed_count, len(named)))

    @staticmethod
    def gone(name: str) -> "Deleted":
        """What a retried Delete reports for an archive its lost first attempt deleted."""
        epoch = dt.datetime.fromtimestamp(0, dt.timezone.utc)
        return Deleted(ArchiveInfo(name, 0, 0, 0, epoch), 0, 0, already_gone=True)


@dataclass(frozen=True)
class Published:
    """What one publish call sent: payloads, their bytes, and subscribers dropped for falling
    behind; for a publish that asked to be stored too, the archive stored, or why it was not."""

    payloads: int
    nbytes: int
    dropped_subscribers: int
    stored: ArchiveInfo | None = None
    store_error: str = ""

    @staticmethod
    def of(message: channels_pb2.PublishResponse) -> "Published":
        stored = ArchiveInfo.of(message.stored) if message.HasField("stored") else None
        return Published(message.payloads, message.bytes, message.dropped_subscribers, stored, message.store_error)


__all__ = [
    "MARK", "VALUES", "Alias", "ArchiveDescription", "ArchiveInfo", "Deleted", "EntryDescription", "FileDescription",
    "Pruned", "Published", "Tagged", "Untagged", "ValuesDescription", "entry_name", "is_file_entry", "is_kept_entry",
    "split_entry", "values_entry", "values_prefix",
]
