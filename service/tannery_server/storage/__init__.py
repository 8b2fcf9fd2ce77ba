"""Where archives live: a catalog (SQLite) and content-addressed blobs (files), behind
the small :class:`Catalog` and :class:`BlobStore` protocols of :mod:`.base`.

``PostgresCatalog`` and ``S3BlobStore`` (what replicas share) are imported on first use, so
the embedded server never needs psycopg or boto3."""

from .base import (ArchiveRecord, BlobFile, BlobInfo, BlobStore, Catalog, CatalogTotals, EntryRecord, ArchiveLimits,
                   SharedCatalog, TempBlob)
from .reserve import SpaceReserve
from .blob_cache import CachedBlobStore
from .catalog_and_blobs import Collected, Storage
from .errors import DigestMismatch, OutOfResources, StorageError, StorageFull, StorageUnavailable
from .lock import DataDirectoryInUse, DataDirectoryLock
from .payload_writer import PayloadWriter
from .sqlite_catalog import CatalogTooNew

__all__ = [
    "ArchiveRecord",
    "BlobFile",
    "BlobInfo",
    "BlobStore",
    "Catalog",
    "CachedBlobStore",
    "CatalogTooNew",
    "CatalogTotals",
    "Collected",
    "DataDirectoryInUse",
    "DataDirectoryLock",
    "DigestMismatch",
    "EntryRecord",
    "OutOfResources",
    "ArchiveLimits",
    "PayloadWriter",
    "PostgresCatalog",
    "S3BlobStore",
    "SpaceReserve",
    "SharedCatalog",
    "Storage",
    "StorageError",
    "StorageFull",
    "StorageUnavailable",
    "TempBlob",
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
