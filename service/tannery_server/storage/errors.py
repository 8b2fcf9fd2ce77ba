"""The storage's own failures: plain exceptions that know nothing of gRPC.

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


class CatalogTooNew(StorageError, RuntimeError):
    """The catalog was written by a newer tannery (its schema version is above the one this code reads)."""


__all__ = ["CatalogTooNew", "DigestMismatch", "OutOfResources", "StorageError", "StorageFull", "StorageUnavailable"]
