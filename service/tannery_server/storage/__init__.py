"""Where archives live: a catalog and content-addressed blobs, behind the :class:`Catalog` and
:class:`BlobStore` bases of :mod:`.base`, kept consistent by a :class:`StorageBase`: the
embedded :class:`Storage` (SQLite and files) or :class:`~.shared_storage.SharedStorage`
(PostgreSQL and a bucket, for replicas). Its errors and refusals (:mod:`.errors`) are plain exceptions;
the server gives them their statuses (``tannery_server.storage_failures``).

``PostgresCatalog`` and ``S3BlobStore`` (what replicas share) are imported on first use, so
the embedded server never needs psycopg or boto3."""

from .base import (AliasMove, AliasPage, AliasRecord, MoveNote, ArchiveRead, ArchiveRecord, BlobFile, BlobInfo, BlobStore, Catalog, CatalogTotals, EntryRecord, ArchiveLimits,
                   SharedCatalog, TempBlob)
from .reserve import SpaceReserve
from .blob_cache import CachedBlobStore
from .catalog_and_blobs import Storage
from .core import Collected, StorageBase
from .errors import (AliasConflict, ArchiveExists, CatalogTooNew, WrongBlobStore, Damaged, DigestMismatch, InvalidRequest, NoSuchArchive, OutOfResources,
                     Refusal, StorageError, StorageFull, StorageUnavailable, TooManyEntries)
from .lock import DataDirectoryInUse, DataDirectoryLock
from .payload_writer import PayloadWriter

__all__ = [
    "AliasMove", "AliasPage", "MoveNote",
    "AliasConflict",
    "AliasRecord",
    "ArchiveExists",
    "ArchiveRead",
    "ArchiveRecord",
    "BlobFile",
    "BlobInfo",
    "BlobStore",
    "Catalog",
    "CachedBlobStore",
    "CatalogTooNew",
    "WrongBlobStore",
    "CatalogTotals",
    "Collected",
    "Damaged",
    "DataDirectoryInUse",
    "DataDirectoryLock",
    "DigestMismatch",
    "EntryRecord",
    "InvalidRequest",
    "NoSuchArchive",
    "OutOfResources",
    "ArchiveLimits",
    "PayloadWriter",
    "PostgresCatalog",
    "Refusal",
    "S3BlobStore",
    "SpaceReserve",
    "SharedCatalog",
    "Storage",
    "StorageBase",
    "StorageError",
    "StorageFull",
    "StorageUnavailable",
    "TempBlob",
    "TooManyEntries",
]


def __getattr__(name: str):
    """The drivers of a shared store on first use: psycopg and boto3 come with the ``scale`` extra."""
    if name == "PostgresCatalog":
        from .postgres_catalog import PostgresCatalog

        return PostgresCatalog
    if name == "S3BlobStore":
        from .s3_blobs import S3BlobStore

        return S3BlobStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
