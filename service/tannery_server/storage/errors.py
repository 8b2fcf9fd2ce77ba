"""The storage's own failures and refusals: plain exceptions that know nothing of gRPC.

Two kinds: a :class:`StorageError` is the storage failing (a full disk, an I/O error, a
damaged blob); a :class:`Refusal` is the storage declining what it was asked (a name in
use, a source that is not there, a union it may not make), with nothing changed.

The server says what each means to a client (its status) in one place,
:func:`tannery_server.storage_failures.failure_of`; the storage turns its drivers' errors
(files, SQLite) into these with :meth:`~.core.StorageBase.storage_error`.
"""

from __future__ import annotations


class StorageError(Exception):
    """A failure of the storage; the message names what failed and, where there is one, the remedy."""


class StorageFull(StorageError):
    """The disk of the data directory is full (or a file size limit stopped a write): the message
    names it and the remedy."""


class OutOfResources(StorageError):
    """The machine is out of descriptors or memory."""


class StorageUnavailable(StorageError):
    """The storage failed to answer (an I/O or database error): worth a retry."""


class DigestMismatch(StorageError):
    """A payload hashed to another SHA-256 than the one its sender gave ahead of it (the bytes
    changed on the way, or the sender hashed something else)."""


class Damaged(StorageError):
    """A stored blob is missing, truncated, or no longer matches its checksums: its bytes are
    lost (none of them is served; the reader reports the blob damaged)."""


class CatalogTooNew(StorageError, RuntimeError):
    """The catalog was written by a newer tannery (its schema version is above the one this code reads)."""


class WrongBlobStore(StorageError):
    """The blob store given is not the one the shared catalog was first started with (:mod:`.deployment`)."""


class Refusal(Exception):
    """The storage declines what it was asked, and changed nothing: the request's doing, not a
    failure of the storage. The message names what was refused and why."""


class ArchiveExists(Refusal):
    """An archive of that name exists (and the write did not ask to replace it), or exists
    with other content than a Store or Union without ``replace`` would make (the message names
    the first difference)."""


class NoSuchArchive(Refusal):
    """An archive the request names (a source of a union) is not there."""


class AliasConflict(Refusal):
    """A write that aliases forbid: a compare-and-set Tag whose alias moved meanwhile, a name
    that is an alias where an archive is needed (or the reverse), an archive an alias points at
    deleted without ``force``. The message names the alias, its target and the remedy."""


class InvalidRequest(Refusal):
    """The request would make an archive the rules forbid: a union giving one entry name from
    two sources, or an entry name over the name limit."""


class TooManyEntries(Refusal):
    """The request would make an archive of more entries than the configured limit."""


__all__ = ["AliasConflict", "ArchiveExists", "CatalogTooNew", "Damaged", "DigestMismatch", "InvalidRequest", "NoSuchArchive",
           "OutOfResources", "Refusal", "StorageError", "StorageFull", "StorageUnavailable", "TooManyEntries"]
