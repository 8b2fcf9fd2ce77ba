"""What a storage error tells a client: the one place where the storage's own errors and
refusals (:mod:`.storage.errors`, plain exceptions) become the server's failures, and so statuses.

Every message is the storage's, unchanged; only the status is chosen here.
"""

from __future__ import annotations

from typing import Protocol

from .failures import AliasRefused, DataLoss, Failure, LimitExceeded, Malformed, Missing, NameTaken, Unavailable
from .storage.errors import (AliasConflict, ArchiveExists, Damaged, DigestMismatch, InvalidRequest, NoSuchArchive, OutOfResources,
                             StorageFull, StorageUnavailable, TooManyEntries)


class Translating(Protocol):
    """A storage, as far as this module needs one: it says what its drivers' errors mean."""

    def storage_error(self, exc: BaseException) -> BaseException: ...


#: Each storage error or refusal, and the failure it is answered with (the first that matches).
STATUSES: tuple[tuple[type[Exception], type[Failure]], ...] = (
    (StorageFull, LimitExceeded),  # RESOURCE_EXHAUSTED: delete archives, raise a limit
    (OutOfResources, LimitExceeded),
    (StorageUnavailable, Unavailable),  # UNAVAILABLE: worth a retry
    (DigestMismatch, Malformed),  # INVALID_ARGUMENT: the bytes are not what the sender said
    (Damaged, DataLoss),  # DATA_LOSS: a stored blob's bytes are lost
    # The refusals: the request's doing, nothing changed.
    (ArchiveExists, NameTaken),  # ALREADY_EXISTS
    (NoSuchArchive, Missing),  # NOT_FOUND
    (AliasConflict, AliasRefused),  # FAILED_PRECONDITION, tannery-error "alias"
    (InvalidRequest, Malformed),  # INVALID_ARGUMENT
    (TooManyEntries, LimitExceeded),  # RESOURCE_EXHAUSTED: over a configured limit
)


def failure_of(exc: BaseException, storage: Translating | None = None) -> BaseException:
    """The failure to answer ``exc`` with. An error of ``storage``'s drivers (files, SQLite) is first
    made the storage error it means (:meth:`~.storage.catalog_and_blobs.Storage.storage_error`: a full
    disk StorageFull, any other I/O or database error StorageUnavailable); a storage error or
    refusal then becomes its failure (:data:`STATUSES`) with the same message. Anything else is returned as
    it is."""
    if storage is not None:
        exc = storage.storage_error(exc)
    for error, failure in STATUSES:
        if isinstance(exc, error):
            answer = failure(str(exc))
            answer.__cause__ = exc
            return answer
    return exc


__all__ = ["STATUSES", "failure_of"]
