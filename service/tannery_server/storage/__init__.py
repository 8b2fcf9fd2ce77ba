"""Where archives live: a catalog (SQLite) and content-addressed blobs (files), behind
the small :class:`Catalog` and :class:`BlobStore` protocols of :mod:`.base`."""

from .base import (ArchiveRecord, BlobFile, BlobInfo, BlobStore, Catalog, CatalogTotals, EntryRecord, ArchiveLimits,
                   TempBlob)
from .reserve import SpaceReserve
from .blob_cache import CachedBlobStore
from .catalog_and_blobs import Collected, Storage
from .errors import StorageFull, StorageUnavailable
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
    "EntryRecord",
    "ArchiveLimits",
    "PayloadWriter",
    "S3BlobStore",
    "SpaceReserve",
    "Storage",
    "StorageFull",
    "StorageUnavailable",
    "TempBlob",
]


def __getattr__(name: str):
    """S3BlobStore on first use: it imports boto3, which only the ``scale`` extra installs."""
    if name == "S3BlobStore":
        from .s3_blobs import S3BlobStore

        return S3BlobStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
